"""The actors of a durability scenario and the shared ledger they write to.

A :class:`World` is one scenario: one inner object store (memory, a local
directory or an S3 bucket), one :class:`~storage.faults.FaultyObjectStore`
over it (so every call by every actor is numbered in one sequence), a
:class:`~durability_sched.Scheduler`, and a ledger of what the agent did:
every real model call and tool effect, every replayed step, every checkpoint
acknowledged, with the storage call number at which it happened.

Actors (each a thread, each with its own ``Store`` as if it were a process):

- writers (the lease holder, a taking-over writer, a zombie): a real
  ``loomray`` agent loop through :func:`loomray.session.execute_request`,
  with a scripted model and a tool whose effects are counted; a writer that
  fails with a storage error is restarted (a new incarnation, a new epoch);
- compactors (``store.compact()``), a pruner (``store.prune(before=...)``),
  a lease vandal (a bucket lifecycle rule deleting ``lease.json``), and cold
  readers (a fresh ``Store`` listing and reading "latest").

Time positions are storage call numbers: since exactly one actor runs at a
time, "the ledger event happened after call n" is exact.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import shutil
import tempfile
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from durability_clocks import run_with_clocks
from durability_sched import Scheduler

from loomray import Agent, Tuning
from loomray.config import CheckpointConfig
from loomray.errors import LoomrayError
from loomray.journal import tool_step_key
from loomray.models.scripted import ScriptedModel
from loomray.session import RunRequest, execute_request
from loomray.storage.errors import CorruptObjectError, LeaseCorruptError, LeaseLostError, ObjectNotFound, StorageError
from loomray.storage.faults import ActorCrashed, FaultPlan, FaultyObjectStore
from loomray.storage.store import Store
from loomray.tools import ToolContext

#: The incarnation whose asyncio tasks are running (set before ``asyncio.run``; tasks copy it).
current_inc: contextvars.ContextVar[Incarnation | None] = contextvars.ContextVar("durability_inc", default=None)


class _SerialPool:
    def map(self, fn, *iterables):
        return list(map(fn, *iterables))

    def shutdown(self, wait: bool = True) -> None:
        pass


class _AnyOrderPool(_SerialPool):
    """A round's calls one at a time on the caller's thread, in a seeded order, results in input order: a remote
    store serves the calls of one round (made in parallel) in any order, and other actors go on between them
    (``pause(steps)``: let them make that many calls)."""

    def __init__(self, rng: random.Random, pause: Any) -> None:
        self.rng, self.pause = rng, pause

    def map(self, fn, *iterables):
        items = list(zip(*iterables, strict=True))
        order = list(range(len(items)))
        self.rng.shuffle(order)
        out: list[Any] = [None] * len(items)
        for n, i in enumerate(order):
            if n:
                self.pause(self.rng.randint(0, 80))
            out[i] = fn(*items[i])
        return out


def close_readers(store: Store) -> None:
    """Stop ``store``'s reader threads, leaving the shared faulty backend open for the other stores."""
    try:
        store.close(keep_objects=True)
    except TypeError:  # a tree before that keyword: its index reader was a public attribute
        store.index.close()


