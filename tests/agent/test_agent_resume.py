"""Seed 000 behaviour on every backend (memory, local directory, S3): resume, fork, listing, users, retention."""

from __future__ import annotations

import time

import pytest
from agent_helpers import Crash, crash_at, lookup, tool_calls

from loomray import Agent, CheckpointConfig, CheckpointMeta, Tuning
from loomray.errors import CheckpointException
from loomray.models import ScriptedModel


def echo_last_user(request):
    last = [m for m in request.messages if m.role == "user"][-1]
    return f"answer to: {last.content}"


def scripted(n_tool_passes=4, tail=3):
    return ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n_tool_passes)]
                         + [echo_last_user] * tail)


def agent_for(runtime, model=None, position="after_tools"):
    return Agent("You look things up.", model=model or scripted(), tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=CheckpointConfig(position=position)))


async def test_restored_turns_are_not_rebilled(runtime):
    model = scripted()
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):
        await agent.run("long research task", session_id="research", emit=crash_at("model_call", 4))
    assert model.calls == 3
    latest = await agent.get_checkpoint("research")
    assert latest.turn == 3 and latest.execution_status == "active"

    result = await agent.resume("pick it up where you left off", session_id="research")
    assert result.session_id == "research" and result.resumed_from_checkpoint
    assert result.resume_position == "after_tools"
    # Two new passes (k3, then the final answer); the first three were restored, not re-run.
    assert result.model_calls == 2 and model.calls == 5 and result.turns == 5
    assert result.usage.requests == 5  # restored usage rolled up with the new
    assert result.usage.input_tokens > latest.cumulative_usage.input_tokens
    assert result.messages[: len(latest.messages)] == latest.messages
    assert result.messages[len(latest.messages)].content == "pick it up where you left off"
    assert result.output == "answer to: pick it up where you left off"
    assert tool_calls == {"k0": 1, "k1": 1, "k2": 1, "k3": 1}


async def test_prompt_none_appends_the_continuation_nudge(runtime):
    # The nudge is for a session whose last run finished; an unfinished one is continued as it was (path 15).
    agent = agent_for(runtime)
    await agent.run("task", session_id="s1")
    result = await agent.resume(session_id="s1")
    nudges = [m for m in result.messages if m.role == "user" and m.content == "Continue the interrupted task."]
    assert len(nudges) == 1 and result.resumed_from_checkpoint
    # The restored transcript is the state: no second system/instructions block is seeded.
    assert [m.role for m in result.messages].count("system") == 1


async def test_latest_id_continues_in_place_and_older_id_forks(runtime):
    agent = agent_for(runtime)
    await agent.run("task", session_id="orig")
    metas = await agent.list_checkpoints("orig")
    assert [m.turn for m in metas] == sorted((m.turn for m in metas), reverse=True)  # newest first
    assert all(isinstance(m, CheckpointMeta) and not hasattr(m, "messages") for m in metas)
    before = [m.checkpoint_id for m in metas]
    original_latest = await agent.get_checkpoint("orig")

    older = metas[-1]  # earliest
    fork = await agent.resume("try a different approach", session_id="orig", from_checkpoint=older.checkpoint_id)
    assert fork.session_id.startswith("sess") and fork.session_id != "orig"
    assert fork.forked_from == "orig" and fork.resumed_from_checkpoint
    older_ck = await agent.get_checkpoint("orig", older.checkpoint_id)
    assert fork.messages[: len(older_ck.messages)] == older_ck.messages
    fork_ck = await agent.get_checkpoint(fork.session_id)
    assert fork_ck.forked_from == "orig" and fork_ck.session_id == fork.session_id
    # The original session and its checkpoints are untouched.
    assert [m.checkpoint_id for m in await agent.list_checkpoints("orig")] == before
    assert await agent.get_checkpoint("orig") == original_latest

    in_place = await agent.resume("one more thing", session_id="orig", from_checkpoint=metas[0].checkpoint_id)
    assert in_place.session_id == "orig" and in_place.forked_from is None
    assert in_place.messages[-2].content == "one more thing"
    assert len(await agent.list_checkpoints("orig")) == len(before) + 1


async def test_fork_fans_out_in_prompt_order(runtime):
    agent = agent_for(runtime, ScriptedModel([{"tool": "lookup", "args": {"key": "x"}}] + [echo_last_user] * 3))
    await agent.run("task", session_id="base")
    first = (await agent.list_checkpoints("base"))[-1]
    results = await agent.fork("base", from_checkpoint=first.checkpoint_id, prompts=["try A", "try B", "try C"])
    assert [r.output for r in results] == ["answer to: try A", "answer to: try B", "answer to: try C"]
    assert len({r.session_id for r in results}) == 3 and all(r.forked_from == "base" for r in results)
    for r in results:
        assert [m.turn for m in await agent.list_checkpoints(r.session_id)] == [2]
    assert len(await agent.list_checkpoints("base")) == 2


