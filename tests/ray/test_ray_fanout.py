"""Actor placement's standby session actors: sessions and forks start on pre-started actors.

The supervisor keeps ``standby_actors`` session actors started per distinct
``actor_options`` (process up, loomray imported, store open). A session that
starts claims one, which becomes that session's actor (and nothing else's);
the pool refills once the burst is over; with none left a session starts its
own actor as before. What is asserted is the mechanism (which actor a session
got, what the pool did), not timings: speed lives in bench/ray_bench.py.
"""

import asyncio
import os
import time
from pathlib import Path

import pytest

from loomray.testing import wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

POOL = 2


@pytest.fixture(scope="module")
def env(shared_cluster):
    """On the cluster tests/ray/conftest.py shares, which its reset left with no other module's standbys (the
    pool counts below are this runtime's alone); ``root`` is the workers' LOOMRAY_FANOUT_TEST_DIR."""
    from loomray.runtime import RayRuntime

    root = shared_cluster.fanout
    runtime = RayRuntime(root / "store", actor_options={"resources": {"loomray_session": 1}}, standby_actors=POOL)
    yield shared_cluster.lc, runtime, root
    runtime.close()


def _agent(runtime, replies, tools=()):
    from loomray import Agent, Tuning
    from loomray.models import ScriptedModel

    return Agent("fanout", model=ScriptedModel(list(replies)), tools=list(tools), tuning=Tuning(checkpoint=True),
                 runtime=runtime, name="fanout")


async def _warm(runtime, n=POOL, timeout=120.0):
    """This runtime's pool once it holds ``n`` warm standbys (asking also starts the pool)."""
    from loomray.runtime.actors import standby_options

    key = standby_options(runtime.config)[0]
    deadline = time.monotonic() + timeout
    while True:
        status = await runtime.standby_status()
        pool = next((p for p in status["pools"] if p["key"] == key), None)
        if pool is not None and pool["warm"] >= n and pool["starting"] == 0:
            return status
        if time.monotonic() > deadline:
            raise TimeoutError(f"standby pool not warm: {status}")
        await asyncio.sleep(0.2)


def _named(prefix):
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


async def test_a_session_starts_on_a_warm_standby_which_the_pool_replaces(env):
    _, runtime, root = env
    from loomray.runtime.actors import STANDBY_PREFIX

    before = await _warm(runtime)
    standbys = _named(STANDBY_PREFIX)
    assert len(standbys) == POOL

    result = await _agent(runtime, ["hello"]).run("hi", session_id="s-warm")

    assert result.output == "hello"
    info = await runtime.session("s-warm")
    assert info["host"] in standbys and info["incarnation"] == 1 and info["placement"] == "actor"
    assert runtime.store.get_session("s-warm").epoch == 1  # an ordinary first lease
    after = await _warm(runtime)
    assert after["claimed"] == before["claimed"] + 1 and after["missed"] == before["missed"]
    assert after["created"] == before["created"] + 1  # replaced once the start was over
    # The claimed standby served that one session: it exits with it and is never offered again.
    wait_for(lambda: info["host"] not in _named(STANDBY_PREFIX), timeout=30, what="the used standby to exit")
    assert len(_named(STANDBY_PREFIX)) == POOL


async def test_a_fork_burst_takes_the_standbys_then_starts_its_own_actors(env):
    _, runtime, root = env
    from loomray.runtime.actors import STANDBY_PREFIX, session_actor_name

    agent = _agent(runtime, ["source", "fork"])
    source = await agent.run("hi", session_id="s-burst")
    before = await _warm(runtime)

    forks = await agent.fork("s-burst", from_checkpoint=source.checkpoint_id, prompts=[f"p{i}" for i in range(4)])

    assert [f.output for f in forks] == ["fork"] * 4
    status = {s["session_id"]: s for s in await runtime.status()}
    hosts = [status[f.session_id]["host"] for f in forks]
    on_standby = [h for h in hosts if h.startswith(STANDBY_PREFIX)]
    assert len(on_standby) == POOL  # every warm standby was used ...
    # ... and the rest started their own actors, named after their sessions, as without a pool.
    assert sorted(h for h in hosts if not h.startswith(STANDBY_PREFIX)) == sorted(
        session_actor_name(runtime.config.store_url, f.session_id) for f, h in zip(forks, hosts, strict=False) if not h.startswith(STANDBY_PREFIX))
    after = await _warm(runtime)
    assert after["claimed"] - before["claimed"] == POOL and after["missed"] - before["missed"] == 4 - POOL


