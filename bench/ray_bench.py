"""Ray runtime benchmark, both placements side by side: node loss, fan-out, throughput, scale, memory.

    .venv/bin/python bench/ray_bench.py            # full (about ten minutes on 2 cores)
    .venv/bin/python bench/ray_bench.py --quick    # quick run (small numbers, both placements)
    .venv/bin/python bench/ray_bench.py --smoke    # the unit suite's check that it runs (smaller still)

For each placement (``actor``: one Ray actor per session; ``dense``: sessions
hosted many per host actor) a fresh local cluster
(``loomray.testing.cluster.local_cluster``: a head plus two worker raylets on
127.0.0.1 with 2 CPUs each, tuned failure detection) and a local-directory
store (dense first; before each, the 1-minute load is let fall below the core
count, at most 90 s, 5 s with ``--quick``; ``--smoke`` runs both placements on one cluster, each
with its own store, and does not wait for the load). Sessions need the ``loomray_session`` resource only
workers carry. While a cluster runs, a sampler sums the RSS of every process it started
(GCS, raylets, workers, hosts; not this driver) every 0.2 s: each phase
reports its peak.

1. **Node loss**: sessions (scripted model answering in 1 s, like a model
   API; 0.3 s tool steps; 12 passes) run on both workers; once each was
   served its fourth reply, the worker hosting the most of them is
   SIGKILLed. Timed from the kill: Ray declaring the node dead (GCS view,
   polled every 10 ms), each lost session's new lease (its ``acquired_at``)
   and the start of its next model call by a new incarnation (timestamps the
   model writes; a call by the old process does not count). *restore* is node
   dead -> next model call. Every session must complete with each scripted
   reply served exactly once (a call cut short by the kill was never served).
   Actor: one session, three runs. Dense: 200 sessions, ~100 on the victim.
2. **Fan-out** of 8 and 32 forks from one checkpoint: time until every fork
   made its first model call (all started) and until all returned. With
   actor placement every fork starts a worker process of its own.
3. **Throughput**: N sessions (100) start and wait at a barrier, then each
   runs 20 passes on a scripted model (no latency), one checkpoint per pass.
   Aggregate checkpoints per second from the barrier to the last completion.
4. **Scale** (dense): 1,000 concurrent sessions, scripted model with 200 ms
   latency per call, 20 passes each, a checkpoint per pass; all must complete.

Machines here are shared and have 2 cores: absolute numbers are noisy. Prints
a table and writes ``bench/results/ray.json``. ``--phase fanout --forks 32
--placements actor`` runs just one phase (``loss``, ``fanout``, ``throughput``,
``scale``, comma-separated) and sizes; a partial run writes
``bench/results/ray_<phases>.json``.

``--smoke`` is what the unit suite runs (tests/ray/test_ray_bench_smoke.py): every
phase of both placements end to end with the smallest sizes that still make each
measure happen (a node lost with sessions on it, a fan-out, a throughput barrier,
a dense scale run); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomray.runtime.connection import apply_ray_env_defaults  # noqa: E402

# Before Ray's first import: Ray reads these once (loopback binding among them).
apply_ray_env_defaults()

import ray  # noqa: E402

from loomray import Agent, Tuning  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime import RayRuntime  # noqa: E402
from loomray.testing import descendants  # noqa: E402
from loomray.testing.cluster import local_cluster  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _log_call(path: str, tag: str) -> None:
    # One short O_APPEND write per line: lines from many sessions and processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{tag} {time.time():.6f} {os.getpid()}\n".encode())
    finally:
        os.close(fd)


def _calls(path: str) -> list[tuple[str, float, int]]:
    if not os.path.exists(path):
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        tag, t, pid = line.split()
        out.append((tag, float(t), int(pid)))
    return out


async def _poll(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not met")
        await asyncio.sleep(interval)


class MemorySampler:
    """Sums the RSS of every process this driver's cluster started, every ``interval`` s, in a thread."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak = self.phase_peak = 0
        self.processes = self.phase_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @staticmethod
    def sample() -> tuple[int, int]:
        """(bytes of RSS summed, processes) over the descendants of this process."""
        total = n = 0
        for pid, _ in descendants(os.getpid()):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * PAGE
                n += 1
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
        return total, n

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, n = self.sample()
            self.peak, self.phase_peak = max(self.peak, rss), max(self.phase_peak, rss)
            self.processes, self.phase_processes = max(self.processes, n), max(self.phase_processes, n)
            self._stop.wait(self.interval)

    def phase(self) -> dict:
        """The peak since the previous call (then reset), in MB, and the most processes seen."""
        out = {"peak_mb": round(self.phase_peak / 2**20), "max_processes": self.phase_processes}
        self.phase_peak, self.phase_processes = self.sample()
        return out


