"""Spend limits (``Tuning.max_cost_usd``/``max_tokens``), ``RunResult.stop_reason`` and per-checkpoint spend.

Costs are real: ``ScriptedModel`` prices its calls from the transcript, so
every call costs something and the same transcript always costs the same.
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timezone

import pyarrow as pa
import pytest
from pydantic import ValidationError

from loomray import Agent, CheckpointConfig, RunResult, Tuning
from loomray.models import ScriptedModel
from loomray.models.base import ModelResponse
from loomray.models.scripted import count_calls
from loomray.records import Message, Usage
from loomray.storage import CheckpointInfo, layout
from loomray.storage.rows import CHECKPOINT_SCHEMA, CheckpointRow, checkpoint_rows_from_table, checkpoint_rows_table
from loomray.storage.testing import write_checkpoint, write_index_file

PASSES = 4  # tool passes; one more pass gives the final answer
tool_calls: dict[str, int] = {}


def lookup(key: str) -> str:
    """Look something up."""
    tool_calls[key] = tool_calls.get(key, 0) + 1
    return f"value of {key} " * 20


@pytest.fixture(autouse=True)
def _reset():
    tool_calls.clear()


class BilledModel(ScriptedModel):
    """A ScriptedModel that also records what each call it made was billed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.billed: list[float] = []

    async def complete(self, request):
        response = await super().complete(request)
        self.billed.append(response.usage.cost_usd)
        return response


def replies(final: str = "report: done") -> list:
    return [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(PASSES)] + [final]


def model(tmp_path, name="calls") -> BilledModel:
    # counter_path: the reply index of every call made, in order (a repeated call shows as a repeated index).
    return BilledModel(replies(), counter_path=tmp_path / name, price_per_mtok=1000.0)


def agent_for(runtime, m, **limits) -> Agent:
    return Agent("You look things up.", model=m, tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools"), **limits))


async def reference_costs(tmp_path, runtime_factory) -> list[float]:
    """Cumulative cost after each model call of an uninterrupted run (what a limit is set between)."""
    runtime = runtime_factory()
    agent = agent_for(runtime, model(tmp_path, "reference"))
    result = await agent.run("task", session_id="reference")
    rows = sorted(runtime.store.checkpoints.list("reference"), key=lambda r: r.turn)
    costs = [r.cost_usd for r in rows]
    assert result.usage.cost_usd == pytest.approx(costs[-1]) and len(costs) == PASSES + 1
    tool_calls.clear()
    return costs


# -- Tuning -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [{"max_cost_usd": -0.01}, {"max_cost_usd": math.nan}, {"max_cost_usd": "1"},
                                 {"max_cost_usd": True}, {"max_tokens": -1}, {"max_tokens": 1.5},
                                 {"max_tokens": False}, {"max_tokens": math.nan}])
def test_bad_limits_are_refused_when_tuning_is_built(bad):
    with pytest.raises(ValueError, match="Tuning.max_"):
        Tuning(**bad)


def test_good_limits_are_kept():
    t = Tuning(max_cost_usd=0, max_tokens=0)
    assert (t.max_cost_usd, t.max_tokens) == (0, 0)
    assert Tuning(max_cost_usd=2.5, max_tokens=10_000).max_cost_usd == 2.5
    assert Tuning().max_cost_usd is None and Tuning().max_tokens is None


def test_stop_reason_is_a_closed_set():
    base = {"output": "", "session_id": "s"}
    for reason in ("completed", "awaiting_approval", "paused", "cancelled", "budget_exceeded"):
        assert RunResult(**base, stop_reason=reason).stop_reason == reason
    for reason in ("max_turns", "over_budget", ""):
        with pytest.raises(ValidationError):
            RunResult(**base, stop_reason=reason)