async def test_checkpoints_are_per_user(runtime):
    agent = agent_for(runtime)
    await agent.run("alice's task", session_id="shared", user_id="alice")
    assert len(await agent.list_checkpoints("shared", user_id="alice")) == 5
    assert await agent.list_checkpoints("shared") == []
    assert await agent.list_checkpoints("shared", user_id="bob") == []
    assert await agent.get_checkpoint("shared", user_id="bob") is None
    alice_latest = await agent.get_checkpoint("shared", user_id="alice")
    assert alice_latest.user_id == "alice"
    # Bob resuming "shared" sees no checkpoint of his: a plain run, nothing of alice's restored.
    bob = await agent.resume("bob's own task", session_id="shared", user_id="bob")
    assert not bob.resumed_from_checkpoint and bob.resume_position is None
    assert all("alice" not in m.content for m in bob.messages)
    # Alice still resumes hers.
    alice = await agent.resume("and more", session_id="shared", user_id="alice")
    assert alice.resumed_from_checkpoint and alice.messages[1].content == "alice's task"


async def test_resume_without_checkpoint_falls_back_to_journal_replay(runtime):
    model = scripted()
    agent = Agent("You look things up.", model=model, tools=[lookup], runtime=runtime)  # checkpoint off
    first = await agent.run("task", session_id="nock")
    assert model.calls == 5 and await agent.list_checkpoints("nock") == []
    events = []
    again = await agent.resume(session_id="nock", emit=events.append)
    assert not again.resumed_from_checkpoint and again.resume_position is None
    assert again.model_calls == 0 and model.calls == 5  # every step replayed from the journal
    assert again.replayed_steps == 9 and again.messages == first.messages and again.output == first.output
    assert tool_calls == {"k0": 1, "k1": 1, "k2": 1, "k3": 1}
    assert sum(e.type == "replayed_step" for e in events) == 9
    assert not any(e.type == "determinism_violation" for e in events)


async def test_resume_fields_only_when_a_checkpoint_was_acted_on(runtime):
    agent = agent_for(runtime)
    plain = await agent.run("task", session_id="f1")
    assert plain.resumed_from_checkpoint is False and plain.resume_position is None
    resumed = await agent.resume("more", session_id="f1")
    assert resumed.resumed_from_checkpoint is True and resumed.resume_position == "after_tools"
    with pytest.raises(ValueError):
        await agent.resume(session_id="never-ran")  # nothing to resume and no prompt


async def test_unknown_checkpoint_id_is_a_clear_error(runtime):
    agent = agent_for(runtime)
    await agent.run("task", session_id="s1")
    assert await agent.get_checkpoint("s1", "ckpt-nope") is None
    with pytest.raises(CheckpointException, match="ckpt-nope"):
        await agent.resume("x", session_id="s1", from_checkpoint="ckpt-nope")
    with pytest.raises(ValueError):
        await agent.list_checkpoints("../escape")


@pytest.mark.parametrize("keep, expected", [(2, 2), (0, 5), (-1, 5)])
async def test_retention(runtime_factory, keep, expected):
    agent = agent_for(runtime_factory(max_checkpoints_per_session=keep))
    result = await agent.run("task", session_id="r1")
    metas = await agent.list_checkpoints("r1")
    assert len(metas) == expected and metas[0].checkpoint_id == result.checkpoint_id
    assert metas[0].execution_status == "completed"


async def test_prune_deletes_only_matching_sessions(runtime):
    agent = agent_for(runtime)
    await agent.run("task", session_id="p1")
    await agent.run("task", session_id="p2")
    report = runtime.store.prune(session_id="p1")
    assert report.checkpoints == 5 and report.journal_entries > 0
    assert await agent.list_checkpoints("p1") == []
    assert runtime.store.journal.runs("p1") == [] or all(
        not runtime.store.journal.list("p1", r) for r in runtime.store.journal.runs("p1"))
    assert len(await agent.list_checkpoints("p2")) == 5


async def test_half_written_pass_runs_its_tools_before_the_next_model_call(runtime):
    model = scripted()
    agent = agent_for(runtime, model, position="after_model")
    with pytest.raises(Crash):  # dies after the after_model checkpoint of pass 2, before its tool ran
        await agent.run("task", session_id="hw", emit=crash_at("tool_call", 3))
    latest = await agent.get_checkpoint("hw")
    assert latest.position == "after_model" and latest.messages[-1].tool_calls
    assert "k2" not in tool_calls
    result = await agent.resume("go on", session_id="hw")
    assert result.resume_position == "after_model"
    i = len(latest.messages)
    assert result.messages[i].role == "tool" and result.messages[i].content == "value of k2"
    assert result.messages[i + 1].content == "go on"
    for req in model.requests:  # no request ever carried an unanswered tool call
        last_asst = [m for m in req.messages if m.role == "assistant"]
        answered = {m.tool_call_id for m in req.messages if m.role == "tool"}
        assert all(c.id in answered for m in last_asst for c in m.tool_calls)
    assert tool_calls["k2"] == 1


