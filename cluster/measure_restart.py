"""Measure how long a session is interrupted when its node dies, and what a restart costs.

    .venv/bin/python cluster/measure_restart.py [--repeats 3] [--out bench/results/ray_restart.json]

A 3-node local cluster (tuned failure detection); a RayRuntime session of the
``nodekill`` agent from tests/ray/ray_agents.py (0.4 s tool steps) runs on a
worker; its node is SIGKILLed after step 3. Timed from the kill: the
supervisor noticing (new incarnation's lease, epoch 2) and the next tool step
starting on the new node. Also: a fresh session's submit-to-first-step time.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loomray.testing.cluster import local_cluster

HERE = Path(__file__).resolve().parent
AGENTS = HERE.parent / "tests" / "ray"


async def _until(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


async def _one(lc, runtime, agents, i: int) -> dict:
    import ray

    from loomray.runtime.actors import NAMESPACE, session_actor_name, set_agent_ref

    sid = f"measure-{i}"
    agent = copy.copy(agents.nodekill)
    agent.runtime = runtime
    set_agent_ref(agent, "ray_agents:nodekill")
    for f in (agents.ROOT / "nodekill").glob("*"):
        f.unlink()
    t0 = time.perf_counter()
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: agents.steps_started("nodekill") >= 1)
    first_step = time.perf_counter() - t0
    await _until(lambda: agents.steps_started("nodekill") >= 3)
    info = await ray.get_actor(session_actor_name(sid), namespace=NAMESPACE).info.remote()
    victim = lc.node_of(info["node_id"])
    t1 = time.perf_counter()
    lc.remove_node(victim)
    await _until(lambda: runtime.store.leases.current_epoch(sid) >= 2)
    new_lease = time.perf_counter() - t1
    await _until(lambda: agents.steps_started("nodekill") >= 4)
    next_step = time.perf_counter() - t1
    await asyncio.wait_for(run, 120)
    lc.add_node()
    return {"submit_to_first_step_s": first_step, "kill_to_new_lease_s": new_lease, "kill_to_next_step_s": next_step}


async def _main(repeats: int) -> list[dict]:
    os.environ["LOOMRAY_RAY_TEST_DIR"] = tempfile.mkdtemp(prefix="loomray-measure-")
    sys.path.insert(0, str(AGENTS))
    pythonpath = os.pathsep.join(p for p in (str(AGENTS), os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as store, local_cluster(
            num_nodes=3, worker_resources={"loomray_session": 100},
            env={"PYTHONPATH": pythonpath, "LOOMRAY_RAY_TEST_DIR": os.environ["LOOMRAY_RAY_TEST_DIR"]}) as lc:
        import ray_agents

        from loomray.runtime import RayRuntime

        runtime = RayRuntime(store, actor_options={"resources": {"loomray_session": 1}})
        return [await _one(lc, runtime, ray_agents, i) for i in range(repeats)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/ray_restart.json")
    args = ap.parse_args()
    rows = asyncio.run(_main(args.repeats))
    print(f"{'metric':<24} {'median':>8} {'min':>8} {'max':>8}")
    for key in rows[0]:
        vals = [r[key] for r in rows]
        print(f"{key:<24} {statistics.median(vals):>7.2f}s {min(vals):>7.2f}s {max(vals):>7.2f}s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
