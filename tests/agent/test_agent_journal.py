"""The journal seam: determinism violations, fencing, session rows, and execute_request as the actor calls it."""

from __future__ import annotations

import pytest

from loomray import Agent, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime, LocalRuntime
from loomray.session import RunRequest, execute_request
from loomray.storage.errors import LeaseLostError


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def script():
    return ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"])


async def test_changed_inputs_re_execute_and_say_so():
    runtime = InProcRuntime()
    model = script()
    await Agent("v1 instructions", model=model, tools=[lookup], runtime=runtime).run("task", session_id="s")
    assert model.calls == 3
    events = []
    changed = Agent("v2 instructions", model=model, tools=[lookup], runtime=runtime)
    result = await changed.resume(session_id="s", emit=events.append)  # no checkpoint: replay fallback
    violations = [e for e in events if e.type == "determinism_violation"]
    assert violations and violations[0].step_key == "t0000-model" and violations[0].kind == "model"
    assert violations[0].journaled_hash != violations[0].actual_hash
    assert result.model_calls == 3 and model.calls == 6  # re-executed, never a stale journaled answer
    assert result.messages[0].content == "v2 instructions"


async def test_identical_replay_reports_replayed_steps_only():
    runtime = InProcRuntime()
    agent = Agent("sys", model=script(), tools=[lookup], runtime=runtime)
    await agent.run("task", session_id="s")
    events = []
    result = await agent.resume(session_id="s", emit=events.append)
    assert [e.step_key for e in events if e.type == "replayed_step"] == [
        "t0000-model", "t0000-tool-s0000_0", "t0001-model", "t0001-tool-s0001_0", "t0002-model"]
    assert result.model_calls == 0 and result.replayed_steps == 5
    assert all(e.replayed for e in events if e.type in ("model_response", "tool_result"))


async def test_a_fenced_run_stops_on_lease_loss(tmp_path):
    runtime = LocalRuntime(tmp_path / "d")
    taken = []

    def usurp(key: str) -> str:
        """Another incarnation takes the session mid-run."""
        taken.append(runtime.store.leases.acquire("s", owner="newer-incarnation"))
        return "ok"

    model = ScriptedModel([{"tool": "usurp", "args": {"key": "x"}}, "done"])
    agent = Agent("", model=model, tools=[usurp], runtime=runtime, tuning=Tuning(checkpoint=True))
    with pytest.raises(LeaseLostError):
        await agent.run("task", session_id="s")
    # It learns at its next proof of the lease (a batch of checkpoints, LEASE_CHECK_WRITES writes, or its end:
    # here its end, after the final answer), and reports nothing.
    assert model.calls == 2 and taken[0].epoch == 2
    assert await agent.list_checkpoints("s") == []  # nothing written after losing the lease
    row = runtime.store.sessions.get("s")
    assert row.status == "running"  # the fenced incarnation does not mark the session failed


async def test_session_rows_track_the_run(tmp_path):
    runtime = LocalRuntime(tmp_path / "d")
    agent = Agent("", model=ScriptedModel(["done"]), runtime=runtime)
    result = await agent.run("task", session_id="s", user_id="u1", metadata={"ticket": 7})
    row = runtime.store.sessions.get("s", user_id="u1")
    assert row.status == "completed" and row.run_id == result.run_id and row.epoch == 1
    assert row.spec_json is None  # the request is kept out of the index (it may hold secrets) ...
    record = runtime.store.runs.last("s", user_id="u1")  # ... in the run's record beside the session's objects
    spec = RunRequest.model_validate(record.request)
    assert record.run_id == result.run_id and spec.prompt == "task" and spec.metadata == {"ticket": 7}

    failing = Agent("", model=ScriptedModel([]), runtime=runtime)
    with pytest.raises(Exception, match="ScriptedModel has 0 replies"):
        await failing.run("task", session_id="f")
    failed = runtime.store.sessions.get("f")
    assert failed.status == "failed" and "ModelError" in failed.error


async def test_execute_request_is_the_actor_entry_point(tmp_path):
    from loomray.storage import open_store

    store = open_store(tmp_path / "d")
    agent = Agent("sys", model=ScriptedModel([*script().responses, "done again"]), tools=[lookup],
                  tuning=Tuning(checkpoint=True))
    request = RunRequest(kind="run", prompt="task", session_id="s", user_id="bob", context={"k": 1})
    wire = request.model_dump_json()  # what crosses to the actor
    assert RunRequest.model_validate_json(wire) == request
    seen = []
    result = await execute_request(agent, RunRequest.model_validate_json(wire), store,
                                   max_checkpoints_per_session=2, emit=seen.append)
    assert result.output == "done" and result.user_id == "bob"
    assert len(store.checkpoints.list("s", user_id="bob")) == 2
    assert store.leases.current_epoch("s", user_id="bob") == 1
    assert seen[0].type == "run_start" and seen[-1].type == "run_end"
    # The same request again (a restarted actor) finds the run finished and starts a new one, which continues
    # the session's conversation.
    again = await execute_request(agent, request, store)
    assert again.run_id != result.run_id and store.leases.current_epoch("s", user_id="bob") == 2
    assert again.output == "done again"
    store.close()


async def test_live_context_objects_reach_tools_in_process_and_are_named_in_the_spec():
    from loomray import ToolContext

    class Db:
        def get(self, key):
            return f"db[{key}]"

    def read(key: str, ctx: ToolContext) -> str:
        """Read from the caller's database handle."""
        return ctx.context.get(key)

    runtime = InProcRuntime()
    agent = Agent("", model=ScriptedModel([{"tool": "read", "args": {"key": "a"}}, "done"]), tools=[read],
                  runtime=runtime)
    result = await agent.run("go", session_id="ctx", context=Db())
    assert result.messages[-2].content == "db[a]"
    assert runtime.store.runs.last("ctx").request["context"] == "<unserializable Db>"


def test_tool_step_keys_are_valid_ids_and_stay_distinct():
    from loomray.journal import tool_step_key
    from loomray.storage.ids import validate_id

    ids = ["call_1", "call.1", "call/1", "toolu_01/../" * 20, "x" * 300]
    keys = [tool_step_key(7, i) for i in ids]
    assert len(set(keys)) == len(ids) and keys[0] == "t0007-tool-call_1"
    for key in keys:
        validate_id(key)


def test_the_journal_writes_the_run_start_and_end_kinds_storage_reads():
    """``loomray.journal`` knows nothing of storage, so it spells the two kinds itself; they must match."""
    from loomray.journal import RUN_END_KIND, RUN_START_KIND
    from loomray.storage import journal as stored

    assert (RUN_START_KIND, RUN_END_KIND) == (stored.RUN_START, stored.RUN_END)
