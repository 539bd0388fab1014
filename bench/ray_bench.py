"""Ray runtime benchmark: node-loss recovery, fan-out, aggregate checkpoint throughput.

    .venv/bin/python bench/ray_bench.py            # full (a few minutes)
    .venv/bin/python bench/ray_bench.py --quick    # smoke run (1 node loss, 8 forks, 10 sessions)

One local cluster (``loomray.testing.local_cluster``: a head plus worker
raylets on 127.0.0.1, tuned failure detection) and a local-directory store.
Session actors need the ``loomray_session`` resource only workers carry.

1. **Node loss**: a session (scripted model, 0.3 s tool steps) runs on a
   worker; once turn 3 is checkpointed, the worker's raylet is SIGKILLed.
   Timed from the kill: Ray declaring the node dead (GCS view, polled), the new
   incarnation holding the lease (epoch 2), and the session's next model call
   (wall-clock timestamps written by the model itself). *Ray detection* is
   kill -> node dead; *loomray restore* is node dead -> next model call
   (supervisor notices, new actor and worker process, store, lease, restore,
   journal replay).
2. **Fan-out** of 8 and 32 forks from one checkpoint: time until every fork
   made its first model call (all started) and until all returned, and the
   objects each fork wrote (checkpoints, journal, lease, index files).
3. **Throughput**: N sessions (100 in the full run) start and wait at a
   barrier, then each runs 20 passes on a scripted model (no latency), one
   checkpoint per pass. Aggregate checkpoints per second from the barrier to
   the last completion.

Machines here are shared and have 2 cores: absolute numbers are noisy; every
worker process (one per session actor) competes for the same two cores.
Prints a table and writes ``bench/results/ray.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomray.testing import local_cluster  # noqa: E402  (first: pins Ray to 127.0.0.1)

import ray  # noqa: E402

from loomray import Agent, Tuning  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime import RayRuntime  # noqa: E402


def _log_call(path: str, tag: str) -> None:
    with open(path, "a") as f:
        f.write(f"{tag} {time.time():.6f} {os.getpid()}\n")


def _calls(path: str) -> list[tuple[str, float, int]]:
    if not os.path.exists(path):
        return []
    out = []
    for line in Path(path).read_text().splitlines():
        tag, t, pid = line.split()
        out.append((tag, float(t), int(pid)))
    return out


def _slow_agent(log: str, passes: int, step_s: float) -> Agent:
    def reply(i: int):
        def answer(request):
            _log_call(log, f"r{i}")
            return {"tool": "step", "args": {"n": i}} if i < passes else "done"
        return answer

    async def step(n: int) -> str:
        """Stands in for a slow tool."""
        await asyncio.sleep(step_s)
        return f"step {n} done"

    return Agent("bench", model=ScriptedModel([reply(i) for i in range(passes + 1)]), tools=[step],
                 tuning=Tuning(checkpoint=True), name="bench-slow")


async def _poll(predicate, timeout: float, interval: float = 0.01):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not met")
        await asyncio.sleep(interval)


async def node_loss(lc, runtime: RayRuntime, work: Path, i: int) -> dict:
    sid, log = f"loss-{i}", str(work / f"loss-{i}.log")
    agent = _slow_agent(log, passes=10, step_s=0.3)
    agent.runtime = runtime
    run = asyncio.create_task(agent.run("go", session_id=sid))
    store = runtime.store
    await _poll(lambda: (r := store.list_checkpoints(sid, limit=1)) and r[0].turn >= 3, 120)
    node_id = {s["session_id"]: s for s in await runtime.status()}[sid]["node_id"]
    victim = lc.node_of(node_id)
    old_pids = {pid for _, _, pid in _calls(log)}
    t_kill = time.time()
    lc.remove_node(victim)
    dead = lease = nxt = None
    deadline = time.monotonic() + 120
    while None in (dead, lease, nxt) and time.monotonic() < deadline:
        now = time.time()
        if dead is None and node_id not in lc.alive_node_ids():
            dead = now - t_kill
        if lease is None and store.current_epoch(sid) >= 2:
            lease = now - t_kill
        if nxt is None:
            # The old worker process outlives its raylet by ~2 s and may still call the model (that call is
            # journaled and replayed, not repeated): the next call that counts is the new incarnation's.
            after = [t for _, t, pid in _calls(log) if pid not in old_pids]
            if after:
                nxt = min(after) - t_kill
        await asyncio.sleep(0.01)
    result = await asyncio.wait_for(run, 120)
    tags = [tag for tag, _, _ in _calls(log)]
    lc.add_node()
    assert len(tags) == len(set(tags)) == result.turns, f"a model call was repeated: {tags}"
    return {"kill_to_node_dead_s": dead, "kill_to_new_lease_s": lease, "kill_to_next_model_call_s": nxt,
            "restore_s": None if nxt is None or dead is None else nxt - dead,
            "model_calls": len(tags), "distinct_replies": len(set(tags)), "turns": result.turns}


def _objects_of(root: Path, sid: str) -> int:
    n = sum(1 for p in (root / "sessions" / "_" / sid).rglob("*") if p.is_file())
    return n + sum(1 for p in (root / "index").glob(f"*/user=_/session={sid}/*") if p.is_file())


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
    first = {}
    for tag, t, _ in _calls(log):
        first.setdefault(tag, t)
    root = Path(runtime.config.store_url.removeprefix("file://"))
    objects = [_objects_of(root, f.session_id) for f in forks]
    return {"forks": n, "all_started_s": max(first.values()) - t0 if len(first) == n else None,
            "first_started_s": min(first.values()) - t0, "all_done_s": done,
            "objects_per_fork": statistics.mean(objects), "completed": sum(f.output == "fork answer" for f in forks)}


async def throughput(runtime: RayRuntime, work: Path, sessions: int, passes: int) -> dict:
    gate = work / "go"
    waiting = work / "waiting"
    waiting.mkdir()

    async def hold(request):
        (waiting / f"{os.getpid()}-{time.time_ns()}").write_text("")
        while not gate.exists():
            await asyncio.sleep(0.02)
        return {"tool": "noop", "args": {}}

    def noop() -> str:
        """Does nothing."""
        return "ok"

    agent = Agent("bench", model=ScriptedModel([hold] + [{"tool": "noop", "args": {}}] * (passes - 1) + ["done"]),
                  tools=[noop], tuning=Tuning(checkpoint=True), runtime=runtime, name="bench-tp")
    sids = [f"tp-{i:03d}" for i in range(sessions)]
    t_submit = time.monotonic()
    for chunk in range(0, sessions, 10):
        await asyncio.gather(*(runtime.submit(agent, "go", session_id=s) for s in sids[chunk:chunk + 10]))
    await _poll(lambda: len(list(waiting.iterdir())) >= sessions, 600, 0.1)
    started = time.monotonic() - t_submit
    t0 = time.monotonic()
    gate.write_text("")
    results = await asyncio.gather(*(runtime.wait(s) for s in sids))
    wall = time.monotonic() - t0
    checkpoints = runtime.store.query(columns=["session_id"])
    written = sum(1 for s in checkpoints["session_id"].to_pylist() if s.startswith("tp-"))
    return {"sessions": sessions, "passes": passes, "all_actors_up_s": started, "wall_s": wall,
            "checkpoints": written, "checkpoints_per_s": written / wall,
            "completed": sum(r.output == "done" for r in results)}


async def main_async(args) -> dict:
    out: dict = {"bench": "ray", "quick": args.quick, "ray": ray.__version__, "python": platform.python_version(),
                 "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="loomray-raybench-") as tmp, \
            local_cluster(num_nodes=3, num_cpus_per_node=2, worker_resources={"loomray_session": 1000}) as lc:
        work = Path(tmp)
        # Keep every checkpoint (no retention) so the store itself counts what was written.
        runtime = RayRuntime(work / "store", max_checkpoints_per_session=0,
                             actor_options={"resources": {"loomray_session": 1}})
        print("node loss ...", flush=True)
        out["node_loss"] = [await node_loss(lc, runtime, work, i) for i in range(1 if args.quick else 3)]
        print("fan-out ...", flush=True)
        out["fan_out"] = [await fan_out(runtime, work, n) for n in ((8,) if args.quick else (8, 32))]
        print("throughput ...", flush=True)
        out["throughput"] = await throughput(runtime, work, 10 if args.quick else args.sessions, 20)
        runtime.close()
    out["leftover_processes"] = lc.leftover
    return out


def _med(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.median(vals) if vals else float("nan")


def report(out: dict) -> None:
    loss = out["node_loss"]
    print(f"\nnode loss ({len(loss)} run(s), medians)            seconds")
    for key, label in (("kill_to_node_dead_s", "SIGKILL -> Ray declares node dead (Ray detection)"),
                       ("restore_s", "node dead -> next model call (loomray restore)"),
                       ("kill_to_new_lease_s", "SIGKILL -> new incarnation holds lease"),
                       ("kill_to_next_model_call_s", "SIGKILL -> next model call (total)")):
        print(f"  {label:<52} {_med(loss, key):6.2f}")
    print(f"  model calls per run: {[r['model_calls'] for r in loss]} for turns {[r['turns'] for r in loss]}")
    print("\nfan-out           all started   all done   objects/fork   completed")
    for r in out["fan_out"]:
        print(f"  {r['forks']:>3} forks     {r['all_started_s']:>9.2f}s {r['all_done_s']:>9.2f}s "
              f"{r['objects_per_fork']:>12.1f}   {r['completed']}/{r['forks']}")
    t = out["throughput"]
    print(f"\nthroughput: {t['sessions']} sessions x {t['passes']} passes: {t['checkpoints']} checkpoints in "
          f"{t['wall_s']:.2f}s = {t['checkpoints_per_s']:.0f} checkpoints/s "
          f"(actors up after {t['all_actors_up_s']:.1f}s; {t['completed']} completed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 node loss, 8 forks, 10 sessions")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    report(out)
    path = Path(args.out or ("bench/results/ray_quick.json" if args.quick else "bench/results/ray.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
