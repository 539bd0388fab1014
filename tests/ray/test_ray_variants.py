"""Forks of variants on a real 3-node Ray cluster, in both placements: each fork runs its variant's agent, and a
fork whose node is removed mid-run (SIGKILL of the node's processes) continues elsewhere with the same agent:
the variant's model and instructions, no model call made twice.

The cluster is the one tests/ray/conftest.py shares; this module has a store of its own on it. Session actors
(and dense hosts) need the ``loomray_session`` resource, which only workers have, so removing a worker really
takes a fork down. The models log every call to a file (``ray_agents``), so calls are counted across processes.
"""

import asyncio
import copy
import time

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def env(shared_cluster, tmp_path_factory):
    import ray_agents

    from loomray.runtime import RayRuntime

    runtime = RayRuntime(tmp_path_factory.mktemp("ray-variants") / "store",
                         actor_options={"resources": {"loomray_session": 1}})
    dense = RayRuntime(runtime.config.store_url, actor_options={"resources": {"loomray_session": 1}},
                       placement="dense")
    yield shared_cluster.lc, {"actor": runtime, "dense": dense}, ray_agents
    runtime.close()
    dense.close()


@pytest.fixture(params=["actor", "dense"])
def placed(request, env):
    lc, runtimes, agents = env
    return lc, runtimes[request.param], agents, "" if request.param == "actor" else "_dense"


async def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _turn(store, session_id):
    rows = store.checkpoints.list(session_id, limit=1)
    return rows[0].turn if rows else -1


def _calls(agents, name):
    path = agents.ROOT / name / "model-calls"
    return sorted(int(x) for x in path.read_text().split()) if path.exists() else []


async def test_a_variant_fork_whose_node_dies_continues_with_the_same_agent(placed):
    lc, runtime, agents, suffix = placed
    from loomray import Variant
    from loomray.runtime.actors import set_agent_ref

    name = "variant_kill" + suffix
    store = runtime.store
    base = copy.copy(getattr(agents, name))
    base.runtime = runtime
    set_agent_ref(base, f"ray_agents:{name}")
    source = await base.run("start", session_id=f"src-{name}")
    assert source.output == "source ready"
    variant = Variant(model=getattr(agents, f"{name}_model"), instructions="variant rules")

    before = {r.session_id for r in store.sessions.list()}
    fork = asyncio.create_task(base.fork(source.session_id, from_checkpoint=source.checkpoint_id,
                                         variants=[variant]))
    # The fork's session, found by its row in the store, mid-run by its own checkpoints (turn 1 is the source's).
    forks: list[str] = []
    await _until(lambda: forks.extend({r.session_id for r in store.sessions.list()} - before) or forks, 60,
                 "the fork's session row")
    fork_sid = forks[0]
    await _until(lambda: _turn(store, fork_sid) >= 3, 60, "the fork's checkpoint of turn 3")
    info = await runtime.session(fork_sid)
    victim = lc.node_of(info["node_id"])
    assert victim is not None and victim is not lc.head
    lc.remove_node(victim)  # SIGKILL: the fork's actor (or its dense host) dies with its node

    [result] = await asyncio.wait_for(fork, 120)
    # The continued run is the variant's: its model's last reply names the variant's instructions.
    assert result.session_id == fork_sid and result.output == "finished under: variant rules"
    assert result.messages[0].content == "variant rules"
    assert result.turns == 1 + agents.TURNS + 1
    row = store.sessions.get(fork_sid)
    assert row.status == "completed" and row.epoch == 2 and row.node_id != victim.node_id  # restarted elsewhere
    # Every reply of the variant's model served once across both incarnations; the base model only for the source.
    assert _calls(agents, f"{name}-variant") == list(range(1, agents.TURNS + 2))
    assert _calls(agents, name) == [0]
    [record] = store.runs.list(fork_sid)
    assert record.request["variant"] == {"model": "variant-model", "instructions": "variant rules"}
    status = {s["session_id"]: s for s in await runtime.status()}[fork_sid]
    assert (status["incarnation"], status["restarts"]) == (2, 1)
    lc.add_node()


