"""RayRuntime on a real 3-node cluster: node death, supervisor death, fan-out, fencing.

One cluster for the module. Session actors need the ``loomray_session``
resource, which only worker nodes have, so removing a worker really takes a
session down. Agents come from ``ray_agents`` (by value and by reference);
their ScriptedModel logs every model call to a file, so "no model call
repeated" is checked across processes and nodes.
"""

import asyncio
import copy
import os
import sys
import time
from pathlib import Path

import pytest

from loomray.testing import local_cluster, wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parent
SESSION_RESOURCE = {"loomray_session": 100}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-runtime")
    os.environ["LOOMRAY_RAY_TEST_DIR"] = str(root / "agents")
    sys.path.insert(0, str(HERE))
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    with local_cluster(num_nodes=3, namespace="loomray", worker_resources=SESSION_RESOURCE,
                       env={"PYTHONPATH": pythonpath, "LOOMRAY_RAY_TEST_DIR": str(root / "agents")}) as lc:
        import ray_agents

        from loomray.runtime import RayRuntime

        runtime = RayRuntime(root / "store", actor_options={"resources": {"loomray_session": 1}})
        yield lc, runtime, ray_agents
        runtime.close()
    sys.path.remove(str(HERE))
    assert lc.leftover == []


def _driver_agent(agent, ref, runtime):
    """The test's handle on a ``ray_agents`` agent: same config, the Ray runtime, and its reference."""
    mine = copy.copy(agent)
    mine.runtime = runtime
    mine.loomray_ref = ref
    return mine


async def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _actor_info(session_id, user_id=None):
    from loomray.runtime.actors import NAMESPACE, session_actor_name

    return await ray.get_actor(session_actor_name(session_id, user_id), namespace=NAMESPACE).info.remote()


async def test_node_death_mid_run_continues_on_another_node(env):
    lc, runtime, agents = env
    agent = _driver_agent(agents.nodekill, "ray_agents:nodekill", runtime)
    run = asyncio.create_task(agent.run("go", session_id="s-nodekill"))
    await _until(lambda: agents.steps_started("nodekill") >= 3, 60, "three tool steps")
    first = await _actor_info("s-nodekill")
    victim = lc.node_of(first["node_id"])
    assert victim is not None and victim is not lc.head

    # The supervisor lives on the head, so losing a worker never takes it down.
    assert (await runtime._call("ready"))["node_id"] == lc.head.node_id
    lc.remove_node(victim)  # SIGKILL: the actor dies with its node

    result = await asyncio.wait_for(run, 90)
    assert result.output == "nodekill finished"
    assert result.turns == agents.TURNS + 1
    # Every scripted reply was served exactly once, across both incarnations.
    assert sorted(agents.model_calls("nodekill")) == list(range(agents.TURNS + 1))
    row = runtime.store.get_session("s-nodekill")
    assert row.status == "completed"
    assert row.epoch == 2  # a second incarnation took the lease
    assert row.node_id != victim.node_id
    status = {s["session_id"]: s for s in await runtime.status()}
    assert status["s-nodekill"]["incarnation"] == 2
    lc.add_node()  # give later tests two session nodes again


async def test_supervisor_killed_mid_run_new_one_adopts_the_session(env):
    lc, runtime, agents = env
    from loomray.runtime.actors import NAMESPACE, SUPERVISOR_NAME

    agent = _driver_agent(agents.orphaned, "ray_agents:orphaned", runtime)
    run = asyncio.create_task(agent.run("go", session_id="s-orphaned"))
    await _until(lambda: agents.steps_started("orphaned") >= 2, 60, "two tool steps")
    old = ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)
    old_id = old._actor_id.hex()

    ray.kill(old)  # no restart: the driver's next call creates a replacement

    result = await asyncio.wait_for(run, 90)
    assert result.output == "orphaned finished"
    new = ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)
    assert new._actor_id.hex() != old_id
    # The detached session actor was never interrupted: one lease, each reply once.
    assert runtime.store.get_session("s-orphaned").epoch == 1
    assert sorted(agents.model_calls("orphaned")) == list(range(agents.TURNS + 1))
    sessions = {s["session_id"]: s for s in await runtime.status()}
    assert sessions["s-orphaned"]["state"] == "completed"


