"""A store written by the release before checkpoint format 2.0 (whole-transcript checkpoints, one index file per
checkpoint): its crashed run is continued by this release, on top of its format-1.0 checkpoints.

``tests/fixtures/store_v1_0`` was written by that release: the run below, killed right before its fourth model
call (three passes done, three format-1.0 checkpoints, the tool results journaled).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from loomray import Agent, Tuning
from loomray.checkpoint_format import load_checkpoint
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "store_v1_0"


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def _agent(root: Path) -> tuple[Agent, ScriptedModel]:
    model = ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(4)] + ["done: v1"])
    return Agent("You look things up.", model=model, tools=[lookup], runtime=LocalRuntime(root),
                 tuning=Tuning(checkpoint=True)), model


async def test_a_run_crashed_under_format_1_0_continues_without_repeating_a_model_call(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(FIXTURE, root)
    agent, model = _agent(root)
    old = await agent.list_checkpoints("v1-session")
    assert [m.turn for m in old] == [3, 2, 1]
    first = await agent.get_checkpoint("v1-session", old[-1].checkpoint_id)
    assert first.schema_version == "1.0" and first.turn == 1
    result = await agent.run("research task", session_id="v1-session")  # the recovery rule: continue the run
    assert result.output == "done: v1" and result.turns == 5
    assert model.calls == 2 and result.model_calls == 2  # passes 4 and 5 only: nothing done before is billed
    assert [m.content for m in result.messages if m.role == "tool"] == [f"value of k{i}" for i in range(4)]
    latest = load_checkpoint(agent.runtime.store, "v1-session")
    assert latest.schema_version == "2.0" and latest.messages == result.messages
    raw = json.loads(agent.runtime.store.checkpoints.get("v1-session"))
    assert raw["index"]["chain"][0] == old[0].checkpoint_id  # the new chain builds on the 1.0 checkpoint
    assert [m.turn for m in await agent.list_checkpoints("v1-session")] == [5, 4, 3, 2, 1]
    agent.runtime.close()