async def test_a_standby_that_cannot_take_its_session_is_discarded_and_the_error_reported(env):
    _, runtime, root = env
    from loomray.errors import LoomrayUserError
    from loomray.runtime.actors import STANDBY_PREFIX

    before = await _warm(runtime)
    standbys = _named(STANDBY_PREFIX)

    with pytest.raises(LoomrayUserError, match="could not start"):
        await runtime.submit("no_such_module_for_loomray:agent", "hi", session_id="s-unimportable")

    after = await runtime.standby_status()
    assert after["discarded"] == before["discarded"] + 1 and after["claimed"] == before["claimed"]
    # It ran part of that session's start (the import): it is gone, never offered to another session.
    wait_for(lambda: len(standbys - _named(STANDBY_PREFIX)) == 1, timeout=30, what="the discarded standby to exit")
    assert runtime.store.get_session("s-unimportable").status == "failed"
    await _warm(runtime)


def gated_step() -> str:
    """Waits until the test opens the gate (a file), after saying it waits."""
    root = Path(os.environ["LOOMRAY_FANOUT_TEST_DIR"])
    (root / "waiting").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (root / "gate").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "through"


async def test_a_replacement_supervisor_attaches_to_a_session_on_a_standby(env):
    _, runtime, root = env
    from loomray.runtime.actors import NAMESPACE, STANDBY_PREFIX, supervisor_name

    await _warm(runtime)
    agent = _agent(runtime, [{"tool": "gated_step", "args": {}}, "after the gate"], tools=[gated_step])
    run = asyncio.create_task(agent.run("go", session_id="s-adopted"))
    await asyncio.to_thread(wait_for, lambda: (root / "waiting").exists(), timeout=60, what="the gated step")
    info = await runtime.session("s-adopted")
    assert info["host"].startswith(STANDBY_PREFIX) and info["pid"] == int((root / "waiting").read_text())

    ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))  # the driver's next call makes a new one
    # The replacement adopts the session from the store while it still waits at the gate.
    adopted = await runtime.session("s-adopted")
    assert adopted["host"] == info["host"] and adopted["pid"] == info["pid"] and adopted["status"] == "running"
    (root / "gate").write_text("")
    result = await asyncio.wait_for(run, 90)

    assert result.output == "after the gate"
    s = {x["session_id"]: x for x in await runtime.status()}["s-adopted"]
    # Found on its standby and attached to, not restarted: same actor, one incarnation, one lease.
    assert s["host"] == info["host"] and s["incarnation"] == 1 and runtime.store.get_session("s-adopted").epoch == 1
    # The old supervisor's free standbys were found and joined the new one's pool.
    status = await _warm(runtime)
    assert status["discovered"] >= 1


async def test_claim_prefers_warm_standbys_off_the_avoided_node(monkeypatch):
    from loomray.runtime.actors import RuntimeConfig, standby_options
    from loomray.runtime.standby import Standby, StandbyPool

    config = RuntimeConfig(store_url="/tmp/x", actor_options={"resources": {"gpu_box": 1}})
    key = standby_options(config)[0]
    assert key != standby_options(RuntimeConfig(store_url="/tmp/x"))[0]  # other options: another pool
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": True} for n in ("a", "b")])
    pool = StandbyPool("/tmp/x")
    monkeypatch.setattr(pool, "_kick", lambda: None)
    loop = asyncio.get_running_loop()

    def standby(name, node, state):
        fut = loop.create_future()
        if state == "warm":
            fut.set_result(None)
        elif state == "failed":
            fut.set_exception(RuntimeError("died"))
        return Standby(name, key, handle=None, ready=fut, node_id=node)

    pool._free[key] = [standby("failed", "b", "failed"), standby("starting", None, "starting"),
                       standby("on-a", "a", "warm"), standby("on-gone-node", "c", "warm"), standby("on-b", "b", "warm")]

    assert pool.claim(config, avoid_node="a").name == "on-b"  # a restart away from node a
    assert pool.claim(config).name == "on-a"
    assert pool.claim(config).name == "starting"  # none warm left: one with a head start
    assert pool.claim(config) is None  # a failed one, and one on a node that is gone: never
    assert pool.claim(RuntimeConfig(store_url="/tmp/x")) is None


def test_the_pool_key_is_the_same_for_a_config_unpickled_in_another_call():
    """Each submit unpickles the runtime's config anew: its pool must be the same one, strategy objects and all."""
    import pickle

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from loomray.runtime.actors import RuntimeConfig, standby_options

    config = RuntimeConfig(store_url="/tmp/x", actor_options={
        "scheduling_strategy": NodeAffinitySchedulingStrategy("ab" * 28, soft=True), "resources": {"r": 1}})
    key, options = standby_options(config)
    assert standby_options(pickle.loads(pickle.dumps(config)))[0] == key
    assert "name" not in options and options["lifetime"] == "detached" and options["max_restarts"] == 0
    other = RuntimeConfig(store_url="/tmp/x", actor_options={
        "scheduling_strategy": NodeAffinitySchedulingStrategy("cd" * 28, soft=True), "resources": {"r": 1}})
    assert standby_options(other)[0] != key