async def test_supervisor_and_actor_both_killed_new_supervisor_restarts_by_reference(env):
    lc, runtime, agents = env
    from loomray.runtime.actors import NAMESPACE, SUPERVISOR_NAME, session_actor_name

    agent = _driver_agent(agents.adopted, "ray_agents:adopted", runtime)
    run = asyncio.create_task(agent.run("go", session_id="s-adopted"))
    await _until(lambda: agents.steps_started("adopted") >= 2, 60, "two tool steps")

    # Nothing in memory survives: the only way back is the session row (agent_ref + spec) and the store.
    ray.kill(ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE))
    ray.kill(ray.get_actor(session_actor_name("s-adopted"), namespace=NAMESPACE))

    result = await asyncio.wait_for(run, 90)
    assert result.output == "adopted finished"
    row = runtime.store.get_session("s-adopted")
    assert row.status == "completed" and row.epoch == 2 and row.agent_ref == "ray_agents:adopted"
    assert sorted(agents.model_calls("adopted")) == list(range(agents.TURNS + 1))


async def test_fan_out_eight_forks_one_actor_each(env):
    lc, runtime, agents = env
    agent = _driver_agent(agents.quick, None, runtime)  # by value only
    source = await agent.run("hi", session_id="s-source")
    assert source.output == "answer 0"

    forks = await agent.fork("s-source", from_checkpoint=source.checkpoint_id, prompts=[f"p{i}" for i in range(8)])

    assert len(forks) == 8
    assert len({f.session_id for f in forks}) == 8 and "s-source" not in {f.session_id for f in forks}
    assert all(f.output == "answer 1" for f in forks)
    supervised = {s["session_id"]: s for s in await runtime.status()}
    assert all(supervised[f.session_id]["state"] == "completed" for f in forks)
    assert all(supervised[f.session_id]["incarnation"] == 1 for f in forks)


async def test_fenced_actor_stops_and_reports_lease_lost(env):
    lc, runtime, agents = env
    from storage.errors import LeaseLostError

    from loomray.runtime.actors import NAMESPACE, session_actor_name

    agent = _driver_agent(agents.fenced, "ray_agents:fenced", runtime)
    run = asyncio.create_task(agent.run("go", session_id="s-fenced"))
    await _until(lambda: agents.steps_started("fenced") >= 2, 60, "two tool steps")
    info = await _actor_info("s-fenced")

    intruder = runtime.store.acquire_lease("s-fenced", owner="intruder")  # takes over: epoch 2

    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(run, 60)
    assert intruder.epoch == 2
    # The fenced incarnation exits and frees its name; the supervisor does not restart it.
    name = session_actor_name("s-fenced")

    def gone():
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        return False

    wait_for(gone, timeout=30, what=f"actor {name} to exit")
    wait_for(lambda: not _pid_alive(info["pid"]), timeout=30, what="the fenced actor's process to exit")
    assert runtime.store.current_epoch("s-fenced") == 2
    # It stopped mid-run: the script was not played to the end.
    assert len(agents.model_calls("fenced")) < agents.TURNS + 1
    status = {s["session_id"]: s for s in await runtime.status()}
    assert status["s-fenced"]["state"] == "fenced" and status["s-fenced"]["incarnation"] == 1


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_supervise_keeper_recreates_a_killed_supervisor(env):
    import threading

    from loomray.runtime.actors import NAMESPACE, SUPERVISOR_NAME
    from loomray.runtime.ray_runtime import supervise

    lc, runtime, agents = env
    stop, reports = threading.Event(), []
    keeper = threading.Thread(target=supervise, args=(runtime.config.store_url,), daemon=True,
                              kwargs={"interval_s": 0.2, "stop": stop, "report": reports.append})
    keeper.start()
    try:
        wait_for(lambda: reports, timeout=30, what="the keeper to find a supervisor")

        def supervisor_id():
            try:
                return ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)._actor_id.hex()
            except ValueError:
                return None

        old_id = supervisor_id()
        ray.kill(ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE))
        wait_for(lambda: supervisor_id() not in (None, old_id), timeout=30, what="a replacement supervisor")
        assert any("re-creating" in r for r in reports)
    finally:
        stop.set()
        keeper.join(timeout=30)
    assert not keeper.is_alive()
