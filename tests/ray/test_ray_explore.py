"""``Agent.explore`` on the shared 3-node cluster in dense placement: 8 branches from one checkpoint.

The branches run as virtual actors in host actors on the workers; a function
judge picks the winner and the base session adopts it. The result, the fork
tree (``loomray tree``'s view) and the exploration's query columns
(``loomray query --exploration``) must agree on scores and spend, and the
spend must sum to what the models billed (the checkpoint index's per-row
``spend_usd``, which counts each billed call once).

A submitted exploration (``loomray explore --submit`` in a driver process that
exits at once) runs in the store's supervisor; the supervisor is killed mid
round and the one ``supervise`` recreates continues it from the store.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "explore"))

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


def _submit_from_a_driver_process(lc, store: Path) -> tuple[subprocess.CompletedProcess, float]:
    """``loomray explore --submit`` in a process of its own: its output, and how long the process lived."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), str(HERE.parent / "explore")]),
           "RAY_ADDRESS": lc.address}
    variants = [f'{{"prompt": "variant {n} q={q} passes=2"}}' for n, q in (("s0", 0.2), ("s1", 0.7))]
    # A submitted variant may set tools (by the agent's names) and tuning: both store whole.
    variants.append('{"prompt": "variant s2 q=0.4 passes=2", "tools": ["step"], '
                    '"tuning": {"checkpoint": true, "max_turns": 20}}')
    args = ["explore", "base-sub", *(a for v in variants for a in ("--variant", v)), "--rounds", "2", "--keep", "1",
            "--adopt", "--judge", "explore_ray_agent:model_judge", "--agent", "explore_ray_agent:counted",
            "--id", "xpl-sub", "--submit", "--address", lc.address, "--store", str(store), "--placement", "dense",
            "--json"]
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "loomray.cli", *args], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    return out, time.monotonic() - started


async def test_a_submitted_exploration_outlives_its_driver_and_a_killed_supervisor(runtime, shared_cluster):
    """The supervisor runs the exploration; killed mid-round (a branch's model call in flight), the one
    ``supervise`` recreates continues it from the store: one winner, no branch call or judge call twice."""
    from loomray.cli.explore_view import load_exploration
    from loomray.runtime.actors import NAMESPACE, supervisor_name
    from loomray.runtime.ray_runtime import supervise
    from loomray.testing import wait_for

    lc, test_dir = shared_cluster.lc, shared_cluster.agents
    test_dir.mkdir(exist_ok=True)
    await make_agent(runtime).run("task", session_id="base-sub")
    objects = runtime.store.objects
    record, mark = "sessions/_/base-sub/explorations/xpl-sub/", "submitted-explorations/_/xpl-sub.json"

    out, lived = await asyncio.to_thread(_submit_from_a_driver_process, lc, Path(runtime.config.store_url))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"exploration_id": "xpl-sub", "session_id": "base-sub",
                                      "supervisor": supervisor_name(runtime.config.store_url)}
    assert lived < 60  # it returned at once (a process start and a cluster join), the exploration still to run
    assert objects.get(key=record + "submit.json") is not None and objects.get(key=mark) is not None

    # Round 2's s1 waits in its second model call; its siblings have made their last (not judged yet: the
    # round judges its branches once its fan-out is over).
    def in_round_two() -> bool:
        calls = (test_dir / "xsub-calls").read_text().splitlines() if (test_dir / "xsub-calls").exists() else []
        return (test_dir / "xsub-waiting").exists() and all(
            sum(c.startswith(f"branch {n} round 2 ") for c in calls) == 3 for n in ("s0", "s2"))

    await asyncio.to_thread(wait_for, in_round_two, timeout=90, what="round 2 with s1 in flight")
    assert objects.get(key=record + "result.json") is None  # the driver is gone; the exploration is not over
    old = ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE)
    old_id = old._actor_id.hex()
    ray.kill(old)  # no restart: `loomray supervise` recreates it

    stop, reports = threading.Event(), []
    keeper = threading.Thread(target=supervise, args=(runtime.config.store_url,), daemon=True, kwargs={
        "stop": stop, "interval_s": 0.5, "report": reports.append, "allowed_agents": ["explore_ray_agent:*"]})
    keeper.start()
    try:
        await asyncio.to_thread(wait_for, lambda: any("ready" in r for r in reports), timeout=120,
                                what="a new supervisor")
        (test_dir / "xsub-gate").write_text("open")
        await asyncio.to_thread(wait_for, lambda: objects.get(key=record + "result.json") is not None, timeout=240,
                                what="the exploration's result")
    finally:
        stop.set()
        keeper.join(30)
    new = ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE)
    assert new._actor_id.hex() != old_id

    done = load_exploration(runtime.store, "xpl-sub", None)
    assert done.rounds_run == 2 and done.winner == "xpl-sub-r2-001"
    assert [b.stop_reason for b in done.branches] == ["completed"] * 6
    assert (await runtime.get_checkpoint("base-sub")).forked_from == done.winner
    assert objects.get(key=record + "driver-error.json") is None
    await asyncio.to_thread(wait_for, lambda: objects.get(key=mark) is None, timeout=30, what="the mark removed")
    # Each call once: 6 branches of 2 tool passes and an answer, 6 judge calls (one final score each).
    calls = (test_dir / "xsub-calls").read_text().splitlines()
    assert len(calls) == len(set(calls)), [c for c in calls if calls.count(c) > 1]
    assert sum(c.startswith("branch ") for c in calls) == 6 * 3
    assert sum(c.startswith("judge ") for c in calls) == 6
    s2 = [b for b in done.branches if b.variant.prompt.startswith("variant s2")]
    assert len(s2) == 2 and all(b.variant.tuning.max_turns == 20 and b.variant.tools == ("step",) for b in s2), s2
