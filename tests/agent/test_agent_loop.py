"""The loop: checkpoint positions, events, usage, max_turns, output_schema, condensing, durability."""

from __future__ import annotations

import asyncio
import logging

import pytest
from agent_helpers import HookedCheckpoints
from pydantic import BaseModel

from loomray import Agent, Checkpoint, CheckpointConfig, Tuning
from loomray.errors import MaxTurnsExceeded
from loomray.events import CondenseEvent
from loomray.loop import OutputValidationError
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def script(n_tool_passes: int, final: str = "final answer") -> list:
    return [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n_tool_passes)] + [final]


def make_agent(tuning=None, model=None, runtime=None, n=3):
    return Agent("You look things up.", model=model or ScriptedModel(script(n)), tools=[lookup],
                 runtime=runtime or InProcRuntime(), tuning=tuning or Tuning())


# -- Tuning ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [Checkpoint(session_id="s", turn=0), "both", 1, {"position": "both"}])
def test_wrong_checkpoint_type_is_a_type_error_when_the_agent_is_built(bad):
    tuning = Tuning(checkpoint=bad)  # accepted here ...
    with pytest.raises(TypeError, match="CheckpointConfig"):
        make_agent(tuning)  # ... refused when the Agent is built


def test_tuning_validation():
    with pytest.raises(TypeError):
        Agent("", model=ScriptedModel(["x"]), tuning={"checkpoint": True})
    with pytest.raises(ValueError):
        CheckpointConfig(position="sometimes")
    with pytest.raises(ValueError):
        Tuning(max_turns=0)
    with pytest.raises(ValueError):
        Tuning(durability="eventually")
    assert CheckpointConfig("both").saves_after_model() and CheckpointConfig("both").saves_after_tools()
    assert not CheckpointConfig().saves_after_model()


# -- checkpoints -------------------------------------------------------------
async def test_checkpointing_is_off_by_default():
    agent = make_agent()
    result = await agent.run("go", session_id="s1")
    assert result.output == "final answer" and result.checkpoint_id is None
    assert await agent.list_checkpoints("s1") == []
    assert await agent.get_checkpoint("s1") is None


@pytest.mark.parametrize("position, expected", [
    ("after_tools", [(1, "after_tools", "active"), (2, "after_tools", "active"), (3, "after_tools", "active"),
                     (4, "after_tools", "completed")]),
    ("after_model", [(0, "after_model", "active"), (1, "after_model", "active"), (2, "after_model", "active"),
                     (4, "after_tools", "completed")]),
    ("both", [(0, "after_model", "active"), (1, "after_tools", "active"), (1, "after_model", "active"),
              (2, "after_tools", "active"), (2, "after_model", "active"), (3, "after_tools", "active"),
              (4, "after_tools", "completed")]),
])
async def test_checkpoint_positions(position, expected):
    agent = make_agent(Tuning(checkpoint=CheckpointConfig(position=position)), runtime=InProcRuntime(0))
    events = []
    result = await agent.run("go", session_id="s1", emit=events.append)
    metas = await agent.list_checkpoints("s1")
    assert [(m.turn, m.position, m.execution_status) for m in reversed(metas)] == expected
    assert result.turns == 4 and result.checkpoint_id == metas[0].checkpoint_id
    after_model = [e for e in events if e.type == "checkpoint" and e.position == "after_model"]
    for e in after_model:  # an after_model snapshot holds the model's tool calls without their results
        ck = await agent.get_checkpoint("s1", e.checkpoint_id)
        assert ck.messages[-1].role == "assistant" and ck.messages[-1].tool_calls
    final = await agent.get_checkpoint("s1")
    assert final.messages == result.messages and final.cumulative_usage == result.usage
    assert final.message_count == len(final.messages)


