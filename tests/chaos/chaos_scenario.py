"""One chaos scenario: a seeded plan, its run against a real cluster, and the oracle's verdict.

A plan (:func:`plan`, pure: the same seed gives the same plan) is a placement,
``sessions`` sessions of kinds drawn from :data:`chaos_kinds.KINDS`, and a few
faults at times drawn between 0.3 s and 3 s after the sessions are handed over:

- ``kill_process``: the process hosting a session dies (``ray.kill``: its own
  actor, or with dense placement its host and every session on it);
- ``kill_supervisor``: the supervisor dies (``supervise``, running all along,
  re-creates it; drivers resend what they were waiting for);
- ``kill_node``: the worker node of a session is removed (SIGKILL of its
  raylet and workers), and a fresh one added (in the main thread: Ray installs
  signal handlers when it starts a node, which only the main thread may; from a
  worker thread the add failed, and two node losses in one scenario left no
  node that can host a session);
- ``kill_driver``: the driver of a session dies: a session the plan kills
  the driver of is run by a driver process of its own (:mod:`chaos_driver`),
  started before the scenario's clock and killed with SIGKILL, mid-hand-off
  or mid-wait (the run goes on without it, as after ``loomray submit``; the
  oracle follows the store);
- ``cancel``, ``pause``, ``signal``: control requests on a session mid-flight;
- ``approve``: the session's pending approval is granted once it waits for one.

The oracle (:func:`verdict`), once every session ended or the bound passed:
each session ends in a terminal or waiting state within the bound; no model
call is made twice (the logged calls); no healthy session fails (whatever its
neighbours did); a crashing session fails (contained); every driver that was
not killed got its answer; and the supervisor's view of each session it
knows agrees with the store row.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import chaos_kinds

HERE = Path(__file__).resolve().parent
#: Restarts charged to a session before it fails (kept low so an os._exit session fails quickly).
MAX_RESTARTS = 4
#: How long sessions still active at the bound are watched further, to tell slow from stuck (still violations).
LATE_S = 240.0
#: Seconds a session whose driver died must stay unknown (no row, no supervisor) to count as never started.
UNSTARTED_S = 5.0
#: Seconds a driver process has to connect before the scenario starts without it (a checker failure).
DRIVER_READY_S = 120.0

FAULTS = ("kill_process", "kill_supervisor", "kill_node", "kill_driver", "cancel", "pause", "signal", "approve")
#: Store row states a session may rest in: terminal, or waiting for someone.
RESTING = ("completed", "failed", "cancelled", "paused", "awaiting_approval", "budget_exceeded")


@dataclass
class Plan:
    """What one seed does: where sessions run, which kinds, which faults when (seconds) and on whom."""

    seed: int
    placement: str
    kinds: list[str]
    faults: list[tuple[float, str, int]]

    @property
    def sessions(self) -> list[str]:
        return [f"c{self.seed}-{i}-{kind}" for i, kind in enumerate(self.kinds)]


def plan(seed: int, sessions: int = 5) -> Plan:
    """The plan of ``seed``: placements alternate with the seed; kinds and faults are drawn."""
    rng = random.Random(seed)
    kinds = [rng.choice(chaos_kinds.KINDS) for _ in range(sessions)]
    if not any(k in chaos_kinds.HEALTHY for k in kinds):
        kinds[0] = "sleep"  # someone to be harmed
    drawn = [(round(rng.uniform(0.3, 3.0), 2), rng.choice(FAULTS), rng.randrange(sessions))
             for _ in range(rng.randint(2, 3))]
    # An approval does something only to a session that asks for one: aim it at one if there is one (no
    # draw, so every other plan stays as it was).
    asking = [i for i, k in enumerate(kinds) if k == "approval"]
    faults = sorted((at, f, asking[0] if f == "approve" and kinds[t] != "approval" and asking else t)
                    for at, f, t in drawn)
    return Plan(seed, ("actor", "dense")[seed % 2], kinds, faults)


@dataclass
class Run:
    """A plan under way: the drivers' tasks and what the faults did to whom."""

    plan: Plan
    runtime: Any
    cluster: Any
    agents: dict[str, Any]
    tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    #: Driver processes of the sessions whose driver the plan kills (:mod:`chaos_driver`).
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    touched: dict[str, set[str]] = field(default_factory=dict)
    #: Faults that found nothing to break (the session had ended, say): printed, not violations.
    notes: list[str] = field(default_factory=list)
    #: Faults the checker itself failed to inject: violations (the scenario did not test what it says).
    broken: list[str] = field(default_factory=list)


