"""Measure the local multi-node cluster: start, failure detection, actor start, teardown.

    .venv/bin/python cluster/measure_local.py [--repeats 3] [--skip-default] [--out bench/results/ray_local_cluster.json]

Prints a table and writes JSON. Numbers from one machine are only comparable
within one run (the machine is shared); the ratio "default / tuned" detection
time is the one to look at. Findings are summarised in docs/ray-notes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import ray  # noqa: E402  (after loomray.testing, which pins Ray to loopback)

from loomray.testing import pid_alive, wait_for
from loomray.testing.cluster import FAST_FAILURE_DETECTION, local_cluster, wait_until_dead


@ray.remote(num_cpus=0)
class Probe:
    def where(self):
        return os.getpid(), ray.get_runtime_context().get_node_id()




def _removal(lc, *, graceful: bool) -> dict:
    """Add a node, start an actor there, remove the node; time what follows."""
    node = lc.add_node()
    t0 = time.perf_counter()
    actor = Probe.options(scheduling_strategy=lc.pin(node)).remote()
    pid, _ = ray.get(actor.where.remote(), timeout=60)
    actor_start = time.perf_counter() - t0
    t1 = time.perf_counter()
    lc.remove_node(node, graceful=graceful)
    remove_call = time.perf_counter() - t1
    wait_until_dead(actor, timeout=60)
    died = time.perf_counter() - t1
    wait_for(lambda: not pid_alive(pid), timeout=60, interval=0.02, what="actor process exit")
    pid_gone = time.perf_counter() - t1
    wait_for(lambda: node.node_id not in lc.alive_node_ids(), timeout=60, interval=0.02, what="node marked dead")
    node_dead = time.perf_counter() - t1
    return {
        "actor_start_s": actor_start,
        "remove_call_s": remove_call,
        "actor_died_s": died,
        "actor_process_gone_s": pid_gone,
        "node_marked_dead_s": node_dead,
    }


def _run(label: str, *, fast: bool, repeats: int) -> dict:
    t0 = time.perf_counter()
    with local_cluster(num_nodes=3, namespace="measure", fast_failure_detection=fast) as lc:
        start = time.perf_counter() - t0
        kills = [_removal(lc, graceful=False) for _ in range(repeats)]
        graceful = [_removal(lc, graceful=True) for _ in range(max(1, repeats // 2))]
        t_down = time.perf_counter()
    teardown = time.perf_counter() - t_down
    return {
        "label": label,
        "system_config": FAST_FAILURE_DETECTION if fast else {},
        "cluster_start_3_nodes_s": start,
        "teardown_s": teardown,
        "leftover_processes": lc.leftover,
        "sigkill": kills,
        "graceful": graceful,
    }


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-default", action="store_true", help="do not measure Ray's default health checks (~20 s)")
    ap.add_argument("--out", default="bench/results/ray_local_cluster.json")
    args = ap.parse_args()

    runs = [_run("tuned", fast=True, repeats=args.repeats)]
    if not args.skip_default:
        runs.append(_run("ray-default", fast=False, repeats=1))

    print(f"{'config':<12} {'start':>7} {'actor':>7} {'kill->died':>11} {'kill->pid gone':>15} {'graceful->died':>15} {'teardown':>9}")
    for r in runs:
        print(
            f"{r['label']:<12} {r['cluster_start_3_nodes_s']:>6.2f}s {_median(r['sigkill'], 'actor_start_s'):>6.2f}s "
            f"{_median(r['sigkill'], 'actor_died_s'):>10.2f}s {_median(r['sigkill'], 'actor_process_gone_s'):>14.2f}s "
            f"{_median(r['graceful'], 'actor_died_s'):>14.3f}s {r['teardown_s']:>8.2f}s"
        )
    if len(runs) == 2:
        ratio = _median(runs[1]["sigkill"], "actor_died_s") / _median(runs[0]["sigkill"], "actor_died_s")
        print(f"default / tuned SIGKILL detection: {ratio:.1f}x")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"ray": ray.__version__, "python": platform.python_version(), "cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