async def test_checkpoint_true_means_after_tools_and_parent_chain():
    agent = make_agent(Tuning(checkpoint=True))
    await agent.run("go", session_id="s1")
    metas = await agent.list_checkpoints("s1")
    ckpts = [await agent.get_checkpoint("s1", m.checkpoint_id) for m in reversed(metas)]
    assert {c.position for c in ckpts} == {"after_tools"}
    assert [c.parent_checkpoint_id for c in ckpts[1:]] == [c.checkpoint_id for c in ckpts[:-1]]
    assert all(c.agent_id == "agent" and c.schema_version == "2.0" for c in ckpts)  # incremental, read back whole


async def test_failed_checkpoint_write_warns_and_the_run_goes_on(caplog, failing_checkpoints):
    rt = InProcRuntime()
    rt.store = failing_checkpoints(rt.store, failures=2)
    agent = make_agent(Tuning(checkpoint=True), runtime=rt)
    events = []
    with caplog.at_level(logging.WARNING, logger="loomray.loop"):
        result = await agent.run("go", session_id="s1", emit=events.append)
    assert result.output == "final answer" and result.turns == 4
    warnings = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warnings) == 2 and "disk full" in warnings[0].getMessage()
    ck_events = [e for e in events if e.type == "checkpoint"]
    assert [e.ok for e in ck_events] == [False, False, True, True]
    metas = await agent.list_checkpoints("s1")
    assert [m.turn for m in metas] == [4, 3]
    assert result.checkpoint_id == metas[0].checkpoint_id


async def test_every_checkpoint_write_failing_still_completes(caplog, failing_checkpoints):
    rt = InProcRuntime()
    rt.store = failing_checkpoints(rt.store, failures=None)
    agent = make_agent(Tuning(checkpoint=True, durability="async"), runtime=rt)
    with caplog.at_level(logging.WARNING):
        result = await agent.run("go", session_id="s1")
    assert result.output == "final answer" and result.checkpoint_id is None
    assert rt.store.attempts == 4


async def test_async_durability_writes_the_same_checkpoints_in_order():
    sync_agent = make_agent(Tuning(checkpoint=CheckpointConfig("both")), runtime=InProcRuntime(0))
    async_agent = make_agent(Tuning(checkpoint=CheckpointConfig("both"), durability="async"), runtime=InProcRuntime(0))
    r1 = await sync_agent.run("go", session_id="s")
    r2 = await async_agent.run("go", session_id="s")
    m1 = await sync_agent.list_checkpoints("s")
    m2 = await async_agent.list_checkpoints("s")
    assert [(m.turn, m.position) for m in m1] == [(m.turn, m.position) for m in m2]
    assert [m.checkpoint_id for m in m2] == sorted((m.checkpoint_id for m in m2), reverse=True)
    assert r1.messages == r2.messages and r2.checkpoint_id == m2[0].checkpoint_id


async def test_async_durability_overlaps_upload_with_next_model_call():
    """With durability="async" the model is called while the previous checkpoint is still uploading."""
    import threading

    gate = threading.Event()
    uploading = threading.Event()
    overlapped = []

    def slow_put(real, data, info):
        uploading.set()
        gate.wait(timeout=2)  # the upload "takes" until the model has been called again
        uploading.clear()
        return real(data, info)

    class Watching(ScriptedModel):
        async def complete(self, request):
            if self.calls >= 1:
                await asyncio.sleep(0.01)  # let the queued upload start in its thread
                overlapped.append(uploading.is_set())
                gate.set()
            return await super().complete(request)

    rt = InProcRuntime()
    rt.store = HookedCheckpoints(rt.store, slow_put)
    agent = make_agent(Tuning(checkpoint=True, durability="async"), runtime=rt, model=Watching(script(2)))
    result = await agent.run("go", session_id="s1")
    assert overlapped[0] is True and result.turns == 3  # sync durability gives False here
    assert [m.turn for m in await agent.list_checkpoints("s1")] == [3, 2, 1]


@pytest.mark.parametrize("model_delay, overlapped", [(0.0, [False, True, False, False]),
                                                      (0.1, [False, True, True, True])])