# -- 1. node loss ------------------------------------------------------------------------------------
def _session_of(request) -> str:
    """The session a scripted reply serves: the benches pass the session id as the prompt."""
    return next(m.content for m in request.messages if m.role == "user")


def _slow_agent(log: str, passes: int, step_s: float, latency_s: float = 0.0) -> Agent:
    """``passes`` tool passes of ``step_s`` s each; every model call takes ``latency_s`` and logs
    ``S|{session}:r{i}`` when it starts and ``D|...`` when it is served (a call cut short never is)."""
    def reply(i: int):
        async def answer(request):
            tag = f"{_session_of(request)}:r{i}"
            _log_call(log, f"S|{tag}")
            if latency_s:
                await asyncio.sleep(latency_s)
            _log_call(log, f"D|{tag}")
            return {"tool": "step", "args": {"n": i}} if i < passes else "done"
        return answer

    async def step(n: int) -> str:
        """Stands in for a slow tool."""
        await asyncio.sleep(step_s)
        return f"step {n} done"

    return Agent("bench", model=ScriptedModel([reply(i) for i in range(passes + 1)]), tools=[step],
                 tuning=Tuning(checkpoint=True), name="bench-slow")


def _lines(calls: list[tuple[str, float, int]], kind: str, sid: str | None = None) -> list[tuple[str, float, int]]:
    """The ``S`` (started) or ``D`` (served) model calls of the log, of one session if given."""
    prefix = f"{kind}|" + ("" if sid is None else f"{sid}:")
    return [(tag[2:], t, pid) for tag, t, pid in calls if tag.startswith(prefix)]


def _lease_time(root: Path, sid: str) -> tuple[int, float] | None:
    from datetime import datetime

    try:
        lease = json.loads((root / "sessions" / "_" / sid / "lease.json").read_text())
    except (OSError, ValueError):
        return None
    return int(lease["epoch"]), datetime.fromisoformat(lease["acquired_at"]).timestamp()


async def node_loss(lc, runtime: RayRuntime, work: Path, run: int, sessions: int, latency_s: float,
                    passes: int = 12) -> dict:
    log = str(work / f"loss-{run}.log")
    agent = _slow_agent(log, passes=passes, step_s=0.3, latency_s=latency_s)
    agent.runtime = runtime
    sids = [f"loss-{run}-{i:03d}" for i in range(sessions)]
    tasks = [asyncio.create_task(agent.run(s, session_id=s)) for s in sids]

    def all_past_turn_3():
        seen: dict[str, int] = {}
        for tag, _, _ in _lines(_calls(log), "D"):
            sid, _, r = tag.partition(":r")
            seen[sid] = max(seen.get(sid, -1), int(r))
        return len(seen) == sessions and min(seen.values()) >= 3

    await _poll(all_past_turn_3, 300, 0.1)
    where = {s["session_id"]: s["node_id"] for s in await runtime.status() if s["session_id"] in sids}
    by_node: dict[str, list[str]] = {}
    for sid, node in where.items():
        by_node.setdefault(node, []).append(sid)
    node_id = max((n for n in by_node if n != lc.head.node_id), key=lambda n: len(by_node[n]))
    lost = by_node[node_id]
    before = _calls(log)
    old_pids = {sid: {pid for _, _, pid in _lines(before, "S", sid)} for sid in lost}
    t_kill = time.time()
    lc.remove_node(lc.node_of(node_id))
    await _poll(lambda: node_id not in lc.alive_node_ids(), 120)
    dead = time.time() - t_kill
    results = await asyncio.wait_for(asyncio.gather(*tasks), 600)
    calls = _calls(log)
    root = Path(runtime.config.store_url.removeprefix("file://"))
    nxt, lease, repeated, repeats = [], [], 0, []
    for sid in lost:
        # The next call that counts is the new incarnation's: the old process outlives its raylet briefly.
        after = [t for _, t, pid in _lines(calls, "S", sid) if pid not in old_pids[sid] and t > t_kill]
        nxt.append(min(after) - t_kill if after else None)
        lt = _lease_time(root, sid)
        lease.append(lt[1] - t_kill if lt and lt[0] >= 2 else None)
    for sid, r in zip(sids, results, strict=False):
        served = [tag for tag, _, _ in _lines(calls, "D", sid)]
        repeated += len(served) - len(set(served))
        assert len(set(served)) == r.turns == passes + 1, f"{sid}: {served}"
        for tag in {t for t in served if served.count(t) > 1}:
            # When each call was served (s after the kill) and whether by the lost process.
            repeats.append([tag] + [(round(t - t_kill, 3), pid in old_pids.get(sid, ()))
                                    for g, t, pid in _lines(calls, "D", sid) if g == tag])
    lc.add_node()
    valid = [x for x in nxt if x is not None]
    restore = [x - dead for x in valid]
    return {"sessions": sessions, "passes": passes, "lost_sessions": len(lost), "model_latency_s": latency_s,
            "completed": sum(r.output == "done" for r in results),
            "model_calls_repeated": repeated, "kill_to_node_dead_s": dead,
            "kill_to_new_lease_s_median": _median([x for x in lease if x is not None]),
            "kill_to_next_model_call_s_median": _median(valid),
            "kill_to_next_model_call_s_max": max(valid) if valid else None,
            "restore_s_median": _median(restore), "restore_s_max": max(restore) if restore else None,
            "recovered": len(valid), "repeats": repeats}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# -- 2. fan-out ----------------------------------------------------------------------------------------