class InjectorError(Exception):
    """The checker could not do what its plan says (not the system under test failing)."""


def runtime(placement: str, store: str | os.PathLike[str], address: str | None = None) -> Any:
    """The Ray runtime every driver of ``placement`` uses (in the checker's process or a driver's own)."""
    from loomray.runtime import RayRuntime

    options = {"resources": {"loomray_session": 1}}
    if placement == "actor":
        return RayRuntime(store, address, actor_options=options,
                          max_restarts_per_session=MAX_RESTARTS)
    return RayRuntime(store, address, actor_options=options, placement="dense", hosts_per_node=1,
                      max_restarts_per_session=MAX_RESTARTS)


def driver_agent(kind: str, runtime: Any) -> Any:
    """The driver's handle on agent ``kind``: the Ray runtime and its reference."""
    from loomray.runtime.actors import set_agent_ref

    agent = copy.copy(getattr(chaos_kinds, chaos_kinds.ref(kind).split(":")[1]))
    agent.runtime = runtime
    set_agent_ref(agent, chaos_kinds.ref(kind))
    return agent


async def execute(p: Plan, runtime: Any, cluster: Any, bound_s: float) -> tuple[list[str], list[str]]:
    """Run plan ``p``: the oracle's violations (empty: the scenario held) and the notes on faults that found
    nothing to break."""
    run = Run(p, runtime, cluster, {k: driver_agent(k, runtime) for k in set(p.kinds)})
    loop = asyncio.get_running_loop()
    try:
        await _start_drivers(run)
    except (InjectorError, asyncio.TimeoutError) as e:
        for proc in run.procs.values():
            proc.kill()
        return [f"checker: the scenario did not start: {type(e).__name__}: {e}"], run.notes
    for sid, kind in zip(p.sessions, p.kinds, strict=True):
        proc = run.procs.get(sid)
        if proc is None:
            run.tasks[sid] = asyncio.create_task(run.agents[kind].run(sid, session_id=sid))
        else:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            run.tasks[sid] = asyncio.create_task(_answer(proc))
        run.touched[sid] = set()
    start = loop.time()
    for at, fault, target in p.faults:
        await asyncio.sleep(max(0.0, start + at - loop.time()))
        sid = p.sessions[target]
        run.touched[sid].add(fault)
        try:
            await asyncio.wait_for(inject(run, fault, sid), 30)
        except InjectorError as e:
            run.broken.append(f"checker: {fault} on {sid} not injected: {e}")
        except Exception as e:  # the session may have ended already: a fault that found nothing to break
            run.notes.append(f"{fault} on {sid}: {type(e).__name__}: {e}")
    violations = await settle(run, bound_s)
    return violations, run.notes


async def _start_drivers(run: Run) -> None:
    """Start a driver process for each session whose driver the plan kills; wait until each is connected."""
    p = run.plan
    killed = {p.sessions[target] for _, fault, target in p.faults if fault == "kill_driver"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(x for x in (str(HERE), str(HERE.parents[1]),
                                                                   os.environ.get("PYTHONPATH")) if x)}
    for sid in sorted(killed):
        kind = p.kinds[p.sessions.index(sid)]
        run.procs[sid] = await asyncio.create_subprocess_exec(
            sys.executable, str(HERE / "chaos_driver.py"), run.cluster.address, run.runtime.config.store_url,
            p.placement, kind, sid, env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
    for sid, proc in run.procs.items():
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), DRIVER_READY_S)
        if line.strip() != b"ready":
            raise InjectorError(f"the driver process of {sid} did not connect: {line!r}")


async def _answer(proc: asyncio.subprocess.Process) -> str:
    """What a driver process printed once its run returned."""
    assert proc.stdout is not None
    out = await proc.stdout.read()
    await proc.wait()
    return out.decode().strip()