async def test_async_durability_overlaps_only_behind_a_model_call_that_can_hide_the_upload(model_delay, overlapped):
    """Async mode writes a checkpoint in line once the model call before it was shorter than the last upload (an
    instant model hides nothing; the two would only compete); behind a model slower than an upload they overlap.
    The first upload always overlaps: nothing was measured yet."""
    import threading
    import time

    uploading = threading.Event()

    def slow_put(real, data, info):
        uploading.set()
        time.sleep(0.03)
        uploading.clear()
        return real(data, info)

    seen = []

    class Watching(ScriptedModel):
        async def complete(self, request):
            if model_delay or len(seen) == 1:  # give a queued upload time to reach its thread
                deadline = time.monotonic() + 1.0
                while not uploading.is_set() and time.monotonic() < deadline:
                    await asyncio.sleep(0.002)
            else:  # a quick call (5 ms, under the 30 ms upload): one overlapping it would see it running
                await asyncio.sleep(0.005)
            seen.append(uploading.is_set())
            return await super().complete(request)

    rt = InProcRuntime()
    rt.store = HookedCheckpoints(rt.store, slow_put)
    agent = make_agent(Tuning(checkpoint=True, durability="async"), runtime=rt,
                       model=Watching(script(3), delay=model_delay))
    result = await agent.run("go", session_id="s1")
    assert result.turns == 4 and seen == overlapped
    assert [m.turn for m in await agent.list_checkpoints("s1")] == [4, 3, 2, 1]


# -- events, usage, limits ---------------------------------------------------
async def test_events_arrive_in_order_sync_and_async_callbacks():
    seen_sync, seen_async = [], []

    async def async_emit(event):
        await asyncio.sleep(0)
        seen_async.append(event.type)

    agent = make_agent(Tuning(checkpoint=True), n=1)
    await agent.run("go", session_id="a", emit=lambda e: seen_sync.append(e.type))
    await agent.run("go", session_id="b", emit=async_emit)
    # A checkpoint event says the store acknowledged the checkpoint: it proved, after the object landed, that no
    # newer owner raced it. It does so in batches, and when the run ends.
    expected = ["run_start", "model_call", "model_response", "tool_call", "tool_result",
                "model_call", "model_response", "checkpoint", "checkpoint", "run_end"]
    assert seen_sync == expected and seen_async == expected


async def test_usage_is_cumulative_and_counts_model_calls():
    model = ScriptedModel(script(3))
    agent = make_agent(model=model)
    result = await agent.run("go")
    assert result.model_calls == 4 == model.calls
    assert result.usage.requests == 4 and result.usage.input_tokens > 0
    assert result.usage.cost_usd == pytest.approx((result.usage.input_tokens + result.usage.output_tokens) / 1e6)
    assert result.session_id.startswith("sess")


async def test_max_turns_stops_and_leaves_a_resumable_checkpoint():
    agent = make_agent(Tuning(checkpoint=True, max_turns=2), n=5)
    with pytest.raises(MaxTurnsExceeded, match="max_turns=2"):
        await agent.run("go", session_id="s1")
    latest = await agent.get_checkpoint("s1")
    assert latest.turn == 2 and latest.execution_status == "active"


class Answer(BaseModel):
    city: str
    population: int


async def test_output_schema_validates_into_structured():
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "oslo"}}, '{"city": "Oslo", "population": 709000}'])
    agent = make_agent(model=model)
    result = await agent.run("how big is Oslo?", output_schema=Answer)
    assert result.structured == Answer(city="Oslo", population=709000)
    assert model.requests[0].output_schema == Answer.model_json_schema()


async def test_output_schema_retry_then_error():
    model = ScriptedModel(["not json", '{"city": "Oslo", "population": 1}'])
    result = await make_agent(model=model).run("q", output_schema=Answer)
    assert result.structured.population == 1 and model.calls == 2
    assert "did not match" in model.requests[1].messages[-1].content
    with pytest.raises(OutputValidationError):
        await make_agent(model=ScriptedModel(["nope", "still nope"])).run("q", output_schema=Answer)


# -- compaction --------------------------------------------------------------
def big_lookup(key: str) -> str:
    """Return a big page."""
    return f"{key}: " + "lorem ipsum " * 300


