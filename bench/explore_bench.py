"""Exploration benchmark: 64 branches x 3 rounds (keep 4) in dense placement on a local 3-node cluster.

    .venv/bin/python bench/explore_bench.py            # 64 branches a round, 200 ms model, 3 passes each
    .venv/bin/python bench/explore_bench.py --quick    # 16 branches a round
    .venv/bin/python bench/explore_bench.py --max-concurrent-forks 32   # a round of 64 in two waves

A local cluster (``loomray.testing.cluster.local_cluster``: a head and two
worker raylets of 2 CPUs each on 127.0.0.1; sessions need the
``loomray_session`` resource only workers carry) and a local-directory store.
Every exploration runs in a driver process of its own (this file, run with
``--drive``) connected to the cluster, so a driver can be SIGKILLed like a
real one. Each branch makes ``--passes`` tool passes and a final answer, on a
scripted model that answers in ``--latency`` s and logs when each call starts
and is served (``S|`` / ``D|`` lines, from whichever worker runs it).

1. **Rounds**: one uninterrupted exploration. Per round: its wall time (the
   round's plan stored -> its last branch's last model call served) divided by
   its longest branch's own time (that branch's first call started -> its last
   call served). 1.0 would mean starting, judging and bookkeeping 64 branches
   cost nothing beyond the slowest branch itself; the goal is <= 1.5. A
   round's branches run at most ``--max-concurrent-forks`` at once (default:
   the width); each round also reports when its first, median and last
   branch made their first call after the plan was stored.
2. **Driver kill**: the same exploration under another id; its driver is
   SIGKILLed once round 2's plan is stored and its branches made their first
   calls, and a new driver continues it (``exploration_id=``). On Ray the
   branches keep running in their hosts while no driver is alive. Reported:
   the calls served meanwhile, the new driver's time (process start
   included) until it stored round 2's decision and until the exploration
   finished, and the model calls served beyond the uninterrupted run's (0:
   nothing was billed twice).
3. **Memory**: the peak RSS summed over every process the bench started
   (cluster, hosts, drivers), sampled every 0.2 s.

Prints a table and writes ``bench/results/explore.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomray.runtime.connection import apply_ray_env_defaults  # noqa: E402

apply_ray_env_defaults()

from loomray import Agent, JudgeInput, Tuning, Variant  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.testing import descendants  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")
KEEP, ROUNDS = 4, 3


def _log(path: str, tag: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{tag} {time.time():.6f}\n".encode())
    finally:
        os.close(fd)


def _calls(path: Path) -> list[tuple[str, str, float]]:
    """``(kind, branch tag, time)`` of every logged model call."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        tag, t = line.rsplit(" ", 1)
        out.append((tag[0], tag[2:], float(t)))
    return out


# -- the driver (a process of its own) -------------------------------------------------------------
def _agent(log: str, passes: int, latency: float) -> Agent:
    """Each branch: ``passes`` tool passes, then an answer; a call's tag is the branch's chain of prompts."""
    async def answer(request):
        users = [m.content for m in request.messages if m.role == "user"]
        done = sum(1 for m in request.messages[max(i for i, m in enumerate(request.messages) if m.role == "user"):]
                   if m.role == "assistant")
        tag = "/".join(users[1:]) or "base"
        _log(log, f"S|{tag}")
        await asyncio.sleep(latency)
        _log(log, f"D|{tag}")
        return {"tool": "step", "args": {"n": done}} if users[1:] and done < passes else f"answer {tag}"

    def step(n: int) -> str:
        """A tool pass that takes no time."""
        return "ok"

    return Agent("bench", model=ScriptedModel([answer] * (ROUNDS * (passes + 1) + 2)), tools=[step],
                 tuning=Tuning(checkpoint=True), name="bench-explore")


def _variants(width: int):
    def variants(round_: int, parents: list) -> list[Variant]:
        n = width if round_ == 1 else width // len(parents)
        return [Variant(prompt=f"r{round_}v{i}") for i in range(n)]
    return variants


def judge(judged: JudgeInput) -> float:
    """A deterministic score from the variant's number (the exploration's winner does not matter here)."""
    return float(int((judged.variant.prompt or "r0v0").split("v")[-1]) * 7919 % 101)


