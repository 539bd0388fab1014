"""``Agent.explore`` on the shared 3-node cluster in dense placement: 8 branches from one checkpoint.

The branches run as virtual actors in host actors on the workers; a function
judge picks the winner and the base session adopts it. The result, the fork
tree (``loomray tree``'s view) and the exploration's query columns
(``loomray query --exploration``) must agree on scores and spend, and the
spend must sum to what the models billed (the checkpoint index's per-row
``spend_usd``, which counts each billed call once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "explore"))

import explore_agents  # noqa: E402
from explore_agents import judge, make_agent, variant  # noqa: E402
from ray import cloudpickle  # noqa: E402

# The workers cannot import tests/explore: the agent's scripted model travels by value.
cloudpickle.register_pickle_by_value(explore_agents)


@pytest.fixture(scope="module")
def runtime(shared_cluster, tmp_path_factory):
    from loomray.runtime import RayRuntime

    rt = RayRuntime(tmp_path_factory.mktemp("explore") / "store", placement="dense",
                    actor_options={"resources": {"loomray_session": 1}})
    yield rt
    rt.close()


async def test_eight_branches_judged_adopted_and_seen_alike_by_tree_and_query(runtime):
    from loomray.cli.explore_view import load_exploration, with_branch_columns
    from loomray.cli.tree_view import fork_tree

    agent = make_agent(runtime)
    await agent.run("task", session_id="base")
    qualities = [0.3, 0.8, 0.1, 0.6, 0.95, 0.2, 0.5, 0.4]
    variants = [variant(f"v{i}", q, i % 3) for i, q in enumerate(qualities)]
    result = await agent.explore("base", variants=variants, judge=judge, adopt=True, exploration_id="xpl-ray")

    assert [b.score for b in result.branches] == qualities
    assert result.winner == result.branches[4].session_id
    assert all(b.stop_reason == "completed" for b in result.branches)
    placements = {(await runtime.session(b.session_id))["placement"] for b in result.branches}
    assert placements == {"dense"}
    adopted = await agent.get_checkpoint("base")
    assert adopted.checkpoint_id == result.adopted_checkpoint_id and adopted.forked_from == result.winner
    assert adopted.messages == (await agent.get_checkpoint(result.winner)).messages

    store = runtime.store
    billed = store.query(columns=["session_id", "spend_usd"]).to_pylist()
    branch_ids = {b.session_id for b in result.branches}
    assert sum(r["spend_usd"] for r in billed if r["session_id"] in branch_ids) == pytest.approx(result.spend_usd)
    nodes = {n.session_id: n for n in fork_tree(store, "base", None).walk()}
    stored = load_exploration(store, "xpl-ray", None)
    table = with_branch_columns(store.query(), stored, None).to_pylist()
    for b in result.branches:
        assert nodes[b.session_id].exploration["score"] == b.score
        assert nodes[b.session_id].own_spend_usd == pytest.approx(b.spend_usd)
        assert {r["score"] for r in table if r["session_id"] == b.session_id} == {b.score}
    assert nodes[result.winner].exploration["winner"] and stored.spend_usd == pytest.approx(result.spend_usd)


async def test_early_stopping_cancels_dominated_branches_on_the_cluster(runtime):
    agent = make_agent(runtime, delay=0.2)
    await agent.run("task", session_id="base-stop")
    variants = [variant(name, q, 6) for name, q in (("a", 0.1), ("b", 0.9), ("c", 0.3), ("d", 0.7))]
    result = await agent.explore("base-stop", variants=variants, judge=judge, score_every=4)
    assert [b.stop_reason for b in result.branches] == ["early_stopped", "completed", "early_stopped", "completed"]
    assert result.saved_usd > 0 and result.winner == result.branches[1].session_id
    for b in result.branches[::2]:  # cancelled through the runtime's cancel path: they run no more
        assert b.turns < 7
        assert (await agent.resume(None, session_id=b.session_id)).stop_reason == "cancelled"


async def test_variants_differing_in_model_instructions_and_tools(runtime):
    from loomray import Variant
    from loomray.models import ScriptedModel

    agent = make_agent(runtime)
    await agent.run("task", session_id="base-mixed")

    def shout() -> str:
        """Another tool."""
        return "LOUD"

    variants = [variant("p", 0.4, 1),
                Variant(prompt="variant m q=0.7 passes=0", model=ScriptedModel(["answer 0.7"] * 3, name="other")),
                Variant(prompt="variant i q=0.6 passes=0", instructions="Be brief."),
                Variant(prompt="variant t q=0.9 passes=1", tools=[explore_agents.step, shout])]
    result = await agent.explore("base-mixed", variants=variants, judge=judge, adopt=True)
    assert [b.score for b in result.branches] == [0.4, 0.7, 0.6, 0.9]
    assert result.winner == result.branches[3].session_id
    assert (await agent.get_checkpoint(result.branches[2].session_id)).messages[0].content == "Be brief."


async def test_a_submitted_exploration_outlives_its_driver_actor_being_killed(runtime):
    from loomray.cli.explore_view import load_exploration
    from loomray.explore.record import variant_doc
    from loomray.runtime.explorations import EXPLORE_PREFIX, submit_exploration
    from loomray.testing import wait_for

    agent = make_agent(runtime)
    await agent.run("task", session_id="base-sub")
    variants = [variant(f"s{i}", q, 3) for i, q in enumerate([0.2, 0.7, 0.4])]
    spec = {"store_url": runtime.config.store_url, "placement": "dense",
            "actor_options": {"resources": {"loomray_session": 1}}, "agent_ref": "explore_ray_agent:agent",
            "judge_ref": "explore_ray_agent:judge", "session_id": "base-sub", "user_id": None,
            "exploration_id": "xpl-sub",
            "args": {"variants": [variant_doc(v) for v in variants], "rounds": 2, "keep": 1, "score_every": None,
                     "adopt": True, "from_checkpoint": "latest", "budget": {"max_cost_usd": None, "max_wall_s": None}}}
    submit_exploration(spec, {"resources": {"loomray_session": 1}})
    record = runtime.store.objects
    prefix = "sessions/_/base-sub/explorations/xpl-sub/"
    wait_for(lambda: record.get(key=prefix + "r001-plan.json") is not None, timeout=120)
    # Its process dies mid-round; Ray restarts the actor, whose constructor continues the exploration by id.
    ray.kill(ray.get_actor(EXPLORE_PREFIX + "xpl-sub", namespace="loomray"), no_restart=False)
    wait_for(lambda: record.get(key=prefix + "result.json") is not None, timeout=240)
    done = load_exploration(runtime.store, "xpl-sub", None)
    assert done.rounds_run == 2 and done.winner == "xpl-sub-r2-001"
    assert all(b.stop_reason == "completed" for b in done.branches)
    assert (await agent.get_checkpoint("base-sub")).forked_from == done.winner
    assert record.get(key=prefix + "driver-error.json") is None

    def gone() -> bool:
        try:
            ray.get_actor(EXPLORE_PREFIX + "xpl-sub", namespace="loomray")
        except ValueError:
            return True
        return False

    wait_for(gone, timeout=60)  # its work done, the actor went