async def test_condensing_keeps_budget_and_checkpoint_holds_condensed_transcript():
    n = 12
    model = ScriptedModel([{"tool": "big_lookup", "args": {"key": f"k{i}"}} for i in range(n)] + ["report"])
    agent = Agent("sys", model=model, tools=[big_lookup], runtime=InProcRuntime(0),
                  tuning=Tuning(checkpoint=True, condense_after_tokens=3000, condense_keep_last=4))
    events = []
    result = await agent.run("research task", session_id="s1", emit=events.append)
    condensed = [e for e in events if e.type == "condense"]
    assert condensed and all(e.tokens_after < e.tokens_before for e in condensed)
    assert all(type(e) is CondenseEvent for e in condensed)
    assert result.output == "report" and result.turns == n + 1 and model.calls == n + 1
    # The model kept its place after condensing (ScriptedModel reads it from the transcript).
    assert [r.messages[-1].content.split(":")[0] for r in model.requests[1:]] == [f"k{i}" for i in range(n)]
    assert result.messages[0].role == "system" and result.messages[1].content.startswith("research task")
    assert "[compacted:" in result.messages[1].content  # the digest's wording is part of stored transcripts
    # Each checkpoint after condensing holds the condensed transcript, not the full one.
    # (Checkpoint events come when the store acknowledges them, in batches: the checkpoint written right after
    # condensing is the one of the turn it happened at.)
    first = condensed[0]
    ck = next(e for e in events if e.type == "checkpoint" and e.turn == first.turn)
    assert len((await agent.get_checkpoint("s1", ck.checkpoint_id)).messages) == first.messages_after
    # No dangling tool call was ever sent to the model.
    from loomray.loop import dangling_tool_calls

    assert all(not dangling_tool_calls(list(r.messages)) for r in model.requests)


def test_the_old_compaction_names_still_work_with_a_deprecation_warning():
    """Tuning's compact_* keywords and CompactionEvent were renamed (transcript condensing is not the index's
    compaction); for one release the old spellings build the same thing and warn."""
    with pytest.warns(DeprecationWarning, match="deprecated") as warned:
        old = Tuning(compact_after_tokens=3000, compact_keep_last=4)  # type: ignore[call-arg]
    assert sorted(str(w.message).split()[0] for w in warned) == ["Tuning.compact_after_tokens",
                                                                   "Tuning.compact_keep_last"]
    assert old == Tuning(condense_after_tokens=3000, condense_keep_last=4)
    with pytest.warns(DeprecationWarning, match="condense_keep_last"):
        assert old.compact_keep_last == 4
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="condense_keep_last"):
        Tuning(compact_keep_last=1)  # type: ignore[call-arg]  # a bad value still fails when built
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match="both"):
        Tuning(compact_after_tokens=10, condense_after_tokens=20)  # type: ignore[call-arg]
    # A variant stored by the previous release names the old fields: it reads back as it was, without a warning.
    from loomray import Variant

    stored = {"tuning": {"compact_after_tokens": 3000, "compact_keep_last": 4}}
    assert Variant.from_json(stored).tuning == Tuning(condense_after_tokens=3000, condense_keep_last=4)
    from loomray.events import CompactionEvent, event_from_dict

    fields = {"session_id": "s", "tokens_before": 9, "tokens_after": 3, "messages_before": 8, "messages_after": 4}
    with pytest.warns(DeprecationWarning, match="CondenseEvent"):
        event = CompactionEvent(**fields)
    assert isinstance(event, CondenseEvent) and event.type == "compaction"
    with pytest.warns(DeprecationWarning):
        back = event_from_dict({"type": "compaction", **fields})  # an event of the old kind still reads back
    assert isinstance(back, CondenseEvent) and back.tokens_after == 3
    assert type(event_from_dict({"type": "condense", **fields})) is CondenseEvent


async def test_events_are_json_and_round_trip():
    from loomray.events import event_from_dict

    events = []
    await make_agent(Tuning(checkpoint=True), n=1).run("go", session_id="j", emit=events.append)
    import json

    for e in events:
        back = event_from_dict(json.loads(e.model_dump_json()))
        assert type(back) is type(e) and back == e
