"""Session history across runs (issue 22, paths 9-12): prune keeps no request, a budget holds across runs, a
consumed pause stays consumed without checkpoints, a checkpoint equals its own JSON round trip."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
from agent_helpers import Crash, crash_at
from control_tools import (
    DEADLINE_S,
    Gate,
    effects,
    lookup,
    reset_effects,  # noqa: F401 - an autouse fixture: importing it applies it to this module
)

from loomray import Agent, Tuning, tool
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls
from loomray.records import Checkpoint
from loomray.storage import layout


# -- path 12 -------------------------------------------------------------------------------------------------
async def test_a_checkpoint_read_through_the_api_equals_its_json_round_trip(runtime):
    agent = Agent("You help.", model=ScriptedModel(["hello"]), runtime=runtime, tuning=Tuning(checkpoint=True))
    await agent.run("hi", session_id="eq")
    ckpt = await agent.get_checkpoint("eq")
    assert ckpt is not None
    again = Checkpoint.from_json(ckpt.to_json_bytes())
    assert ckpt == again and again == ckpt
    assert ckpt == await agent.get_checkpoint("eq", ckpt.checkpoint_id)
    assert ckpt != again.model_copy(update={"turn": ckpt.turn + 1})  # equality still looks at every field


# -- path 11 -------------------------------------------------------------------------------------------------
async def test_a_consumed_pause_stays_consumed_without_checkpoints(tmp_path, runtime):
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    agent = Agent("You help.", model=ScriptedModel(script, counter_path=calls), tools=[lookup, tool(gate.async_tool())],
                  runtime=runtime)  # checkpoint=False, the default
    task = asyncio.ensure_future(agent.run("go", session_id="p"))
    await gate.wait_started()
    assert (await agent.pause("p")) is not None
    gate.release.set()
    paused = await asyncio.wait_for(task, DEADLINE_S)
    assert paused.stop_reason == "paused" and count_calls(calls) == [0]
    done = await agent.resume(None, session_id="p")
    assert done.stop_reason == "completed" and done.output == "done"
    assert count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]
    again = await agent.resume(None, session_id="p")  # finished: nothing pauses it again
    assert again.stop_reason == "completed"


async def test_a_pause_consumed_before_a_crash_still_stops_the_rerun_without_checkpoints(tmp_path, runtime):
    """The pause's record landed, the stop's did not: the re-issued run stops there once; resume goes past it."""
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    agent = Agent("You help.", model=ScriptedModel(script, counter_path=calls), tools=[lookup, tool(gate.async_tool())],
                  runtime=runtime)
    task = asyncio.ensure_future(agent.run("go", session_id="pc", emit=crash_at("control")))
    await gate.wait_started()
    await agent.pause("pc")
    gate.release.set()
    with pytest.raises(Crash):
        await asyncio.wait_for(task, DEADLINE_S)
    stopped = await agent.run("go", session_id="pc")  # re-issued after the crash: the pause still holds
    assert stopped.stop_reason == "paused" and count_calls(calls) == [0]
    done = await agent.resume(None, session_id="pc")
    assert done.stop_reason == "completed" and count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]


# -- path 10 -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", [True, False])
async def test_a_budget_stop_holds_for_the_sessions_next_runs_until_raised(runtime, checkpoint):
    script = [{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    m = ScriptedModel(script, price_per_mtok=1000.0)
    capped = Agent("You help.", model=m, tools=[lookup], runtime=runtime,
                   tuning=Tuning(checkpoint=checkpoint, max_cost_usd=1e-9))  # reached by the first call
    first = await capped.run("first task", session_id="b")
    assert first.stop_reason == "budget_exceeded" and m.calls == 1
    spent = first.usage.cost_usd
    assert spent is not None and spent > 0
    for prompt in ("second task", "third task"):  # new prompts: new runs of the same session, same budget
        again = await capped.run(prompt, session_id="b")
        assert again.stop_reason == "budget_exceeded" and m.calls == 1
        assert again.usage.cost_usd == pytest.approx(spent)
    # Raised: an agent whose limit is above what the session spent runs, counting on from that spend.
    raised = Agent("You help.", model=m, tools=[lookup], runtime=runtime,
                   tuning=Tuning(checkpoint=checkpoint, max_cost_usd=1.0))
    done = await raised.run("fourth task", session_id="b")
    assert done.stop_reason == "completed" and m.calls > 1
    assert done.usage.cost_usd > spent


# -- path 9 --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", [True, False])
async def test_prune_keeps_no_request_of_a_finished_last_run(runtime, checkpoint):
    script = [{"tool": "lookup", "args": {"key": "a"}}, "done", "done again"]
    agent = Agent("You help.", model=ScriptedModel(script), tools=[lookup], runtime=runtime,
                  tuning=Tuning(checkpoint=checkpoint))
    secrets = {"context": {"api_key": "sk-SECRET-ctx"}, "metadata": {"note": "SECRET-meta"}}
    first = await agent.run("task", session_id="s", **secrets)
    second = await agent.run("more", session_id="s", **secrets)
    store = runtime.store
    store.prune(before=datetime.now(timezone.utc) + timedelta(hours=1), session_id="s")  # everything is older

    held = {o.key: store.objects.get(key=o.key).data for o in store.objects.list(prefix=layout.session_prefix("s", None))}
    assert not [k for k, data in held.items() if b"SECRET" in data]
    # What decides the last run stays, content-free: its record (no request) and its run_end.
    assert [(r.run_id, r.request, r.spec_hash) for r in store.runs.list("s")] == [
        (first.run_id, None, ""), (second.run_id, None, "")]
    assert [e.kind for e in store.journal.list("s", second.run_id)] == ["run_end"]
    again = await agent.run("more", session_id="s", **secrets)  # the same request: finished, so a new run
    assert again.run_id not in (first.run_id, second.run_id) and again.stop_reason == "completed"
