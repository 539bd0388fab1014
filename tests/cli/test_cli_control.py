"""Steering commands through ``loomray``'s main() on a local store: approve, deny, signal, pause, cancel, logs.

The sessions run in this process on a ``LocalRuntime`` over the same directory
the commands open (no cluster); the commands only write and read the store.
Waiting is done on events and polls with deadlines, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from click.testing import CliRunner
from control_tools import (
    DEADLINE_S,
    Gate,
    effects,
    lookup,
    reset_effects,  # noqa: F401 - an autouse fixture: importing it applies it to this module
    transfer,
    user_texts,
)

from loomray import Agent, CheckpointConfig, Tuning
from loomray.cli.main import main
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls
from loomray.runtime import LocalRuntime
from loomray.storage import layout


@pytest.fixture
def store_dir(tmp_path):
    return tmp_path / "store"


def make_agent(store_dir, script, *tools, calls=None) -> Agent:
    return Agent("You help.", model=ScriptedModel(script, counter_path=calls), tools=[lookup, transfer, *tools],
                 runtime=LocalRuntime(store_dir), tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))


def cli(store_dir, *args: str):
    """``loomray ARGS --store DIR`` through main(), in this process."""
    return CliRunner().invoke(main, [*args, "--store", str(store_dir)], catch_exceptions=False)


async def acli(store_dir, *args: str):
    """:func:`cli` from a worker thread, so a session on this event loop keeps running meanwhile."""
    return await asyncio.to_thread(cli, store_dir, *args)


async def test_approve_from_the_cli_then_resume_runs_the_call_once(store_dir, tmp_path):
    calls = tmp_path / "calls"
    script = [{"tool": "transfer", "args": {"amount": 3}}, "done"]
    agent = make_agent(store_dir, script, calls=calls)
    waiting = await agent.run("pay", session_id="c1")
    assert waiting.stop_reason == "awaiting_approval"
    out = cli(store_dir, "approve", "c1", "s0000_0")
    assert out.exit_code == 0, out.output
    assert "approved" in out.output and "loomray resume c1" in out.output
    again = cli(store_dir, "approve", "c1", "s0000_0", "--json")  # the same decision: recorded once
    assert again.exit_code == 0 and json.loads(again.stdout) == {
        "session_id": "c1", "user_id": None, "call_id": "s0000_0", "approved": True, "reason": None,
        "recorded": False}
    conflict = cli(store_dir, "deny", "c1", "s0000_0", "--reason", "changed my mind")
    assert conflict.exit_code == 2 and "already decided" in conflict.output
    assert effects == []
    done = await make_agent(store_dir, script, calls=calls).resume(None, session_id="c1")
    assert done.stop_reason == "completed" and effects == ["transfer-3"] and count_calls(calls) == [0, 1]


async def test_deny_from_the_cli_reaches_the_model_with_its_reason(store_dir):
    agent = make_agent(store_dir, [{"tool": "transfer", "args": {"amount": 9}}, "ok"])
    await agent.run("pay", session_id="c2")
    out = cli(store_dir, "deny", "c2", "s0000_0", "--reason", "over the limit")
    assert out.exit_code == 0, out.output
    assert "denied (over the limit)" in out.output
    done = await agent.resume(None, session_id="c2")
    last = agent.model.requests[-1].messages[-1]
    assert done.stop_reason == "completed" and effects == []
    assert last.role == "tool" and last.is_error and "over the limit" in last.content


def test_mistakes_are_one_line_and_exit_2(store_dir, tmp_path):
    missing = cli(tmp_path / "nowhere", "approve", "x", "y")
    assert missing.exit_code == 2 and "no store" in missing.output
    agent = make_agent(store_dir, [{"tool": "transfer", "args": {"amount": 1}}, "ok"])
    agent.run_sync("pay", session_id="c3")
    for args in (["approve", "c3", "not-a-call"], ["deny", "nope", "s0000_0"], ["signal", "nope", "hi"],
                 ["pause", "nope"], ["cancel", "nope", "--yes"], ["logs", "nope"], ["signal", "c3", ""]):
        out = cli(store_dir, *args)
        assert out.exit_code == 2, (args, out.output)
        assert "error:" in out.output and "Traceback" not in out.output


async def test_signal_from_the_cli_is_delivered_once_while_the_session_runs(store_dir, tmp_path):
    gate = Gate()
    calls = tmp_path / "calls"
    agent = make_agent(store_dir, [{"tool": "slow", "args": {"key": "a"}}, "done"], gate.async_tool(), calls=calls)
    task = asyncio.ensure_future(agent.run("go", session_id="c4"))
    await gate.wait_started()
    out = await acli(store_dir, "signal", "c4", "prefer short answers", "--json")
    assert out.exit_code == 0, out.output
    name = json.loads(out.stdout)["signal"]
    gate.release.set()
    result = await asyncio.wait_for(task, DEADLINE_S)
    assert result.stop_reason == "completed" and user_texts(result.messages) == ["go", "prefer short answers"]
    assert agent.model.requests[-1].messages[-1].content == "prefer short answers"
    assert count_calls(calls) == [0, 1]
    logs = cli(store_dir, "logs", "c4")
    assert logs.exit_code == 0, logs.output
    assert f"signal {name}: prefer short answers" in logs.output


async def test_pause_from_the_cli_then_resume(store_dir, tmp_path):
    gate = Gate()
    calls = tmp_path / "calls"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    agent = make_agent(store_dir, script, gate.async_tool(), calls=calls)
    task = asyncio.ensure_future(agent.run("go", session_id="c5"))
    await gate.wait_started()
    out = await acli(store_dir, "pause", "c5")
    assert out.exit_code == 0 and "stops at its next pass boundary" in out.output, out.output
    gate.release.set()
    paused = await asyncio.wait_for(task, DEADLINE_S)
    assert paused.stop_reason == "paused" and count_calls(calls) == [0]
    assert "paused already" in cli(store_dir, "pause", "c5").output
    done = await agent.resume(None, session_id="c5")
    assert done.stop_reason == "completed" and count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]


async def test_cancel_from_the_cli_stops_a_running_session(store_dir, tmp_path):
    gate = Gate()
    calls = tmp_path / "calls"
    agent = make_agent(store_dir, [{"tool": "slow", "args": {"key": "a"}}, "done"], gate.async_tool(), calls=calls)
    task = asyncio.ensure_future(agent.run("go", session_id="c6"))
    await gate.wait_started()
    refused = await acli(store_dir, "cancel", "c6")  # final, and stdin is not a terminal: nobody to ask
    assert refused.exit_code == 2 and "--yes" in refused.output
    assert agent.runtime.store.objects.get(key=layout.control_key("c6", None, "cancel")) is None
    assert not task.done()
    out = await acli(store_dir, "cancel", "c6", "--yes", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["cancelled"] is True
    assert task.done()  # acknowledged only once the run stopped writing
    result = task.result()
    assert result.stop_reason == "cancelled" and count_calls(calls) == [0] and effects == []
    store = agent.runtime.store
    assert store.sessions.get("c6").status == "cancelled"
    assert store.objects.get(key=layout.control_key("c6", None, "cancel")) is not None
    assert (await agent.run("go", session_id="c6")).stop_reason == "cancelled" and count_calls(calls) == [0]
    gate.release.set()


async def test_logs_prints_every_event_oldest_first_and_follows_a_run(store_dir, tmp_path):
    gate = Gate()
    agent = make_agent(store_dir, [{"tool": "transfer", "args": {"amount": 2}}, "first done",
                                   {"tool": "slow", "args": {"key": "z"}}, "second done"], gate.async_tool())
    await agent.run("pay", session_id="c7")
    await agent.resume(None, session_id="c7", approvals={"s0000_0": "no thanks"})
    out = cli(store_dir, "logs", "c7")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert out.stderr.strip() == "session c7: completed"
    kinds = [line.split()[4] for line in lines]
    assert kinds[:2] == ["run_start", "model"] and kinds[-1] == "run_end" and "approval" in kinds
    assert any("transfer [s0000_0] denied: no thanks" in line for line in lines)
    assert any("answer: first done" in line for line in lines)
    records = [json.loads(line) for line in cli(store_dir, "logs", "c7", "--json").stdout.splitlines()]
    assert [r["kind"] for r in records] == kinds
    assert all(r["created_at"] and "T" in r["created_at"] for r in records)

    # -f on a running session: prints what comes and returns once the run ends.
    task = asyncio.ensure_future(agent.run("again", session_id="c7"))
    await gate.wait_started()
    follow = asyncio.ensure_future(acli(store_dir, "logs", "c7", "-f", "--interval", "0.02"))
    gate.release.set()
    await asyncio.wait_for(task, DEADLINE_S)
    followed = await asyncio.wait_for(follow, DEADLINE_S)
    assert followed.exit_code == 0, followed.output
    assert followed.stdout.count("run_start") == 2 and followed.stdout.splitlines()[-1].split()[4] == "run_end"
    assert "answer: second done" in followed.stdout
    # -f on a session that is not running returns at once.
    assert cli(store_dir, "logs", "c7", "-f").exit_code == 0