async def fan_out(runtime: RayRuntime, work: Path, n: int) -> dict:
    log = str(work / f"fanout-{n}.log")

    def fork_reply(request):
        _log_call(log, request.messages[-1].content)
        return "fork answer"

    agent = Agent("bench", model=ScriptedModel(["source answer", fork_reply]), tuning=Tuning(checkpoint=True),
                  runtime=runtime, name="bench-fork")
    source = await agent.run("hi", session_id=f"fan-src-{n}")
    prompts = [f"fork-{n}-{i}" for i in range(n)]
    t0 = time.time()
    forks = await agent.fork(source.session_id, from_checkpoint=source.checkpoint_id, prompts=prompts)
    done = time.time() - t0
    first: dict[str, float] = {}
    for tag, t, _ in _calls(log):
        first.setdefault(tag, t)
    out = {"forks": n, "all_started_s": max(first.values()) - t0 if len(first) == n else None,
           "first_started_s": min(first.values()) - t0, "all_done_s": done,
           "completed": sum(f.output == "fork answer" for f in forks)}
    return out


# -- 3. throughput ---------------------------------------------------------------------------------------
async def throughput(runtime: RayRuntime, work: Path, sessions: int, passes: int) -> dict:
    gate = work / "go"
    waiting = work / "waiting"
    waiting.mkdir()

    async def hold(request):
        (waiting / _session_of(request)).write_text("")
        while not gate.exists():
            await asyncio.sleep(0.02)
        return {"tool": "noop", "args": {}}

    def noop() -> str:
        """Does nothing."""
        return "ok"

    agent = Agent("bench", model=ScriptedModel([hold] + [{"tool": "noop", "args": {}}] * (passes - 1) + ["done"]),
                  tools=[noop], tuning=Tuning(checkpoint=True), runtime=runtime, name="bench-tp")
    sids = [f"tp-{i:04d}" for i in range(sessions)]
    t_submit = time.monotonic()
    for chunk in range(0, sessions, 10):
        await asyncio.gather(*(runtime.submit(agent, s, session_id=s) for s in sids[chunk:chunk + 10]))
    await _poll(lambda: len(list(waiting.iterdir())) >= sessions, 900, 0.1)
    started = time.monotonic() - t_submit
    t0 = time.monotonic()
    gate.write_text("")
    results = await asyncio.gather(*(runtime.wait(s) for s in sids))
    wall = time.monotonic() - t0
    written = sum(r.turns for r in results)  # one checkpoint per pass, the last one included
    return {"sessions": sessions, "passes": passes, "all_up_s": started, "wall_s": wall,
            "checkpoints": written, "checkpoints_per_s": written / wall,
            "completed": sum(r.output == "done" for r in results)}