# -- stop, then resume with a raised limit ------------------------------------------------------
async def test_budget_stop_then_resume_with_a_raised_limit_repeats_no_model_call(tmp_path, runtime_factory):
    costs = await reference_costs(tmp_path, runtime_factory)
    limit = (costs[1] + costs[2]) / 2  # reached after the third call: the fourth would exceed it
    runtime = runtime_factory()
    m = model(tmp_path)
    low = agent_for(runtime, m, max_cost_usd=limit)

    stopped = await low.run("task", session_id="s")
    assert stopped.stop_reason == "budget_exceeded" and stopped.output == ""
    assert m.calls == 3 and count_calls(tmp_path / "calls") == [0, 1, 2]
    assert stopped.usage.cost_usd == pytest.approx(costs[2]) and stopped.usage.cost_usd >= limit
    latest = await low.get_checkpoint("s")
    assert latest.checkpoint_id == stopped.checkpoint_id
    assert latest.turn == 3 and latest.execution_status == "active"
    assert latest.cumulative_usage.cost_usd == pytest.approx(costs[2])
    assert runtime.store.sessions.get("s").status == "budget_exceeded"  # not active: no supervisor restarts it

    # The same call again: still over budget, counted from the restored checkpoint. No call, no new checkpoint.
    again = await low.run("task", session_id="s")
    assert again.stop_reason == "budget_exceeded" and again.run_id == stopped.run_id
    assert m.calls == 3 and again.checkpoint_id == stopped.checkpoint_id
    assert len(runtime.store.checkpoints.list("s")) == 3

    raised = agent_for(runtime, m, max_cost_usd=costs[-1] * 2)
    done = await raised.resume(None, session_id="s")
    assert done.stop_reason == "completed" and done.output == "report: done"
    assert done.run_id == stopped.run_id  # the same run, continued
    assert count_calls(tmp_path / "calls") == list(range(PASSES + 1))  # every reply once: none repeated
    assert tool_calls == {f"k{i}": 1 for i in range(PASSES)}
    assert done.model_calls == 2 and m.calls == PASSES + 1
    # The run's spend is what an uninterrupted run costs: nothing billed twice, nothing lost.
    assert done.usage.cost_usd == pytest.approx(costs[-1]) and sum(m.billed) == pytest.approx(costs[-1])
    assert not any(msg.content == "Continue the interrupted task." for msg in done.messages)
    assert runtime.store.sessions.get("s").status == "completed"


async def test_max_tokens_stops_before_the_call_that_would_exceed(runtime):
    m = ScriptedModel(replies())
    agent = agent_for(runtime, m, max_tokens=1)  # reached by the first call's tokens
    result = await agent.run("task", session_id="t")
    assert result.stop_reason == "budget_exceeded" and m.calls == 1 and result.usage.total_tokens >= 1
    assert (await agent.get_checkpoint("t")).turn == 1
    result = await agent_for(runtime, m).resume(None, session_id="t")
    assert result.stop_reason == "completed" and m.calls == PASSES + 1


async def test_a_limit_already_reached_makes_no_model_call(runtime):
    m = ScriptedModel(replies())
    agent = agent_for(runtime, m, max_cost_usd=0)
    result = await agent.run("task", session_id="z")
    assert result.stop_reason == "budget_exceeded" and m.calls == 0 and result.usage.cost_usd == 0
    ckpt = await agent.get_checkpoint("z")  # the prompt is saved: resume(None) continues with it
    assert ckpt.turn == 0 and [x.content for x in ckpt.messages] == ["You look things up.", "task"]


async def test_budget_stop_without_checkpoints_resumes_from_the_journal(tmp_path, runtime):
    """Checkpointing off: nothing is written at the stop; the unfinished run's journal replays on resume."""
    m = model(tmp_path)
    tuning = Tuning(max_tokens=1)
    agent = Agent("You look things up.", model=m, tools=[lookup], runtime=runtime, tuning=tuning)
    stopped = await agent.run("task", session_id="j")
    assert stopped.stop_reason == "budget_exceeded" and stopped.checkpoint_id is None and m.calls == 1
    assert runtime.store.checkpoints.list("j") == []
    free = Agent("You look things up.", model=m, tools=[lookup], runtime=runtime)
    done = await free.resume(None, session_id="j")
    assert done.stop_reason == "completed" and done.replayed_steps >= 1
    assert count_calls(tmp_path / "calls") == list(range(PASSES + 1))
    assert tool_calls == {f"k{i}": 1 for i in range(PASSES)}


class Unpriced:
    """A model whose calls have no known price (``cost_usd=None``)."""

    name = "unpriced"

    def __init__(self):
        self.calls = 0

    async def complete(self, request):
        self.calls += 1
        return ModelResponse(message=Message(role="assistant", content=f"answer {self.calls}"),
                             usage=Usage(input_tokens=1, output_tokens=1, requests=1, cost_usd=None))


async def test_an_unknown_cost_is_never_taken_for_zero(runtime):
    m = Unpriced()
    agent = Agent("", model=m, runtime=runtime, tuning=Tuning(checkpoint=True, max_cost_usd=100.0))
    first = await agent.run("q1", session_id="u")
    assert first.stop_reason == "completed" and m.calls == 1  # unknown only after the first call
    second = await agent.run("q2", session_id="u")  # continues the conversation: its spend is unknown now
    assert second.stop_reason == "budget_exceeded" and m.calls == 1
    tokens_only = Agent("", model=m, runtime=runtime, tuning=Tuning(checkpoint=True, max_tokens=1000))
    assert (await tokens_only.resume(None, session_id="u")).stop_reason == "completed" and m.calls == 2