async def inject(run: Run, fault: str, sid: str) -> None:
    """Do ``fault`` to session ``sid`` (or to the cluster around it)."""
    import ray

    from loomray.runtime.actors import NAMESPACE, supervisor_name

    agent = run.agents[run.plan.kinds[run.plan.sessions.index(sid)]]
    if fault == "kill_process":
        await _kill_process(run, sid)
    elif fault == "kill_supervisor":
        ray.kill(ray.get_actor(supervisor_name(run.runtime.config.store_url), namespace=NAMESPACE))
    elif fault == "kill_node":
        info = await run.runtime.session(sid)
        node = run.cluster.node_of(info["node_id"]) if info and info.get("node_id") else None
        if node is None or node is run.cluster.head:
            node = run.cluster.workers[0]
        try:
            await asyncio.to_thread(run.cluster.remove_node, node)
        except Exception as e:
            raise InjectorError(f"{type(e).__name__}: {e}") from e
        # The fault is injected. Its replacement is the checker's housekeeping: not to_thread (starting a node
        # sets signal handlers, which only the main thread may do; the drivers' loop waits meanwhile, the
        # sessions run in the cluster regardless). Ray gives a raylet 30 s to register, which a load of 60+
        # on 2 cores can miss: the checker then runs on with one worker and tops up between seeds.
        try:
            run.cluster.add_node()
        except Exception as e:
            run.notes.append(f"kill_node on {sid}: its replacement node did not start ({type(e).__name__}); "
                             "added again after the scenario")
    elif fault == "kill_driver":
        proc = run.procs[sid]
        if proc.returncode is not None:
            raise LookupError(f"its driver had returned: {await run.tasks[sid]}")
        proc.kill()  # SIGKILL
    elif fault in ("cancel", "pause", "signal"):
        await _control(agent, fault, sid)
    # "approve" is applied when the session waits for approval (settle).


async def _control(agent: Any, fault: str, sid: str, wait_s: float = 25.0) -> None:
    """Cancel, pause or signal ``sid``, waiting up to ``wait_s`` for the store to know it (a start may lag)."""
    from loomray.errors import LoomrayUserError

    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            if fault == "cancel":
                await agent.cancel(sid)
            elif fault == "pause":
                await agent.pause(sid)
            else:
                await agent.signal(sid, "a word from the chaos checker")
            return
        except LoomrayUserError as e:
            if "unknown session" not in str(e) or asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.2)


async def _kill_process(run: Run, sid: str, wait_s: float = 25.0) -> None:
    """Kill the process hosting ``sid``, waiting up to ``wait_s`` for it to be up (a start may be under way)."""
    import ray

    from loomray.runtime.actors import NAMESPACE

    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        info = await run.runtime.session(sid)
        if info is not None and info["status"] != "running":
            raise LookupError(f"its run had ended {info['status']!r}")
        try:
            if info is not None and info.get("host"):
                ray.kill(ray.get_actor(info["host"], namespace=NAMESPACE))
                return
        except ValueError:  # not created yet, or replaced meanwhile
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise LookupError(f"no live process hosts it after {wait_s:.0f} s ({info})")
        await asyncio.sleep(0.2)


def _row_status(store: Any, sid: str) -> str | None:
    row = store.sessions.get(sid)
    return None if row is None else row.status