# -- 4. scale ------------------------------------------------------------------------------------------
async def scale(runtime: RayRuntime, sessions: int, passes: int, latency_s: float) -> dict:
    def noop() -> str:
        """Does nothing."""
        return "ok"

    agent = Agent("bench", model=ScriptedModel([{"tool": "noop", "args": {}}] * passes + ["done"], delay=latency_s),
                  tools=[noop], tuning=Tuning(checkpoint=True), runtime=runtime, name="bench-scale")
    sids = [f"scale-{i:05d}" for i in range(sessions)]
    t0 = time.monotonic()
    for chunk in range(0, sessions, 50):
        await asyncio.gather(*(runtime.submit(agent, "go", session_id=s) for s in sids[chunk:chunk + 50]))
    submitted = time.monotonic() - t0
    results = await asyncio.gather(*(runtime.wait(s) for s in sids), return_exceptions=True)
    wall = time.monotonic() - t0
    ok = [r for r in results if not isinstance(r, BaseException)]
    hosts = {s.get("host") for s in await runtime.status() if s["session_id"].startswith("scale-")}
    return {"sessions": sessions, "passes": passes, "latency_s": latency_s, "submitted_s": submitted,
            "wall_s": wall, "completed": sum(r.output == "done" for r in ok), "failed": len(results) - len(ok),
            "checkpoints_per_s": sum(r.turns for r in ok) / wall, "hosts": len(hosts)}


# -- driver ---------------------------------------------------------------------------------------------
async def _settle(timeout: float = 90.0) -> float:
    """Wait (polling, at most ``timeout``) until the 1-minute load is below the core count; return it.

    The previous placement's cluster leaves a burst of exiting processes behind; measuring
    the next one during it would charge that to the wrong placement.
    """
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= (os.cpu_count() or 1) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    return os.getloadavg()[0]


PHASES = ("loss", "fanout", "throughput", "scale")


@dataclass(frozen=True)
class Level:
    """The sizes of one kind of run (full, ``--quick``, ``--smoke``); None: the command-line option's value."""

    settle_s: float  # at most this long for the load to fall before each placement (0: not at all)
    loss_runs: int  # actor placement: node-loss runs, one session each
    loss_sessions: int | None  # dense placement: sessions in its one node-loss run
    loss_passes: int
    loss_latency_s: float | None
    forks: tuple[int, ...]
    tp_sessions: int | None
    tp_passes: int
    scale: tuple[int | None, int, float]  # dense scale: sessions, passes, model latency
    one_cluster: bool  # both placements on one cluster (else a fresh one each, measured apart)


LEVELS = {
    "full": Level(90.0, 3, None, 12, None, (8, 32), None, 20, (None, 20, 0.2), False),
    "quick": Level(5.0, 1, 20, 12, 0.2, (8,), 10, 20, (50, 5, 0.05), False),
    # Each kill still lands mid-run: sessions are killed after their fourth reply, of seven.
    "smoke": Level(0.0, 1, 6, 6, 0.2, (4,), 4, 5, (20, 3, 0.05), True),
}


def _level(args) -> Level:
    return LEVELS["smoke" if args.smoke else "quick" if args.quick else "full"]


def _phases(args) -> set[str]:
    phases = set(PHASES) if args.phase == "all" else set(args.phase.split(","))
    unknown = phases - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}; choose from {', '.join(PHASES)} or all")
    return phases


def _fork_counts(args) -> tuple[int, ...]:
    if args.forks:
        return tuple(int(n) for n in args.forks.split(","))
    return _level(args).forks


def _cluster():
    """The bench's cluster: a head and two workers of 2 CPUs each; only workers host sessions."""
    return local_cluster(num_nodes=3, num_cpus_per_node=2, worker_resources={"loomray_session": 10_000})