# -- per-checkpoint spend ---------------------------------------------------------------------------
async def test_fork_tree_spend_sums_to_what_the_models_billed(tmp_path, runtime):
    m = model(tmp_path)
    agent = agent_for(runtime, m)
    store = runtime.store
    await agent.run("task", session_id="root")
    root_rows = sorted(store.checkpoints.list("root"), key=lambda r: r.turn)
    forks = await agent.fork("root", from_checkpoint=root_rows[1].checkpoint_id, prompts=["try A", "try B"])
    first_of_a = sorted(store.checkpoints.list(forks[0].session_id), key=lambda r: r.turn)[0]
    nested = await agent.resume("try A.1", session_id=forks[0].session_id, from_checkpoint=first_of_a.checkpoint_id)
    assert nested.session_id not in {f.session_id for f in forks} and nested.forked_from == forks[0].session_id

    sessions = ["root", *(f.session_id for f in forks), nested.session_id]
    rows = [r for s in sessions for r in store.checkpoints.list(s, limit=None)]
    assert all(r.spend_usd is not None and r.spend_usd >= 0 for r in rows)
    assert sum(r.spend_usd for r in rows) == pytest.approx(sum(m.billed))
    # Each session's spend is its own calls; its running total also carries its parent's up to the fork.
    fork_rows = store.checkpoints.list(forks[1].session_id, limit=None)
    first = min(fork_rows, key=lambda r: r.turn)
    assert first.parent_checkpoint_id == root_rows[1].checkpoint_id
    assert first.cost_usd == pytest.approx(root_rows[1].cost_usd + first.spend_usd)
    assert sum(r.cost_usd for s in sessions for r in store.checkpoints.list(s, limit=1)) > sum(m.billed) * 1.01


async def test_spend_after_a_resume_counts_only_new_calls(tmp_path, runtime):
    m = model(tmp_path)
    costs_stopped = await agent_for(runtime, m, max_tokens=1).run("task", session_id="r")
    assert costs_stopped.stop_reason == "budget_exceeded"
    await agent_for(runtime, m).resume(None, session_id="r")
    rows = runtime.store.checkpoints.list("r", limit=None)
    assert sum(r.spend_usd for r in rows) == pytest.approx(sum(m.billed))
    assert max(rows, key=lambda r: r.turn).cost_usd == pytest.approx(sum(m.billed))


def test_index_rows_without_the_spend_column_read_as_none():
    row = CheckpointRow(session_id="s", checkpoint_id="c1", turn=1, created_at=datetime.now(timezone.utc),
                        position="after_tools", execution_status="active", message_count=2, input_tokens=10,
                        output_tokens=5, cost_usd=0.25, agent_id="agent", epoch=1, key="k", size=10,
                        sha256="0" * 64, spend_usd=0.25)
    table = checkpoint_rows_table([row], tombstone=False, written_at=datetime.now(timezone.utc))
    assert checkpoint_rows_from_table(table)[0][0].spend_usd == 0.25
    old = table.drop_columns(["spend_usd"])  # a file written before the column existed
    (parsed, tomb), = checkpoint_rows_from_table(old)
    assert parsed.spend_usd is None and parsed.cost_usd == 0.25 and not tomb


def test_an_old_index_file_still_lists(tmp_path):
    from loomray.storage import open_store

    store = open_store(tmp_path / "d")
    try:
        data = b'{"x": 1}'
        row = write_checkpoint(store, data, CheckpointInfo(session_id="s", checkpoint_id="ckpt-new", turn=2,
                                                        created_at=datetime.now(timezone.utc), position="after_tools",
                                                        execution_status="active", message_count=1, cost_usd=0.5,
                                                        spend_usd=0.5), keep=0)
        old_row = CheckpointRow(**{**row.__dict__, "checkpoint_id": "ckpt-old", "turn": 1,  # an old writer's row
                                   "key": layout.checkpoint_key("s", None, "ckpt-old"), "size": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()})
        store.objects.put(key=old_row.key, data=data)
        table = checkpoint_rows_table([old_row], tombstone=False, written_at=datetime.now(timezone.utc))
        old = table.drop_columns(["spend_usd"])
        assert old.schema != CHECKPOINT_SCHEMA and isinstance(old, pa.Table)
        write_index_file(store, layout.index_partition(layout.CHECKPOINT_INDEX, "s", None), old)
        fresh = open_store(tmp_path / "d")  # no cached rows: reads the files as another process would
        try:
            listed = {r.checkpoint_id: r.spend_usd for r in fresh.checkpoints.list("s")}
        finally:
            fresh.close()
        assert listed == {"ckpt-new": 0.5, "ckpt-old": None}
    finally:
        store.close()