async def settle(run: Run, bound_s: float) -> list[str]:
    """Wait (up to ``bound_s``) until every session rests, approving where the plan said so; then judge."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    approved: set[str] = set()
    unstarted_since: dict[str, float] = {}
    while loop.time() < deadline:
        rows = {sid: _row_status(run.runtime.store, sid) for sid in run.plan.sessions}
        await _note_unstarted(run, rows, unstarted_since)
        for sid, status in rows.items():
            if status == "awaiting_approval" and "approve" in run.touched[sid] and sid not in approved:
                approved.add(sid)
                agent = run.agents[run.plan.kinds[run.plan.sessions.index(sid)]]
                run.tasks[sid] = asyncio.create_task(agent.resume(None, session_id=sid, approvals={"s0000_0": True}))
        drivers = [t for sid, t in run.tasks.items() if "kill_driver" not in run.touched[sid]]
        resting = [s in RESTING or loop.time() - unstarted_since.get(sid, loop.time()) >= UNSTARTED_S
                   for sid, s in rows.items()]
        if all(resting) and all(t.done() for t in drivers) \
                and not any(s == "awaiting_approval" and sid not in approved and "approve" in run.touched[sid]
                            for sid, s in rows.items()):
            break
        await asyncio.sleep(0.2)
    for t in run.tasks.values():
        if not t.done():
            t.cancel()
    await asyncio.gather(*run.tasks.values(), return_exceptions=True)
    for proc in run.procs.values():
        if proc.returncode is None:  # a driver process past the bound: the verdict says so; end it
            proc.kill()
        await proc.wait()
    run.notes += [f"approve on {sid}: it never waited for approval" for sid in run.plan.sessions
                  if "approve" in run.touched[sid] and sid not in approved]
    return await verdict(run, rows, bound_s)


async def _note_unstarted(run: Run, rows: dict[str, str | None], since: dict[str, float]) -> None:
    """Since when each session whose driver the plan killed has had no row, its driver ended and the
    supervisor does not know it: the hand-off never reached a supervisor. Such a session rests as "never
    started" once that held for :data:`UNSTARTED_S` (the verdict checks it again); before, the scenario
    waited out the whole bound for it."""
    now = asyncio.get_running_loop().time()
    for sid, status in rows.items():
        proc = run.procs.get(sid)
        if not (status is None and proc is not None and proc.returncode is not None):
            since.pop(sid, None)
            continue
        try:
            known = await run.runtime.session(sid) is not None
        except Exception:  # a supervisor being re-created: ask again next time
            continue
        if known:
            since.pop(sid, None)
        else:
            since.setdefault(sid, now)


def _allowed(kind: str, touched: set[str]) -> set[str]:
    """Where a session of ``kind`` may rest after the faults in ``touched``."""
    ends = {"sleep": {"completed"}, "gil": {"completed"}, "raise": {"completed"}, "sysexit": {"failed"},
            "osexit": {"failed"}, "approval": {"awaiting_approval", "completed"}}[kind]
    if "cancel" in touched:
        ends = ends | {"cancelled"}
    if "pause" in touched:
        ends = ends | {"paused"}
    return ends


async def verdict(run: Run, rows: dict[str, str | None], bound_s: float) -> list[str]:
    """The oracle (module docstring): every violation, one line each."""
    out = []
    for sid, kind in zip(run.plan.sessions, run.plan.kinds, strict=True):
        status, touched = rows[sid], run.touched[sid]
        if status is None and "kill_driver" in touched and await run.runtime.session(sid) is None:
            continue  # the driver died before its hand-off reached a supervisor: the session never started
        if status not in RESTING:
            out.append(f"{sid}: still {status!r} {bound_s:.0f} s after the faults")
        elif status not in _allowed(kind, touched):
            row = run.runtime.store.sessions.get(sid)
            out.append(f"{sid}: ended {status!r} ({row.error if row else ''}); a {kind} session after "
                       f"{sorted(touched) or 'no fault'} may end {sorted(_allowed(kind, touched))}")
        task = run.tasks[sid]
        if "kill_driver" not in touched and task.cancelled():
            out.append(f"{sid}: its driver's call never returned")
    if out:
        out += await _after_bound(run, rows)
    mine = Counter(line for line in chaos_kinds.calls() if line.split(" ")[0] in set(run.plan.sessions))
    out += [f"model call made {n} times: {line}" for line, n in sorted(mine.items()) if n > 1]
    # Rows read now, as the supervisor is asked now (sessions watched past the bound may have ended since).
    out += await _views_agree(run, {sid: _row_status(run.runtime.store, sid) for sid in run.plan.sessions})
    return out + run.broken


async def _after_bound(run: Run, rows: dict[str, str | None]) -> list[str]:
    """Sessions not resting at the bound, watched up to ``LATE_S`` more: slow or stuck (a diagnosis only)."""
    loop = asyncio.get_running_loop()
    start, late, out = loop.time(), {sid for sid, s in rows.items() if s not in RESTING}, []
    while late and loop.time() - start < LATE_S:
        await asyncio.sleep(1.0)
        for sid in sorted(late):
            status = _row_status(run.runtime.store, sid)
            if status in RESTING:
                late.discard(sid)
                out.append(f"{sid}: (diagnosis) rested {status!r} {loop.time() - start:.0f} s after the bound")
    return out + [f"{sid}: (diagnosis) not resting {LATE_S:.0f} s after the bound either" for sid in sorted(late)]


async def _views_agree(run: Run, rows: dict[str, str | None]) -> list[str]:
    """The supervisor's view of each session it knows matches the store row (a cancel of an ended run aside)."""
    out = []
    with contextlib.suppress(Exception):  # a supervisor being re-created: nothing to compare
        statuses = {s["session_id"]: s for s in await run.runtime.status()}
        for sid in run.plan.sessions:
            live = statuses.get(sid)
            if live is None or live["status"] == "running" or rows[sid] is None:
                continue
            one = await run.runtime.session(sid)
            if one is not None and one["status"] != live["status"]:
                out.append(f"{sid}: status() says {live['status']!r}, session() {one['status']!r}")
            if live["status"] != rows[sid] and not ("cancel" in run.touched[sid] and rows[sid] == "cancelled"):
                out.append(f"{sid}: the supervisor says {live['status']!r}, the store row {rows[sid]!r}")
    return out