def _untyped_storage_error(e: BaseException) -> BaseException | None:
    """A storage error in ``e``'s cause chain that no injected fault explains (a bare StorageError, a corrupt
    object, a missing key). Injected faults surface as TransientStorageError; fencing as LeaseLostError."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, LeaseCorruptError):  # typed: a lease no reader can parse stops the run, no guess
            return None
        if type(cur) is StorageError or isinstance(cur, (CorruptObjectError, ObjectNotFound)):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


@dataclass
class Incarnation:
    """One execution of a run request by one writer actor (one process lifetime)."""

    id: str
    actor: str
    kind: str
    start: int
    store: Any = None
    end: int | None = None
    run_id: str | None = None
    turn: int = 0
    outcome: str = "running"
    error: str | None = None
    #: The epoch it was granted and the call that granted it (filled in by the checks, from the call log).
    epoch: int | None = None
    acquired: int | None = None
    #: (position, turn, stamp) of every real model call.
    model_calls: list[tuple[int, int, int]] = field(default_factory=list)
    #: (position, run_id, step_key, n) of every real tool execution.
    tool_runs: list[tuple[int, str | None, str, int]] = field(default_factory=list)
    #: (position, kind, run_id, step_key, stamp) of every step answered from the journal.
    replays: list[tuple[int, str, str | None, str, int | None]] = field(default_factory=list)
    #: (position, checkpoint_id, execution_status, wall time) of every acknowledged checkpoint.
    acks: list[tuple[int, str, str, datetime]] = field(default_factory=list)
    ckpt_failures: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass
class ReaderObs:
    """What one cold read saw: "latest", the head of the listing, between calls ``start`` and ``end``."""

    actor: str
    start: int
    end: int = 0
    latest_id: str | None = None
    latest_epoch: int | None = None
    head_id: str | None = None
    listed: list[str] = field(default_factory=list)
    explicit_ok: bool | None = None
    error: str | None = None
    transient: bool = False


@dataclass
class Spec:
    """Everything a scenario is made of, derived from (seed, kind)."""

    seed: int
    kind: str
    backend: str
    passes: int = 4
    position: str = "after_tools"
    keep: int = 20
    #: Links before a full checkpoint, and checkpoints a writer's log indexes (and acknowledges) at once.
    full_every: int = 500
    batch: int = 16
    #: ``Tuning.durability``: "async" overlaps a run's first upload (and any after a model call slower than an
    #: upload) with the next model call.
    durability: str = "sync"
    user_id: str | None = None
    plan: FaultPlan = field(default_factory=FaultPlan)
    #: (name, role, options) of every actor.
    actors: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)
    #: Clock skew in seconds per actor, as seen by the ids it makes (run and checkpoint ids are time-sortable).
    skews: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Runs of the same task a session goes through ("run2" requests continue the finished conversation).
    rounds: int = 1
    #: actor -> (where, n, seconds, until): its first incarnation stops inside tool effect n ("tool") or the model
    #: call of pass n ("model") until the actors ``until`` are done, and the run's clock moves on by ``seconds``.
    stalls: dict[str, tuple[str, int, float, tuple[str, ...]]] = field(default_factory=dict)

    @property
    def session_id(self) -> str:
        return f"sess-{self.kind}-{self.seed}"

    @property
    def prompt(self) -> str:
        return f"do the {self.passes} effects of task {self.seed}"


class World:
    """One scenario's store, scheduler, actors and ledger."""

    def __init__(self, spec: Spec, *, s3_server: Any = None, stall_timeout: float = 60.0,
                 wrap_inner: Any = None) -> None:
        self.spec = spec
        self.sched = Scheduler(spec.seed, stall_timeout=stall_timeout)
        self.tmp: Path | None = None
        self.bucket: str | None = None
        self.s3_server = s3_server
        self.inner = self._make_inner(spec.backend)
        # wrap_inner: a deliberately broken backend between the log and the bytes (to test the checker itself).
        below = wrap_inner(self.inner) if wrap_inner is not None else self.inner
        self.faulty = FaultyObjectStore(below, spec.plan, gate=self.sched.gate, actor=self.sched.actor_of_call)
        self.sched.on_stall = self.faulty.kill
        self.sched.world = self  # start conditions may look at the ledger
        self.url = f"{spec.backend}://durability-{spec.seed}"
        self.incarnations: list[Incarnation] = []
        self.readers: list[ReaderObs] = []
        self.compactions: list[tuple[str, int, int, str]] = []
        self.prunes: list[tuple[str, int, int, datetime, str]] = []
        self.vandalism: list[tuple[str, int]] = []
        #: (actor, checkpoint_id, outcome) of every delete_checkpoint a deleter made.
        self.deletes: list[tuple[str, str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        #: Re-executions the billing invariant allowed (filled in by the checks).
        self.excused: list[str] = []
        self._stamp = 0
        #: actor -> the call at which it stalled; (incarnation, turn, start, end, seconds) of every stalled model call.
        self.stalled: dict[str, int] = {}
        self.spans: list[tuple[str, int, int, int, float]] = []
        #: Seconds the runs' lease-proof clock (``loomray.run_writes``) is ahead of the real one.
        self.clock_shift = 0.0
        #: What the move actors saw (forks, lease corruptions, control runs): see durability_moves.
        self.forks: list[dict[str, Any]] = []
        self.corruptions: list[int] = []
        self.control: list[tuple[str, str]] = []
        self.stores: list[Store] = []
        self.clocks: dict[str | None, tuple[int, int]] = {}
        self.agent = self._make_agent()

    # -- backends ------------------------------------------------------------
    def _make_inner(self, backend: str):
        if backend == "memory":
            from loomray.storage.memory import MemoryObjectStore

            return MemoryObjectStore(f"durability-{self.spec.seed}-{uuid.uuid4().hex[:6]}")
        if backend == "local":
            from loomray.storage.localdir import LocalObjectStore

            self.tmp = Path(tempfile.mkdtemp(prefix="loomray-durability-"))
            return LocalObjectStore(self.tmp / "store")
        if backend == "s3":
            from loomray.storage.s3 import S3ObjectStore

            if self.s3_server is None:
                raise RuntimeError("the s3 backend needs a running MotoS3Server")
            self.bucket = self.s3_server.new_bucket("durability")
            opts = self.s3_server.options
            return S3ObjectStore(self.bucket, "root", endpoint_url=opts["endpoint_url"], key=opts["key"],
                                 secret=opts["secret"], region=opts["region"], max_attempts=2)
        raise ValueError(f"unknown backend {backend!r}")

    def new_store(self, objects: Any = None, *, any_order: random.Random | None = None) -> Store:
        """A fresh ``Store`` (a new process's view) over the faulty store, reads on the calling thread.

        ``any_order``: the calls of each of its parallel rounds are made in an order this draws (as a remote
        store may serve them), on every backend; else in the order they are asked for.
        """
        objects = self.faulty if objects is None else objects
        try:
            store = Store(objects, self.url, serial_reads=True, checkpoint_batch=self.spec.batch)
        except TypeError:  # a tree without these keywords: same effect
            store = Store(objects, self.url)
            store.index._pool = _SerialPool()
        if any_order is not None:
            index = store._index
            index._pool, index._local = _AnyOrderPool(any_order, self.sched.pause), False  # serial stays: no thread of its own
        return store

    def close(self) -> None:
        for store in self.stores:
            close_readers(store)
        try:
            self.inner.close()
        finally:
            if self.tmp is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the agent -----------------------------------------------------------
    def _make_agent(self) -> Agent:
        world = self
        replies: list[Any] = []
        for r in range(self.spec.rounds):
            replies += [{"tool": "effect", "args": {"n": r * self.spec.passes + i}} for i in range(self.spec.passes)]
            replies.append(f"all {self.spec.passes} effects of round {r} done")

        class LedgerModel:
            """The scripted model; every real call is counted and stamped (in usage, outside any hash)."""

            name = "scripted-ledger"

            def __init__(self) -> None:
                self.inner = ScriptedModel(replies)

            async def complete(self, request):
                inc = current_inc.get()
                world.faulty.check_alive(inc.actor if inc else None)
                stamp = world.next_stamp()
                if inc is not None:
                    start = world.faulty.call_count
                    inc.model_calls.append((start, inc.turn, stamp))
                    if world.stall(inc, "model", inc.turn):
                        world.spans.append((inc.id, inc.turn, start, world.faulty.call_count, world.clock_shift))
                response = await self.inner.complete(request)
                usage = response.usage.model_copy(update={"cache_read_tokens": stamp})
                return response.model_copy(update={"usage": usage})

        def effect(n: int, ctx: ToolContext) -> str:
            """Perform side effect number n (counted in the shared ledger)."""
            inc = current_inc.get()
            world.faulty.check_alive(inc.actor if inc else None)
            if inc is not None:
                world.stall(inc, "tool", n)
                inc.tool_runs.append((world.faulty.call_count, ctx.run_id, tool_step_key(ctx.turn, ctx.tool_call_id), n))
            return f"effect {n} done"

        tuning = Tuning(checkpoint=CheckpointConfig(position=self.spec.position, full_every=self.spec.full_every),
                        durability=self.spec.durability, journal=True,
                        max_turns=self.spec.passes * self.spec.rounds + 5)
        return Agent("Do the effects one by one.", model=LedgerModel(), tools=[effect], tuning=tuning,
                     name="durability-agent")

    def stall(self, inc: Incarnation, where: str, n: int) -> bool:
        """Stop ``inc`` here until every other actor is done, if its spec says so (its first incarnation only)."""
        what = self.spec.stalls.get(inc.actor)
        if what is None or what[:2] != (where, n) or inc.actor in self.stalled or not inc.id.endswith("#1"):
            return False
        self.stalled[inc.actor] = self.faulty.call_count
        self.clock_shift += what[2]
        while not all(self.sched.done(name) for name in what[3]):
            self.sched.pause(1)
        self.faulty.check_alive(inc.actor)
        return True

    def next_stamp(self) -> int:
        self._stamp += 1
        return self._stamp

    def request(self, kind: str) -> RunRequest:
        sid, uid = self.spec.session_id, self.spec.user_id
        if kind == "resume":
            return RunRequest(kind="resume", prompt=None, session_id=sid, user_id=uid, metadata=self.tag)
        if kind == "run2":  # a new run of the finished conversation
            return RunRequest(kind="run", prompt=self.spec.prompt + " again", session_id=sid, user_id=uid,
                              metadata=self.tag)
        return RunRequest(kind="run", prompt=self.spec.prompt, session_id=sid, user_id=uid, metadata=self.tag)

    @property
    def tag(self) -> dict[str, str]:
        """The metadata every run request carries: what a run record holds and prune must remove."""
        return {"durability_tag": f"tag-{self.spec.seed}-{self.spec.kind}"}

    # -- actors ----------------------------------------------------------------
    def writer(self, name: str, kind: str = "run", attempts: int = 3):
        world = self

        def emit(inc: Incarnation):
            def on_event(event) -> None:
                pos = world.faulty.call_count
                t = event.type
                if t in ("run_start", "model_call"):
                    inc.run_id = event.run_id
                    inc.turn = event.turn
                elif t == "model_response" and event.replayed:
                    inc.replays.append((pos, "model", event.run_id, f"t{event.turn:04d}-model",
                                        event.usage.cache_read_tokens))
                elif t == "tool_result" and event.replayed:
                    inc.replays.append((pos, "tool", event.run_id, tool_step_key(event.turn, event.tool_call_id), None))
                elif t == "checkpoint":
                    if event.ok:
                        inc.acks.append((pos, event.checkpoint_id, event.execution_status, datetime.now(timezone.utc)))
                    else:
                        inc.ckpt_failures.append((pos, event.checkpoint_id, event.error or ""))
            return on_event

        def fn() -> None:
            for attempt in range(attempts):
                inc = Incarnation(f"{name}#{attempt + 1}", name, kind, start=world.faulty.call_count)
                inc.store = world.new_store()
                world.stores.append(inc.store)  # closed with the world: a deleter may use the store a run wrote with
                world.incarnations.append(inc)
                token = current_inc.set(inc)
                try:
                    asyncio.run(execute_request(world.agent, world.request(kind), inc.store,
                                                max_checkpoints_per_session=world.spec.keep, emit=emit(inc),
                                                owner=inc.id))
                    inc.outcome = "ok"
                    return
                except ActorCrashed:
                    inc.outcome = "crashed"
                    raise
                except LeaseLostError as e:
                    inc.outcome, inc.error = "fenced", str(e)
                    return
                except (StorageError, LoomrayError) as e:
                    inc.outcome, inc.error = type(e).__name__, str(e)
                    untyped = _untyped_storage_error(e)
                    if untyped is not None:
                        world.unexpected.append((inc.id, f"{type(untyped).__name__} escaped the run untyped: "
                                                         f"{untyped}\n{traceback.format_exc()}"))
                        return
                    if type(e).__name__ == "CheckpointNotFound":
                        return
                except Exception as e:
                    inc.outcome, inc.error = type(e).__name__, str(e)
                    world.unexpected.append((inc.id, traceback.format_exc()))
                    return
                finally:
                    current_inc.reset(token)
                    inc.end = world.faulty.call_count
        return fn

    # -- running -----------------------------------------------------------------
    def add_actors(self, roles: dict[str, Any]) -> None:
        """Register the spec's actors; ``roles`` maps a role to ``factory(world, name, **options)``."""
        for name, role, opts in self.spec.actors:
            opts = dict(opts)
            start_when = opts.pop("start_when", None)
            factory = roles[role]
            self.sched.add(name, factory(self, name, **opts), start_when=start_when)

    def run(self, roles: dict[str, Any]) -> None:
        """Register the actors and run them all to their end (see :func:`durability_clocks.run_with_clocks`)."""
        self.add_actors(roles)
        import loomray.storage.maintenance as maintenance

        # A compaction merges partitions on 4 threads of a remote store's own pool; threads without an actor's
        # name cannot be scheduled one call at a time, so every merge runs on its actor's thread, as on local.
        saved = maintenance._pool
        maintenance._pool = lambda store: maintenance.SerialPool()
        try:
            run_with_clocks(self)
        finally:
            maintenance._pool = saved
