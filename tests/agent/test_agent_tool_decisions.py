"""Deciding a tool call beyond yes and no: approve it with edited arguments (the tool runs once, with them), or
answer in its place (the tool never runs); through the API, the CLI, and across a SIGKILL of the process that
applied the decision."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner
from control_tools import effects, lookup, reset_effects, transfer  # noqa: F401 - reset_effects: autouse
from crash_procs import run_child

from loomray import Agent, Approve, CheckpointConfig, Respond, Tuning
from loomray.cli.main import main
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls
from loomray.runtime import LocalRuntime

REPO = Path(__file__).resolve().parents[2]
SCRIPT = [{"tool": "transfer", "args": {"amount": 3}}, "done"]


def agent_for(store_dir: Path, calls: Path | None = None) -> Agent:
    return Agent("You help.", model=ScriptedModel(SCRIPT, counter_path=calls), tools=[lookup, transfer],
                 runtime=LocalRuntime(store_dir), tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))


def tool_results(result) -> list[str]:
    return [m.content for m in result.messages if m.role == "tool"]


@pytest.mark.parametrize("decision", [Approve(arguments={"amount": 1}), {"arguments": {"amount": 1}}],
                         ids=["typed", "dict"])
async def test_approve_with_edited_arguments_runs_the_tool_once_with_them(tmp_path, decision):
    waiting = await agent_for(tmp_path).run("pay", session_id="e1")
    call = waiting.pending_approvals[0]
    done = await agent_for(tmp_path).resume(None, session_id="e1", approvals={call.id: decision})
    assert done.stop_reason == "completed" and effects == ["transfer-1"]
    assert tool_results(done) == ["moved 1"]
    # the transcript keeps the model's call as it wrote it; the journal holds the decision that changed it
    assert [c.arguments for m in done.messages for c in m.tool_calls] == [{"amount": 3}]


@pytest.mark.parametrize("decision", [Respond("paid by hand on Monday"), {"respond": "paid by hand on Monday"}],
                         ids=["typed", "dict"])
async def test_respond_answers_in_the_tools_place_and_never_runs_it(tmp_path, decision):
    calls = tmp_path / "calls"
    waiting = await agent_for(tmp_path, calls).run("pay", session_id="r1")
    call = waiting.pending_approvals[0]
    done = await agent_for(tmp_path, calls).resume(None, session_id="r1", approvals={call.id: decision})
    assert done.stop_reason == "completed" and effects == []
    assert tool_results(done) == ["paid by hand on Monday"] and count_calls(calls) == [0, 1]


async def test_the_cli_edits_and_responds_through_the_same_stored_decision(tmp_path):
    store = tmp_path / "store"
    first = (await agent_for(store).run("pay", session_id="c1")).pending_approvals[0].id
    second = (await agent_for(store).run("pay", session_id="c2")).pending_approvals[0].id
    cli = CliRunner()
    edited = cli.invoke(main, ["approve", "c1", first, "--arguments", '{"amount": 9}', "--json", "--store", str(store)])
    assert edited.exit_code == 0, edited.output
    assert json.loads(edited.stdout)["arguments"] == {"amount": 9}
    answered = cli.invoke(main, ["respond", "c2", second, "not today", "--store", str(store)])
    assert answered.exit_code == 0 and "answered in the tool's place" in answered.output
    refused = cli.invoke(main, ["approve", "c1", first, "--arguments", "[1, 2]", "--store", str(store)])
    assert refused.exit_code == 2 and "JSON object" in refused.output
    conflict = cli.invoke(main, ["approve", "c2", second, "--store", str(store)])  # the first decision wins
    assert conflict.exit_code == 2 and "already decided: answered in the tool's place" in conflict.output
    listed = json.loads(cli.invoke(main, ["approvals", "--json", "--store", str(store)]).stdout)
    assert sorted(r["decision"] for r in listed) == ["answered in the tool's place", "approved with edited arguments"]
    assert tool_results(await agent_for(store).resume(None, session_id="c1")) == ["moved 9"]
    assert tool_results(await agent_for(store).resume(None, session_id="c2")) == ["not today"]
    assert effects == ["transfer-9"]


def test_a_bad_decision_fails_before_anything_is_written(tmp_path):
    from loomray import control

    for bad in ({"arguments": [1]}, {"respond": 3}, {"arguments": {}, "respond": "x"}, 1.5, Approve, Respond):
        with pytest.raises(TypeError):
            control.normalize_decision(bad)
    with pytest.raises(TypeError, match="JSON object"):
        Approve(arguments=[1])
    with pytest.raises(TypeError, match="must be JSON"):
        Approve(arguments={"when": object()})
    with pytest.raises(TypeError, match="str"):
        Respond(3)
    assert control.normalize_decision(Approve()) == control.normalize_decision(True)


async def test_typed_and_dict_forms_are_one_stored_decision(tmp_path):
    """Approve(arguments=...) and {"arguments": ...} store the same decision: repeating one as the other is the
    same decision (no conflict), a different one is refused."""
    from loomray.errors import LoomrayUserError

    waiting = await agent_for(tmp_path).run("pay", session_id="t1")
    call = waiting.pending_approvals[0].id
    runtime = agent_for(tmp_path).runtime
    assert await runtime.decide("t1", call, Approve(arguments={"amount": 2})) is True
    assert await runtime.decide("t1", call, {"arguments": {"amount": 2}}) is False  # the same one, again
    with pytest.raises(LoomrayUserError, match="already decided"):
        await runtime.decide("t1", call, Respond("no"))
    done = await agent_for(tmp_path).resume(None, session_id="t1")
    assert tool_results(done) == ["moved 2"] and effects == ["transfer-2"]


# -- across a SIGKILL of the process that applied the decision -------------------------------------------


def _child(data_dir: Path, out: Path, kill: str = "", **env: str):
    e = {**os.environ, "CRASH_POSITION": "both", "CONTROL_APPROVE_PAGE": "2", "PYTHONPATH": str(REPO), **env}
    return run_child([str(data_dir), "sess-dec", str(out), kill], e, out.with_suffix(".log"))


def _effects(d: Path) -> list[str]:
    return (d / "effects").read_text().split() if (d / "effects").exists() else []


@pytest.mark.parametrize("typed", ["typed", ""], ids=["Approve-Respond", "dict"])
@pytest.mark.parametrize("decision, page_effects, result", [
    ({"arguments": {"topic": "ray", "page": 7}}, ["ray-7"], "page 7 on ray"),
    ({"respond": "page 2 was read by a person"}, [], "page 2 was read by a person"),
], ids=["edited", "respond"])
def test_a_decision_applied_once_across_a_kill(tmp_path, decision, page_effects, result, typed):
    """``typed``: the child passes ``Approve(arguments=...)`` / ``Respond(text)``, else the dict forms."""
    d = tmp_path / "data"
    d.mkdir()
    # 1: runs until it waits for page 2's approval, and is killed after returning.
    assert _child(d, d / "first.json", "exit:kill").returncode == -signal.SIGKILL
    # 2: applies the decision, journals it, and is killed before the call's tool runs.
    second = _child(d, d / "second.json", "event:control:1", CONTROL_APPROVE="s0002_0",
                    CONTROL_DECISION=json.dumps(decision), CONTROL_TYPED=typed)
    assert second.returncode == -signal.SIGKILL, second.stderr
    # 3: resumes with no decision given: the journaled one applies, once.
    third = _child(d, d / "third.json", CRASH_RESUME="1")
    assert third.returncode == 0, third.stderr
    out = json.loads((d / "third.json").read_text())
    assert out["output"] == "report: done"
    assert _effects(d) == ["ray-0", "ray-1", *page_effects, "ray-3", "ray-4"]
    page2 = [m["content"] for m in out["messages"] if m["role"] == "tool"][2]
    assert page2.startswith(result)
    assert count_calls(d / "model_calls") == [0, 1, 2, 3, 4, 5]  # no model call made twice