async def test_half_written_pass_runs_its_unsaved_tool_again(runtime):
    agent = agent_for(runtime, position="both")
    with pytest.raises(Crash):  # the tool of pass 1 ran; its after_tools checkpoint, which holds it, never came
        await agent.run("task", session_id="hw2", emit=crash_at("tool_result", 2))
    assert tool_calls == {"k0": 1, "k1": 1}
    latest = await agent.get_checkpoint("hw2")
    assert latest.position == "after_model" and latest.turn == 1
    result = await agent.resume(session_id="hw2")
    # A pass's last tool to finish is not journaled: the checkpoint written right after it holds its result.
    # Dying in between runs it once more (tools are at-least-once); no model call is repeated.
    assert tool_calls == {"k0": 1, "k1": 2, "k2": 1, "k3": 1}
    assert result.messages[len(latest.messages)].content == "value of k1" and result.model_calls == 3


async def test_half_written_pass_replays_the_journaled_results_of_its_other_tools(runtime):
    """Two tool calls in one pass: the one that finishes first is journaled, so a crash before the pass's
    checkpoint replays it, and only the last one runs again."""
    def fetch(key: str) -> str:
        """Fetch something (b is slow)."""
        if key == "b":
            time.sleep(0.3)
        return lookup(key)

    model = ScriptedModel([{"tool": "fetch", "args": {"key": "k0"}},
                           {"tool_calls": [{"name": "fetch", "arguments": {"key": "a"}},
                                           {"name": "fetch", "arguments": {"key": "b"}}]},
                           echo_last_user])
    agent = Agent("You look things up.", model=model, tools=[fetch], runtime=runtime,
                  tuning=Tuning(checkpoint=CheckpointConfig(position="both")))
    with pytest.raises(Crash):  # both tools of pass 1 ran; a finished first and was journaled, b was not
        await agent.run("task", session_id="hw3", emit=crash_at("tool_result", 3))
    assert tool_calls == {"k0": 1, "a": 1, "b": 1}
    events = []
    result = await agent.resume(session_id="hw3", emit=events.append)
    assert tool_calls == {"k0": 1, "a": 1, "b": 2}
    assert [e.tool_call_id for e in events if e.type == "tool_result" and e.replayed] == ["s0001_0"]
    assert result.turns == 3 and result.model_calls == 1  # no model call was repeated


async def test_rerunning_a_crashed_run_replays_and_bills_nothing_twice(runtime):
    """The recovery rule: the same run(prompt, session_id) continues the unfinished run."""
    model = scripted()
    agent = agent_for(runtime, model)
    uninterrupted = await agent_for(runtime, scripted()).run("task", session_id="ref")
    with pytest.raises(Crash):  # the model answered pass 2 (journaled) but its tools and checkpoint never ran
        await agent.run("task", session_id="rr", emit=crash_at("model_response", 3))
    assert model.calls == 3
    result = await agent.run("task", session_id="rr")
    assert model.calls == 5 and result.model_calls == 2 and result.turns == 5
    assert result.resumed_from_checkpoint and result.resume_position == "after_tools"
    assert [m.model_dump() for m in result.messages] == [m.model_dump() for m in uninterrupted.messages]
    assert result.usage == uninterrupted.usage
    assert (await agent.get_checkpoint("rr")).execution_status == "completed"


def test_sync_twins(runtime):
    agent = agent_for(runtime)
    r = agent.run_sync("task", session_id="sy")
    metas = agent.list_checkpoints_sync("sy")
    assert metas[0].checkpoint_id == r.checkpoint_id
    assert agent.get_checkpoint_sync("sy").turn == r.turns
    assert agent.resume_sync("more", session_id="sy").session_id == "sy"
    forks = agent.fork_sync("sy", from_checkpoint=metas[-1].checkpoint_id, prompts=["a"])
    assert forks[0].forked_from == "sy"


async def test_forks_run_at_the_same_time(runtime):
    import asyncio

    barrier = asyncio.Barrier(3)

    async def meet(request):
        await asyncio.wait_for(barrier.wait(), timeout=10)  # only passes if all three forks are in flight
        return f"met after {request.messages[-1].content}"

    agent = agent_for(runtime, ScriptedModel([{"tool": "lookup", "args": {"key": "x"}}, "first", meet]))
    await agent.run("task", session_id="fan")
    results = await agent.fork("fan", from_checkpoint="latest", prompts=["a", "b", "c"])
    assert [r.output for r in results] == ["met after a", "met after b", "met after c"]


async def test_a_crashed_resume_reissued_continues_without_rebilling(runtime):
    model = scripted(n_tool_passes=4, tail=2)
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):
        await agent.run("task", session_id="rc", emit=crash_at("model_call", 2))
    assert model.calls == 1
    with pytest.raises(Crash):  # the resume itself dies after a journaled model answer, before its checkpoint
        await agent.resume("go on", session_id="rc", emit=crash_at("model_response", 2))
    assert model.calls == 3
    result = await agent.resume("go on", session_id="rc")  # the same call again continues that resume
    assert result.model_calls == 2 and model.calls == 5 and result.turns == 5
    assert result.replayed_steps == 1  # the paid-for answer of pass 2 came from the journal
    assert [m.content for m in result.messages if m.role == "user"] == ["task", "go on"]
    assert tool_calls == {"k0": 1, "k1": 1, "k2": 1, "k3": 1}
