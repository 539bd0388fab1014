"""Durability scenarios: which actors, which faults, derived from a seed; running one and checking it.

A scenario is ``(seed, kind, backend)``. The kind fixes the cast, the seed
everything else (crash points, fault rates, when a taker starts, retention,
checkpoint position), so ``run_scenario(seed, kind, backend)`` replays
exactly. Kinds:

- ``crash-restart``: the holder is crash-stopped at a storage call; a taker
  re-issues the run (or ``resume()``), may crash too, and a second one finishes;
- ``zombie``: a taker re-issues the run while the holder is still running;
- ``compaction``: one or two compactors and cold readers run beside the holder
  (small retention, so many tombstones);
- ``prune``: a pruner cuts the session at a checkpoint's time while the run is
  unfinished; a taker then re-issues the run;
- ``lease-loss``: a lifecycle rule deletes ``lease.json`` mid-run; a taker follows;
- ``outage``: the holder cannot read its lease (or reach the store) for a while;
- ``chaos``: all of the above at once, with more faults;
- ``clock-skew``: after the first run finished, a writer whose clock is an
  hour behind starts the next run and crashes; a third re-issues it;
- ``lease-storm``: five writers re-issue the same run at once (each fences
  the one before), sometimes while a lifecycle rule deletes ``lease.json``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from durability_actors import ROLES
from durability_checks import Violation, check_all
from durability_explore import explore_summary
from durability_history import History
from durability_index import check_index
from durability_kinds import BUILDERS
from durability_move_checks import check_moves
from durability_views import check_views
from durability_world import Spec, World, close_readers

from loomray.storage.faults import Fault, FaultPlan

KINDS = tuple(BUILDERS)
BACKENDS = ("memory", "local", "s3")


def build_spec(seed: int, kind: str, backend: str) -> Spec:
    """The scenario of ``(seed, kind)`` on ``backend``."""
    if kind not in KINDS:
        raise ValueError(f"unknown scenario kind {kind!r}; one of {KINDS}")
    rng = random.Random(f"{kind}/{seed}")
    spec = Spec(seed=seed, kind=kind, backend=backend, passes=rng.choice([3, 4, 5]),
                position=rng.choice(["after_tools", "both"]), keep=rng.choice([1, 2, 3, 20]),
                user_id=rng.choice([None, "u1"]))
    # Chains and batches from a stream of their own, so that the interleavings the other choices give a seed
    # stay what they were: short chains (full snapshots, collection of what they no longer need) and small
    # batches (rows, retention and acknowledgements every write or few) in most scenarios.
    chain_rng = random.Random(f"{kind}/{seed}/chain")
    spec.full_every, spec.batch = chain_rng.choice([2, 3, 500]), chain_rng.choice([1, 2, 3, 16])
    spec.durability = random.Random(f"{kind}/{seed}/durability").choice(["sync", "sync", "async"])
    plan = FaultPlan(seed=seed)
    actors = spec.actors
    resume_or_run = lambda: rng.choice(["run", "run", "resume"])  # noqa: E731

    def crash(actor: str, lo: int, hi: int, p: float = 1.0) -> None:
        if rng.random() < p:
            k = rng.randint(lo, hi)
            plan.by_actor[(actor, k)] = Fault("crash")
            spec.notes.append(f"{actor} crashes at its call {k}")

    BUILDERS[kind](spec, rng, plan, actors, crash, resume_or_run)
    spec.plan = plan
    return spec


def pick(seed: int, backends: tuple[str, ...] = ("memory", "local")) -> tuple[str, str]:
    """The (kind, backend) a soak seed runs: kinds in turn, the backend drawn from ``backends``."""
    kind = KINDS[seed % len(KINDS)]
    rng = random.Random(f"backend/{seed}")
    weights = {"memory": 6, "local": 4, "s3": 1}
    choices = [b for b in backends for _ in range(weights[b])]
    return kind, rng.choice(choices)


@dataclass
class Result:
    seed: int
    kind: str
    backend: str
    violations: list[Violation] = field(default_factory=list)
    calls: int = 0
    injected: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    summary: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    #: Re-executions the invariants allow by design (a step journaled inside a takeover's listing window).
    excused: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def command(self) -> str:
        return f"make soak SEED={self.seed} SCENARIO={self.kind} BACKEND={self.backend}"

    def report(self, verbose: bool = False) -> str:
        lines = [f"seed {self.seed} scenario {self.kind} backend {self.backend}: {len(self.violations)} violation(s), "
                 f"{self.calls} storage calls, faults {dict(self.injected)}, {self.seconds:.2f}s"]
        lines += [f"  {v}" for v in self.violations]
        if verbose:
            lines += ["  " + s for s in self.summary]
            lines += ["  " + t for t in self.trace]
        lines.append(f"  replay: {self.command()}")
        return "\n".join(lines)


@contextlib.contextmanager
def backoff_without_waiting() -> Iterator[None]:
    """Storage's retry backoffs return at once, and its deadline clock moves on by what they would have slept.

    The scheduler lets one actor run at a time, so an actor sleeping out a backoff holds every other
    actor up and changes nothing else: the interleaving is the seed's. Skipping the sleep keeps each
    retry, each jittered delay and each deadline (``storage.backoff.clock`` runs ahead by the delays
    skipped, so an acquire gives up after as many rounds as it would have), without the wall time.
    """
    from loomray.storage import backoff, index

    skipped = [0.0]
    lock = threading.Lock()

    def sleep(delay: float) -> None:
        with lock:
            skipped[0] += delay

    def clock() -> float:
        return time.monotonic() + skipped[0]

    saved = backoff.sleep, backoff.clock, index._sleep
    backoff.sleep, backoff.clock, index._sleep = sleep, clock, sleep
    try:
        yield
    finally:
        backoff.sleep, backoff.clock, index._sleep = saved


def _final_views(world: World, final: Any) -> list[Violation]:
    """The oracle of every view, after a compaction that drops every tombstone (what an hour later brings)."""
    import loomray.storage.table as storage_table

    real = storage_table.utcnow
    # Past INTENT_TTL too: a write phase a faulted compactor left behind has expired, so the table is rebuilt.
    storage_table.utcnow = lambda: real() + storage_table.INTENT_TTL + timedelta(minutes=1)
    try:
        final.compact(tombstone_grace=timedelta(0))
    except Exception as e:
        return [Violation("index-objects", f"compaction without grace failed: {type(e).__name__}: {e}")]
    finally:
        storage_table.utcnow = real
    try:
        return check_views(world, final)
    except Exception as e:  # a reader that raises is a finding too
        return [Violation("views-agree", f"a view raised {type(e).__name__}: {e}\n{traceback.format_exc()}")]


def run_scenario(seed: int, kind: str, backend: str = "memory", *, s3_server: Any = None,
                 stall_timeout: float = 60.0, wrap_inner: Any = None) -> Result:
    """Run one scenario and check every invariant (``wrap_inner``: see :class:`World`)."""
    spec = build_spec(seed, kind, backend)
    t0 = time.monotonic()
    world = World(spec, s3_server=s3_server, stall_timeout=stall_timeout, wrap_inner=wrap_inner)
    result = Result(seed, kind, backend)
    quiet = logging.getLogger("loomray"), logging.getLogger("storage")
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)  # warn-and-go-on messages are expected by the thousand here
    try:
        with backoff_without_waiting():
            world.run(ROLES)
        final = world.new_store(world.inner)
        result.violations += check_all(world, final)
        result.violations += check_moves(world, History.build(world.faulty.calls, world.spec.session_id))
        result.excused = list(world.excused)
        try:
            final.compact()
        except Exception as e:  # the final, fault-free compaction must work
            result.violations.append(Violation("index-objects", f"final compaction failed: {type(e).__name__}: {e}"))
        else:
            result.violations += check_index(world, final)
            seen = {str(v) for v in result.violations}
            for v in check_all(world, final):
                if v.invariant in ("acked-readable", "latest-epoch", "latest-fenced") and str(v) not in seen:
                    result.violations.append(Violation(v.invariant, f"after the final compaction: {v.detail}"))
            result.violations += _final_views(world, final)
        close_readers(final)
        result.calls = world.faulty.call_count
        result.injected = Counter(world.faulty.injected)
        result.summary = [f"note: {n}" for n in spec.notes] + [f"excused: {x}" for x in result.excused] + [
            f"{i.id} ({i.kind}): calls {i.start}-{i.end} epoch {i.epoch} run {i.run_id} "
            f"outcome {i.outcome}{': ' + (i.error or '')[:200] if i.error else ''}; model calls "
            f"{[(p, t) for p, t, _ in i.model_calls]}; tools {[(p, s) for p, _, s, _ in i.tool_runs]}; "
            f"replays {[(p, s) for p, _, _, s, _ in i.replays]}; acks {[(p, c[-10:]) for p, c, _, _ in i.acks]}"
            for i in world.incarnations]
        result.summary += [f"compaction {c}" for c in world.compactions]
        result.summary += [f"prune {p}" for p in world.prunes]
        result.summary += [f"reader {o}" for o in world.readers]
        result.summary += explore_summary(world)
        result.trace = [f"#{c.n} {c.actor} {c.op} {c.key or ''}{' ' + str(len(c.keys)) + ' keys' if len(c.keys) > 1 else ''}"
                        f" -> {c.outcome}{' [' + c.fault + ']' if c.fault else ''}" for c in world.faulty.calls]
    finally:
        for q, lvl in zip(quiet, levels, strict=False):
            q.setLevel(lvl)
        world.close()
    result.seconds = time.monotonic() - t0
    return result