async def one_placement(placement: str, args, shared=None) -> dict:
    level = _level(args)
    out: dict = {"placement": placement,
                 "load_at_start": await _settle(level.settle_s) if level.settle_s else os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix=f"loomray-raybench-{placement}-") as tmp, \
            MemorySampler() as mem, \
            (contextlib.nullcontext(shared) if shared is not None else _cluster()) as lc:
        work = Path(tmp)
        out["cluster_idle"] = mem.phase()
        # Keep every checkpoint (no retention) so the store itself holds what was written.
        runtime = RayRuntime(work / "store", max_checkpoints_per_session=0, placement=placement,
                             actor_options={"resources": {"loomray_session": 1}})
        phases = _phases(args)
        if "loss" in phases:
            print(f"[{placement}] node loss ...", flush=True)
            latency = args.loss_latency if level.loss_latency_s is None else level.loss_latency_s
            if placement == "actor":
                loss = [await node_loss(lc, runtime, work, i, 1, latency, level.loss_passes)
                        for i in range(level.loss_runs)]
            else:
                sessions = args.loss_sessions if level.loss_sessions is None else level.loss_sessions
                loss = [await node_loss(lc, runtime, work, 0, sessions, latency, level.loss_passes)]
            out["node_loss"] = loss
            out["node_loss_memory"] = mem.phase()
        if "fanout" in phases:
            print(f"[{placement}] fan-out ...", flush=True)
            out["fan_out"] = [await fan_out(runtime, work, n) for n in _fork_counts(args)]
            out["fan_out_memory"] = mem.phase()
        if "throughput" in phases:
            print(f"[{placement}] throughput ...", flush=True)
            n = level.tp_sessions or (args.sessions if placement == "dense" else args.actor_sessions)
            out["throughput"] = await throughput(runtime, work, n, level.tp_passes)
            out["throughput_memory"] = mem.phase()
        if placement == "dense" and "scale" in phases:
            print(f"[{placement}] scale ...", flush=True)
            sessions, passes, latency = level.scale
            out["scale"] = await scale(runtime, sessions or args.scale_sessions, passes, latency)
            out["scale_memory"] = mem.phase()
        runtime.close()
    out["peak_memory_mb"] = round(mem.peak / 2**20)
    out["max_processes"] = mem.processes
    out["leftover_processes"] = lc.leftover  # a shared cluster's: filled in once it has stopped
    return out


async def main_async(args) -> dict:
    out: dict = {"bench": "ray", "quick": args.quick, "smoke": args.smoke, "ray": ray.__version__,
                 "python": platform.python_version(), "cpus": os.cpu_count(),
                 "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_before": os.getloadavg()}
    out["runs"] = []
    with (_cluster() if _level(args).one_cluster else contextlib.nullcontext()) as shared:
        for placement in args.placements.split(","):
            out[placement] = await one_placement(placement, args, shared)
            out["runs"].append(placement)
    if shared is not None:
        for label in out["runs"]:
            out[label]["leftover_processes"] = shared.leftover
    out["load_after"] = os.getloadavg()
    return out


def _f(value, fmt: str = "6.2f") -> str:
    return "-" if value is None else format(value, fmt)


