"""Steering on a real 3-node cluster: approvals across a lost node, denials, signals, cancel, budgets, spend.

On the cluster tests/ray/conftest.py shares between modules (its reset gives every module two live session
nodes, whatever the one before removed), with a store of its own. Agents come from ``ray_agents``; their
files count effects across processes.
"""

import asyncio
import copy
import os
import time

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]



@pytest.fixture(scope="module")
def env(shared_cluster, tmp_path_factory):
    import ray_agents

    from loomray.runtime import RayRuntime

    # The shared cluster's workers have LOOMRAY_CANCEL_POLL_S=60: only RayRuntime.cancel's direct path can
    # stop a run within the cancel test's deadline.
    assert os.environ.get("LOOMRAY_CANCEL_POLL_S") == "60"
    store = tmp_path_factory.mktemp("ray-steering") / "store"
    runtime = RayRuntime(store, actor_options={"resources": {"loomray_session": 1}})
    dense = RayRuntime(store, actor_options={"resources": {"loomray_session": 1}}, placement="dense")
    yield shared_cluster.lc, runtime, dense, ray_agents
    dense.close()
    runtime.close()


@pytest.fixture(params=["actor", "dense"])
def placed(request, env):
    """``(lc, runtime, agents, suffix)`` for one placement: the dense runs use the ``*_dense`` agents."""
    lc, runtime, dense, agents = env
    return (lc, dense, agents, "_dense") if request.param == "dense" else (lc, runtime, agents, "")


@pytest.fixture
def actor_env(env):
    lc, runtime, _, agents = env
    return lc, runtime, agents


def _driver_agent(agent, ref, runtime):
    from loomray.runtime.actors import set_agent_ref

    mine = copy.copy(agent)
    mine.runtime = runtime
    set_agent_ref(mine, ref)
    return mine


async def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# -- steering on the cluster: approvals, signals, cancel ---------------------------------------------------
def _user_texts(messages):
    return [m.content for m in messages if m.role == "user"]


async def test_a_session_waiting_for_approval_holds_no_process_and_completes_after_its_node_is_lost(placed):
    lc, runtime, agents, suffix = placed
    name = "approve" + suffix
    store, sid = runtime.store, "s-" + name
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    waiting = await agent.run("pay the bill", session_id=sid)
    assert waiting.stop_reason == "awaiting_approval" and agents.files(name, "transfer") == 0
    [call] = waiting.pending_approvals
    row = store.sessions.get(sid)
    assert row.status == "awaiting_approval" and row.node_id
    # While it waits nothing of the session runs: its actor is gone, no process of its own.
    info = await runtime.session(sid)
    assert info is None or info.get("pid") is None, info
    victim = lc.node_of(row.node_id)
    assert victim is not None and victim is not lc.head
    lc.remove_node(victim)  # the node it ran on is lost while it waits

    done = await asyncio.wait_for(agent.resume(None, session_id=sid, approvals={call.id: True}), 90)
    assert done.stop_reason == "completed" and done.output == "transfer settled"
    assert agents.files(name, "transfer") == 1  # the approved call ran once
    assert sorted(agents.model_calls(name)) == [0, 1]  # and no model call was repeated
    final = store.sessions.get(sid)
    assert final.status == "completed" and final.node_id != victim.node_id
    lc.add_node()  # give later tests two session nodes again


async def test_a_denial_on_the_cluster_reaches_the_model_as_the_calls_error(actor_env):
    lc, runtime, agents = actor_env
    agent = _driver_agent(agents.deny, "ray_agents:deny", runtime)
    waiting = await agent.run("pay", session_id="s-deny")
    [call] = waiting.pending_approvals
    done = await agent.resume(None, session_id="s-deny", approvals={call.id: "over the limit"})
    assert done.stop_reason == "completed" and done.output == "transfer refused"
    assert agents.files("deny", "transfer") == 0
    [result] = [m for m in done.messages if m.role == "tool"]
    assert result.is_error and result.tool_call_id == call.id and "over the limit" in result.content
    assert sorted(agents.model_calls("deny")) == [0, 1]


