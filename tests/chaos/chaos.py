"""The chaos checker: seeded fault schedules against sessions on a real local Ray cluster.

    python tests/chaos/chaos.py --seeds 20          # seeds 0..19 (make chaos SEEDS=20)
    python tests/chaos/chaos.py --seed 7            # replay one seed (make chaos SEED=7)

One 3-node cluster (a head and two workers that alone run sessions) serves
every seed; ``loomray supervise`` runs beside it all along (a thread, as on a
head node). Each seed runs one scenario (:mod:`chaos_scenario`): its sessions
in one placement (even seeds ``actor``, odd ``dense``), tools that sleep,
hold the GIL, raise, ``sys.exit`` or ``os._exit``, and faults at random
points. A failing seed prints the command that replays it (the plan replays
exactly; the timing of a real cluster does not). Exit status 1 when any
invariant was violated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parents[1])):
    if p not in sys.path:
        sys.path.insert(0, p)

#: Seconds every session has to rest after the last fault, on a machine whose load is at most its core count.
BOUND_S = 120.0


def effective_bound(bound_s: float) -> float:
    """``bound_s`` stretched by how oversubscribed the machine is when a seed starts (never shortened, at most
    four times).

    Reaching the restart limit takes several process starts one after another, each slower in proportion
    to the load of a shared machine; the bound is about stuck sessions, not slow ones.
    """
    return bound_s * min(4.0, max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1)))


def top_up(lc: Any, attempts: int = 5) -> None:
    """Add worker nodes back up to two; a node that fails to register (Ray's 30 s, missed under heavy load)
    is tried again, ``attempts`` times in all."""
    for attempt in range(attempts):
        try:
            while len(lc.workers) < 2:
                lc.add_node()
            return
        except Exception as e:
            print(f"    checker: adding a worker node failed ({type(e).__name__}); attempt {attempt + 1} of {attempts}",
                  flush=True)
    raise RuntimeError("could not bring the cluster back to two worker nodes")


def run(seeds: list[int], sessions: int, bound_s: float) -> int:
    """Run ``seeds`` on one cluster; print a line per seed and a summary; the number of failing seeds."""
    from loomray.runtime.connection import apply_ray_env_defaults

    apply_ray_env_defaults()
    from chaos_scenario import MAX_RESTARTS, execute, plan, runtime

    from loomray.runtime.ray_runtime import supervise
    from loomray.testing.cluster import local_cluster

    work = Path(tempfile.mkdtemp(prefix="loomray-chaos-"))
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
           "LOOMRAY_CHAOS_DIR": str(work)}
    os.environ["LOOMRAY_CHAOS_DIR"] = str(work)
    started, failing, faults, idle = time.monotonic(), [], Counter(), Counter()
    # Workers' logs stay in the cluster's log files: the report is one line per seed.
    with local_cluster(num_nodes=3, worker_resources={"loomray_session": 100}, env=env,
                       init_kwargs={"log_to_driver": False}) as lc:
        runtimes = {placement: runtime(placement, work / "store") for placement in ("actor", "dense")}
        stop = threading.Event()
        keeper = threading.Thread(target=supervise, args=(str(work / "store"),), daemon=True,
                                  kwargs={"interval_s": 0.2, "stop": stop, "report": lambda line: None,
                                          "max_restarts_per_session": MAX_RESTARTS,
                                          # What an operator passes (--allow-agent): the agents it may adopt.
                                          "allowed_agents": ("chaos_kinds:*",)})
        keeper.start()
        try:
            for seed in seeds:
                p = plan(seed, sessions)
                faults.update(f"{p.placement}:{f}" for _, f, _ in p.faults)
                t0, bound = time.monotonic(), effective_bound(bound_s)
                violations, notes = asyncio.run(execute(p, runtimes[p.placement], lc, bound))
                idle.update(f"{p.placement}:{n.split(' ')[0]}" for n in notes)
                print(f"seed {seed:4d} {p.placement:5s} {','.join(p.kinds)} | "
                      f"{' '.join(f'{f}@{at}s->{i}' for at, f, i in p.faults)} | "
                      f"{time.monotonic() - t0:5.1f} s, load {os.getloadavg()[0]:.0f}, bound {bound:.0f} s "
                      f"{'ok' if not violations else 'VIOLATED'}", flush=True)
                for n in notes:
                    print(f"    note: {n}", flush=True)
                for v in violations:
                    print(f"    {v}", flush=True)
                if violations:
                    failing.append(seed)
                    print(f"    replay: python tests/chaos/chaos.py --seed {seed} --sessions {sessions}", flush=True)
                top_up(lc)
        finally:
            stop.set()
            keeper.join(timeout=30)
    wall = time.monotonic() - started
    print(f"{len(seeds)} seed(s), {sessions} sessions each, {len(failing)} violating {failing}, {wall:.0f} s; "
          f"faults planned (placement:fault): {dict(sorted(faults.items()))}; of which found nothing to break "
          f"(the session had ended, or never waited for approval): {dict(sorted(idle.items()))}", flush=True)
    return len(failing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--seeds", type=int, default=20, help="run seeds 0..N-1")
    group.add_argument("--seed", type=int, nargs="+", help="replay these seeds")
    parser.add_argument("--first", type=int, default=0, help="with --seeds: the first seed")
    parser.add_argument("--sessions", type=int, default=5, help="sessions per scenario")
    parser.add_argument("--bound", type=float, default=BOUND_S, help="seconds every session has to rest (stretched by the load per core when above 1)")
    args = parser.parse_args(argv)
    seeds = args.seed if args.seed is not None else list(range(args.first, args.first + args.seeds))
    return 1 if run(seeds, args.sessions, args.bound) else 0


if __name__ == "__main__":
    sys.exit(main())