def report(out: dict) -> None:
    placements = out["runs"]
    print(f"\nload average (1 min) before / after: {out['load_before'][0]:.1f} / {out['load_after'][0]:.1f}; at "
          + ", ".join(f"{p} start {out[p]['load_at_start']:.1f}" for p in placements))
    print(f"\n{'':<58}" + "".join(f"{p:>12}" for p in placements))

    def row(label: str, get) -> None:
        cells = []
        for p in placements:
            try:
                cells.append(get(out[p]))
            except (KeyError, IndexError, TypeError):
                cells.append("-")
        print(f"  {label:<56}" + "".join(f"{c:>12}" for c in cells))

    def loss(key: str, agg=statistics.median):
        def get(d):
            vals = [r[key] for r in d["node_loss"] if r.get(key) is not None]
            return _f(agg(vals)) if vals else "-"
        return get

    def has(key: str) -> bool:
        return any(key in out[p] for p in placements)

    if has("node_loss"):
        print("node loss")
        row("sessions lost with the node / in the run", lambda d: f"{sum(r['lost_sessions'] for r in d['node_loss'])}/"
            f"{sum(r['sessions'] for r in d['node_loss'])}")
        row("SIGKILL -> Ray declares node dead (Ray detection), s", loss("kill_to_node_dead_s"))
        row("node dead -> next model call, median, s", loss("restore_s_median"))
        row("node dead -> next model call, max over sessions, s", loss("restore_s_max", max))
        row("SIGKILL -> new lease, median, s", loss("kill_to_new_lease_s_median"))
        row("SIGKILL -> next model call, max, s", loss("kill_to_next_model_call_s_max", max))
        row("model calls repeated", lambda d: str(sum(r["model_calls_repeated"] for r in d["node_loss"])))
        row("completed", lambda d: f"{sum(r['completed'] for r in d['node_loss'])}/"
            f"{sum(r['sessions'] for r in d['node_loss'])}")
        row("peak cluster memory, MB", lambda d: str(d["node_loss_memory"]["peak_mb"]))
    if has("fan_out"):
        print("fan-out from one checkpoint")
        for i, f in enumerate(next(out[p]["fan_out"] for p in placements if "fan_out" in out[p])):
            n = f["forks"]
            row(f"{n} forks: all started, s", lambda d, i=i: _f(d["fan_out"][i]["all_started_s"]))
            row(f"{n} forks: all done, s", lambda d, i=i: _f(d["fan_out"][i]["all_done_s"]))
        row("peak cluster memory, MB", lambda d: str(d["fan_out_memory"]["peak_mb"]))
    if has("throughput"):
        passes = next(out[p]["throughput"]["passes"] for p in placements if "throughput" in out[p])
        print(f"throughput (sessions x {passes} passes, no model latency, a checkpoint per pass)")
        row("sessions", lambda d: str(d["throughput"]["sessions"]))
        row("all sessions up, s", lambda d: _f(d["throughput"]["all_up_s"], "6.1f"))
        row("checkpoints/s, aggregate", lambda d: _f(d["throughput"]["checkpoints_per_s"], "6.0f"))
        row("completed", lambda d: f"{d['throughput']['completed']}/{d['throughput']['sessions']}")
        row("peak cluster memory, MB", lambda d: str(d["throughput_memory"]["peak_mb"]))
        row("processes of the cluster, most", lambda d: str(d["throughput_memory"]["max_processes"]))
    if "dense" in out and "scale" in out["dense"]:
        s = out["dense"]["scale"]
        print(f"scale (dense): {s['sessions']} sessions x {s['passes']} passes, {s['latency_s'] * 1000:.0f} ms "
              f"model latency")
        print(f"  completed {s['completed']}/{s['sessions']} in {s['wall_s']:.1f} s (submitted in "
              f"{s['submitted_s']:.1f} s) on {s['hosts']} hosts, {s['checkpoints_per_s']:.0f} checkpoints/s; "
              f"peak cluster memory {out['dense']['scale_memory']['peak_mb']} MB "
              f"({out['dense']['scale_memory']['max_processes']} processes)")
    row("peak cluster memory, whole run, MB", lambda d: str(d["peak_memory_mb"]))
    row("cluster memory idle (no session yet), MB", lambda d: str(d["cluster_idle"]["peak_mb"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="quick run: small numbers, both placements")
    ap.add_argument("--smoke", action="store_true",
                    help="the unit suite's run: smaller than --quick, both placements on one cluster, no load wait")
    ap.add_argument("--placements", default="dense,actor", help="comma-separated, in run order: actor, dense")
    ap.add_argument("--sessions", type=int, default=100, help="dense throughput sessions")
    ap.add_argument("--actor-sessions", type=int, default=100, help="actor throughput sessions (a process each)")
    ap.add_argument("--loss-sessions", type=int, default=200, help="dense node-loss sessions (about half are lost)")
    ap.add_argument("--loss-latency", type=float, default=1.0, help="model latency (s) in the node-loss runs")
    ap.add_argument("--scale-sessions", type=int, default=1000, help="dense scale sessions")
    ap.add_argument("--phase", default="all",
                    help="comma-separated phases to run: loss, fanout, throughput, scale (default all)")
    ap.add_argument("--forks", default=None, help="fan-out sizes, comma-separated (default 8,32; --quick 8; --smoke 4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    report(out)
    name = "ray_smoke" if args.smoke else "ray_quick" if args.quick else "ray"
    if args.phase != "all" or args.forks:
        name += "_" + "_".join(sorted(_phases(args)))  # a partial run never overwrites a full one's results
    path = Path(args.out or f"bench/results/{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