async def test_variants_fan_out_each_with_its_own_agent(placed):
    lc, runtime, agents, suffix = placed
    from loomray import Agent, Edit, Message, Tuning, Variant
    from loomray.models import ScriptedModel

    base = Agent("Be brief.", model=ScriptedModel(["ready", agents.instructed]), runtime=runtime,
                 tuning=Tuning(checkpoint=True), name="fanbase")
    source = await base.run("start", session_id="src-fan" + suffix)
    others = [ScriptedModel(["-", f"model {i} answers"], name=f"m{i}") for i in range(3)]
    variants = [Variant(model=m) for m in others] + [
        Variant(instructions="Be thorough."),
        Variant(edits=[Edit.replace(0, Message(role="system", content="Edited rules."))], prompt="again"),
    ]
    forks = await base.fork(source.session_id, from_checkpoint=source.checkpoint_id, variants=variants)
    assert [f.output for f in forks] == ["model 0 answers", "model 1 answers", "model 2 answers",
                                        "finished under: Be thorough.", "finished under: Edited rules."]
    assert forks[-1].messages[-2].content == "again"
    stored = [store_run.request["variant"] for f in forks for store_run in runtime.store.runs.list(f.session_id)]
    assert stored == [v.to_json() for v in variants]
    # The source is untouched: one checkpoint per pass it ran, its transcript as it was.
    assert (await base.get_checkpoint(source.session_id)).messages == source.messages


async def test_a_variant_fork_adopted_by_reference_rebuilds_its_variant_from_the_store(placed):
    """The fork's actor (or dense host) and the supervisor are killed at once: nothing in memory survives. The
    new supervisor imports the base agent by reference and rebuilds the variant from the fork's run record:
    its tools (by name), its tuning (checkpoints after the model call too) and its instructions."""
    lc, runtime, agents, suffix = placed
    from loomray import CheckpointConfig, Tuning, Variant
    from loomray.runtime.actors import NAMESPACE, set_agent_ref, supervisor_name

    name = "variant_adopt" + suffix
    store = runtime.store
    base = copy.copy(getattr(agents, name))
    base.runtime = runtime
    set_agent_ref(base, f"ray_agents:{name}")
    source = await base.run("start", session_id=f"src-{name}")
    variant = Variant(instructions="adopted rules", tools=["slow_step"],
                      tuning=Tuning(checkpoint=CheckpointConfig(position="both")))
    before = {r.session_id for r in store.sessions.list()}
    fork = asyncio.create_task(base.fork(source.session_id, from_checkpoint=source.checkpoint_id,
                                         variants=[variant]))
    forks: list[str] = []
    await _until(lambda: forks.extend({r.session_id for r in store.sessions.list()} - before) or forks, 60,
                 "the fork's session row")
    fork_sid = forks[0]
    await _until(lambda: _turn(store, fork_sid) >= 3, 60, "the fork's checkpoint of turn 3")
    host = (await runtime.session(fork_sid))["host"]
    ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))
    ray.kill(ray.get_actor(host, namespace=NAMESPACE))

    [result] = await asyncio.wait_for(fork, 120)
    assert result.output == "finished under: adopted rules; tools: slow_step"
    row = store.sessions.get(fork_sid)
    assert row.status == "completed" and row.epoch == 2 and row.agent_ref == f"ray_agents:{name}"
    assert _calls(agents, name) == list(range(agents.TURNS + 2))  # each reply once, the source's included
    # The second incarnation checkpoints as the variant's tuning says: after the model call too.
    late = [r for r in store.checkpoints.list(fork_sid, limit=None) if r.epoch == 2]
    assert {r.position for r in late} == {"after_model", "after_tools"}