async def test_a_signal_during_a_tool_call_on_the_cluster_is_delivered_once(actor_env):
    lc, runtime, agents = actor_env
    sid, hold = "s-signal", agents.ROOT / "signalled" / "hold"
    agent = _driver_agent(agents.signalled, "ray_agents:signalled", runtime)
    hold.write_text("")
    run = asyncio.ensure_future(agent.run("go", session_id=sid))
    try:
        await _until(lambda: agents.files("signalled", "held") == 1, 60, "the held tool call")
        await agent.signal(sid, "use metric units")
    finally:
        hold.unlink()
    result = await asyncio.wait_for(run, 60)
    assert result.stop_reason == "completed" and result.output == "heard you"
    assert _user_texts(result.messages) == ["go", "use metric units"]
    assert result.messages[-2].content == "use metric units"  # at the boundary, before the second model call
    assert sorted(agents.model_calls("signalled")) == [0, 1]


async def test_a_cancel_during_a_long_tool_call_on_the_cluster_makes_nothing_durable_afterwards(placed):
    lc, runtime, agents, suffix = placed
    name = "cancelled" + suffix
    store, sid, hold = runtime.store, "s-" + name, agents.ROOT / name / "hold"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    hold.write_text("")
    run = asyncio.ensure_future(agent.run("go", session_id=sid))
    try:
        await _until(lambda: agents.files(name, "held") == 1, 60, "the held tool call")
        await agent.cancel(sid)
        acked = [r.checkpoint_id for r in store.checkpoints.list(sid, limit=None)]
        # The run stops at once, its tool call still held (the actors' own look at the store is 60 s away).
        result = await asyncio.wait_for(run, 20)
    finally:
        hold.unlink()
    assert result.stop_reason == "cancelled"
    assert store.sessions.get(sid).status == "cancelled"
    # The session's actor is gone and wrote nothing after the cancel was acknowledged.
    info = await runtime.session(sid)
    assert info is None or info.get("pid") is None, info
    assert [r.checkpoint_id for r in store.checkpoints.list(sid, limit=None)] == acked
    assert agents.files(name, "done") == 0 and sorted(agents.model_calls(name)) == [0]
    again = await agent.resume(None, session_id=sid)
    assert again.stop_reason == "cancelled" and sorted(agents.model_calls(name)) == [0]


async def test_a_budget_stop_on_the_cluster_resumes_with_a_raised_limit_without_repeating_a_call(actor_env):
    lc, runtime, agents = actor_env
    low = _driver_agent(agents.budget_low, "ray_agents:budget_low", runtime)
    stopped = await low.run("task", session_id="s-budget")
    assert stopped.stop_reason == "budget_exceeded" and agents.model_calls("budget") == [0]
    assert runtime.store.sessions.get("s-budget").status == "budget_exceeded"
    high = _driver_agent(agents.budget_high, "ray_agents:budget_high", runtime)
    done = await high.resume(None, session_id="s-budget")
    assert done.stop_reason == "completed" and done.output == "report: done" and done.run_id == stopped.run_id
    assert sorted(agents.model_calls("budget")) == [0, 1, 2, 3, 4]  # every reply once: none repeated
    assert agents.files("budget", "lookup") == 4


async def test_a_fork_tree_on_the_cluster_counts_every_billed_call_once(actor_env):
    lc, runtime, agents = actor_env
    store = runtime.store
    agent = _driver_agent(agents.spend, "ray_agents:spend", runtime)
    source = await agent.run("task", session_id="s-spend")
    base = sorted(store.checkpoints.list("s-spend", limit=None), key=lambda r: r.turn)[1]  # after the 2nd pass
    forks = await agent.fork("s-spend", from_checkpoint=base.checkpoint_id, prompts=["again", "once more"])
    assert [f.stop_reason for f in forks] == ["completed", "completed"]
    tree = [r for sid in ["s-spend", *(f.session_id for f in forks)] for r in store.checkpoints.list(sid, limit=None)]
    assert all(r.spend_usd is not None and r.spend_usd >= 0 for r in tree)
    # What the calls were billed: the source's whole run, plus what each fork spent past its base checkpoint.
    billed = source.usage.cost_usd + sum(f.usage.cost_usd - base.cost_usd for f in forks)
    assert sum(r.spend_usd for r in tree) == pytest.approx(billed)
    assert sum(r.cost_usd for r in tree if r.session_id != "s-spend") > billed - source.usage.cost_usd  # totals