def drive(address: str, store: str, xid: str, log: str, width: int, passes: int, latency: float,
          max_concurrent_forks: int) -> None:
    from loomray.runtime import RayRuntime

    runtime = RayRuntime(store, address=address, placement="dense", max_checkpoints_per_session=0,
                         actor_options={"resources": {"loomray_session": 1}},
                         max_concurrent_forks=max_concurrent_forks)
    agent = _agent(log, passes, latency)
    agent.runtime = runtime
    if not runtime.store.checkpoints.list("base", limit=1):
        agent.run_sync("task", session_id="base")
    result = agent.explore_sync("base", variants=_variants(width), judge=judge, rounds=ROUNDS, keep=KEEP,
                                exploration_id=xid)
    print(json.dumps({"winner": result.winner, "branches": len(result.branches), "stop": result.stop_reason}))
    runtime.close()


# -- the bench ------------------------------------------------------------------------------------------
class Memory(threading.Thread):
    """Peak RSS summed over this process's descendants, every 0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for pid, _ in descendants(os.getpid()):
                try:
                    with open(f"/proc/{pid}/statm") as f:
                        total += int(f.read().split()[1]) * PAGE
                except (OSError, IndexError, ValueError):
                    continue
            self.peak = max(self.peak, total)
            self.stop.wait(0.2)


def _driver(args, address: str, store: Path, xid: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen([sys.executable, __file__, "--drive", address, str(store), xid, str(log),
                             str(args.width), str(args.passes), str(args.latency), str(args.max_concurrent_forks)],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _record(store: Path, xid: str) -> dict[str, dict]:
    folder = store / "sessions" / "_" / "base" / "explorations" / xid
    return {p.stem: json.loads(p.read_text()) for p in folder.glob("*.json")} if folder.exists() else {}


def rounds(docs: dict[str, dict], calls: list[tuple[str, str, float]]) -> list[dict]:
    """Per round: wall (plan stored -> last call served), the longest branch's own time, their ratio."""
    out = []
    for r in range(1, ROUNDS + 1):
        plan = docs.get(f"r{r:03d}-plan")
        if plan is None:
            continue
        mine = [(k, tag, t) for k, tag, t in calls if tag.split("/")[-1].startswith(f"r{r}v")]
        own: dict[str, list[float]] = {}
        for _, tag, t in mine:
            span = own.setdefault(tag, [t, t])
            span[0], span[1] = min(span[0], t), max(span[1], t)
        longest = max(b - a for a, b in own.values())
        wall = max(t for _, _, t in mine) - plan["planned_at"]
        starts = sorted(a - plan["planned_at"] for a, _ in own.values())
        out.append({"round": r, "branches": len(plan["branches"]), "wall_s": round(wall, 3),
                    "longest_branch_s": round(longest, 3), "ratio": round(wall / longest, 3),
                    "first_call_s": [round(starts[0], 3), round(starts[len(starts) // 2], 3), round(starts[-1], 3)]})
    return out


async def _until(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not met")
        await asyncio.sleep(0.02)


async def kill_and_resume(args, address: str, store: Path, work: Path) -> dict:
    log = work / "kill.log"
    first = _driver(args, address, store, "xpl-kill", log)

    def round2_running() -> bool:
        return "r002-plan" in _record(store, "xpl-kill") and any(
            k == "D" and tag.split("/")[-1].startswith("r2v") for k, tag, _ in _calls(log))

    await _until(round2_running, 600)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at, served_before = time.time(), len([c for c in _calls(log) if c[0] == "D"])
    t0 = time.time()
    second = _driver(args, address, store, "xpl-kill", log)
    out, err = await asyncio.to_thread(second.communicate)
    if second.returncode != 0:
        raise RuntimeError(f"resumed driver failed: {err[-2000:]}")
    done = time.time() - t0
    folder = store / "sessions" / "_" / "base" / "explorations" / "xpl-kill"
    decided = (folder / "r002-keep.json").stat().st_mtime
    meanwhile = [t for k, tag, t in _calls(log) if k == "D" and killed_at < t < t0]
    return {"killed_after_calls": served_before, "served_while_no_driver": len(meanwhile),
            "resume_to_round2_decided_s": round(decided - t0, 3), "resume_to_done_s": round(done, 3),
            "result": json.loads(out.strip().splitlines()[-1])}


def _served(path: Path) -> int:
    """Model calls served to branches (the base session's own call is not counted)."""
    return len([c for c in _calls(path) if c[0] == "D" and c[1] != "base"])


async def main_async(args) -> dict:
    from loomray.testing.cluster import local_cluster

    out: dict = {"load_avg_at_start": os.getloadavg(), "width": args.width, "passes": args.passes,
                 "latency_s": args.latency, "rounds": ROUNDS, "keep": KEEP,
                 "max_concurrent_forks": args.max_concurrent_forks}
    memory = Memory()
    memory.start()
    with tempfile.TemporaryDirectory(prefix="loomray-explorebench-") as tmp, \
            local_cluster(num_nodes=3, num_cpus_per_node=2, worker_resources={"loomray_session": 10_000},
                          connect=False) as lc:
        work = Path(tmp)
        store = work / "store"
        log = work / "rounds.log"
        t0 = time.time()
        plain = _driver(args, lc.address, store, "xpl-plain", log)
        stdout, stderr = await asyncio.to_thread(plain.communicate)
        if plain.returncode != 0:
            raise RuntimeError(f"driver failed: {stderr[-2000:]}")
        out["uninterrupted_s"] = round(time.time() - t0, 3)
        out["result"] = json.loads(stdout.strip().splitlines()[-1])
        out["per_round"] = rounds(_record(store, "xpl-plain"), _calls(log))
        out["calls_uninterrupted"] = _served(log)
        kill = await kill_and_resume(args, lc.address, store, work)
        kill["extra_calls"] = _served(work / "kill.log") - out["calls_uninterrupted"]
        out["driver_kill"] = kill
    memory.stop.set()
    out["peak_memory_mb"] = round(memory.peak / 2**20)
    out["load_avg_at_end"] = os.getloadavg()
    return out


def report(out: dict) -> None:
    print(f"explore bench: {out['width']} branches x {out['rounds']} rounds (keep {out['keep']}), "
          f"{out['passes']} passes + answer, {out['latency_s'] * 1000:.0f} ms model, dense, 3 nodes, "
          f"max_concurrent_forks={out['max_concurrent_forks']}")
    print("round  branches  wall s  longest branch s  ratio  first call after plan s (first/median/last branch)")
    for r in out["per_round"]:
        print(f"{r['round']:>5}  {r['branches']:>8}  {r['wall_s']:>6.2f}  {r['longest_branch_s']:>16.2f}  "
              f"{r['ratio']:>5.2f}  {' / '.join(f'{x:.2f}' for x in r['first_call_s'])}")
    k = out["driver_kill"]
    print(f"uninterrupted: {out['uninterrupted_s']:.1f} s (driver start included); driver SIGKILLed in round 2: "
          f"{k['served_while_no_driver']} calls served by the branches meanwhile (they run in the cluster); "
          f"the new driver decided round 2 {k['resume_to_round2_decided_s']:.2f} s after it started and finished "
          f"in {k['resume_to_done_s']:.1f} s; model calls beyond the uninterrupted run's: {k['extra_calls']}")
    print(f"peak memory {out['peak_memory_mb']} MB; load average at start {out['load_avg_at_start'][0]:.2f}, "
          f"at end {out['load_avg_at_end'][0]:.2f} ({os.cpu_count()} cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 branches a round")
    ap.add_argument("--width", type=int, default=64, help="branches a round (a multiple of keep=4)")
    ap.add_argument("--passes", type=int, default=3, help="tool passes per branch (then its answer)")
    ap.add_argument("--latency", type=float, default=0.2, help="model latency, seconds")
    ap.add_argument("--max-concurrent-forks", type=int, default=None, metavar="N",
                    help="RayRuntime's bound on a fan-out's running forks (default: the width, so a round's "
                         "branches all run at once; RayRuntime's own default is 32)")
    ap.add_argument("--drive", nargs=8, metavar="X", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        address, store, xid, log, width, passes, latency, forks = args.drive
        drive(address, store, xid, log, int(width), int(passes), float(latency), int(forks))
        return
    if args.quick:
        args.width = 16
    args.max_concurrent_forks = args.max_concurrent_forks or args.width
    out = asyncio.run(main_async(args))
    report(out)
    path = Path(__file__).resolve().parent / "results" / "explore.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
