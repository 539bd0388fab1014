"""Steering a running session (loomray.control): approvals, signals, pause and cancel, durable and exactly once.

Model calls are counted by the scripted model's file-backed counter (the reply
index of every call made, across agents and processes: a repeated call shows
as a repeated index); tool effects by the tools themselves. Waiting is done on
events and polls with deadlines, never on sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_helpers import HookedCheckpoints
from control_tools import (
    DEADLINE_S,
    Gate,
    effects,
    lookup,
    reset_effects,  # noqa: F401 - an autouse fixture: importing it applies it to this module
    transfer,
    user_texts,
)
from crash_procs import run_child

from loomray import Agent, CheckpointConfig, Tuning, tool
from loomray.errors import LoomrayUserError
from loomray.models import ScriptedModel
from loomray.models.scripted import count_calls
from loomray.runtime import LocalRuntime
from loomray.storage import layout

CHILD = Path(__file__).with_name("crash_child.py")
REPO = Path(__file__).resolve().parents[2]


@tool(requires_approval=lambda call: call.arguments.get("amount", 0) > 100)
def pay(amount: int) -> str:
    """Pay an amount; large ones need approval."""
    effects.append(f"pay-{amount}")
    return f"paid {amount}"


def agent_for(runtime, model, tools=(lookup, transfer, pay), position="after_tools", **tuning) -> Agent:
    return Agent("You help.", model=model, tools=list(tools), runtime=runtime,
                 tuning=Tuning(checkpoint=CheckpointConfig(position=position), **tuning))


def control_keys(store, session_id: str, user_id=None) -> list[str]:
    return sorted(o.key for o in store.objects.list(prefix=layout.control_prefix(session_id, user_id)))


def journal(store, session_id: str, user_id=None) -> list:
    """Every replayable entry of the session, oldest run first."""
    runs = [r.run_id for r in store.runs.list(session_id, user_id=user_id)]
    return [e for run in runs for e in store.journal.list(session_id, run, user_id=user_id)]


async def until(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    """Poll ``predicate`` (sync) until true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


# -- approvals -------------------------------------------------------------------------------------------
async def test_approval_waits_durably_and_a_new_runtime_approves_once(tmp_path, runtime_factory):
    calls = tmp_path / "calls"
    script = [{"tool": "transfer", "args": {"amount": 5}}, "sent"]
    first = agent_for(runtime_factory(), ScriptedModel(script, counter_path=calls))
    waiting = await first.run("pay bob", session_id="a1")
    assert waiting.stop_reason == "awaiting_approval" and waiting.output == ""
    assert [(c.id, c.name, c.arguments) for c in waiting.pending_approvals] == [("s0000_0", "transfer", {"amount": 5})]
    assert effects == [] and count_calls(calls) == [0]
    store = first.runtime.store
    ckpt = await first.get_checkpoint("a1")
    assert ckpt.execution_status == "awaiting_approval" and ckpt.position == "after_model"
    assert ckpt.messages[-1].tool_calls[0].id == "s0000_0" and ckpt.checkpoint_id == waiting.checkpoint_id
    assert store.sessions.get("a1").status == "awaiting_approval"
    n_ckpts = len(store.checkpoints.list("a1"))

    # No decision yet: it waits again; no model call, no tool call, no new checkpoint.
    again = await first.resume(None, session_id="a1")
    assert again.stop_reason == "awaiting_approval" and [c.id for c in again.pending_approvals] == ["s0000_0"]
    assert count_calls(calls) == [0] and effects == [] and len(store.checkpoints.list("a1")) == n_ckpts

    # A new runtime and agent over the same store (a new process, as far as state goes) approves.
    second = agent_for(runtime_factory(), ScriptedModel(script, counter_path=calls))
    done = await second.resume(None, session_id="a1", approvals={"s0000_0": True})
    assert done.stop_reason == "completed" and done.output == "sent" and done.run_id == waiting.run_id
    assert effects == ["transfer-5"]
    assert count_calls(calls) == [0, 1] and done.model_calls == 1  # the turn that asked is not asked again
    assert [m.content for m in done.messages if m.role == "tool"] == ["moved 5"]
    approvals = [e for e in journal(store, "a1") if e.kind == "approval"]
    assert [(e.output["call_id"], e.output["approved"]) for e in approvals] == [("s0000_0", True)]
    assert control_keys(store, "a1") == []  # the decision object is gone once its use is durable
    assert store.sessions.get("a1").status == "completed"
    assert (await second.get_checkpoint("a1")).execution_status == "completed"
    with pytest.raises(LoomrayUserError, match="does not wait"):  # nothing waits any more
        await second.resume(None, session_id="a1", approvals={"s0000_0": True})
    assert effects == ["transfer-5"]


async def test_a_denial_reaches_the_model_as_the_calls_error_result(tmp_path, runtime):
    m = ScriptedModel([{"tool": "transfer", "args": {"amount": 900}}, "ok, not sent"], counter_path=tmp_path / "c")
    agent = agent_for(runtime, m)
    waiting = await agent.run("pay eve", session_id="d1")
    done = await agent.resume(None, session_id="d1", approvals={waiting.pending_approvals[0].id: "eve is a fraud"})
    assert done.stop_reason == "completed" and effects == []
    seen = m.requests[-1].messages[-1]  # what the model got for the call
    assert seen.role == "tool" and seen.is_error and seen.tool_call_id == "s0000_0"
    assert "eve is a fraud" in seen.content
    assert count_calls(tmp_path / "c") == [0, 1]
    # A plain False denies without a reason.
    m2 = ScriptedModel([{"tool": "transfer", "args": {"amount": 1}}, "fine"])
    agent2 = agent_for(runtime, m2)
    w2 = await agent2.run("pay", session_id="d2")
    await agent2.resume(None, session_id="d2", approvals={w2.pending_approvals[0].id: False})
    assert m2.requests[-1].messages[-1].is_error and effects == []


async def test_a_policy_decides_per_call_and_nothing_of_the_pass_runs_while_one_waits(tmp_path, runtime):
    script = [{"tool_calls": [{"name": "pay", "arguments": {"amount": 5}},
                              {"name": "pay", "arguments": {"amount": 500}}]}, "paid"]
    m = ScriptedModel(script, counter_path=tmp_path / "c")
    agent = agent_for(runtime, m)
    waiting = await agent.run("pay both", session_id="p1")
    assert waiting.stop_reason == "awaiting_approval"
    assert [c.arguments for c in waiting.pending_approvals] == [{"amount": 500}]
    assert effects == []  # the small one waits with its pass
    with pytest.raises(LoomrayUserError, match="does not wait"):
        await agent.resume(None, session_id="p1", approvals={"s0000_0": True})  # the small one needs none
    done = await agent.resume(None, session_id="p1", approvals={"s0000_1": True})
    assert done.stop_reason == "completed" and sorted(effects) == ["pay-5", "pay-500"]
    assert count_calls(tmp_path / "c") == [0, 1]


async def test_decisions_are_create_only(runtime):
    agent = agent_for(runtime, ScriptedModel([{"tool": "transfer", "args": {"amount": 7}}, "done"]))
    await agent.run("pay", session_id="c1")
    assert await runtime.decide("c1", "s0000_0", True) is True
    assert await runtime.decide("c1", "s0000_0", True) is False  # the same decision again: nothing changes
    with pytest.raises(LoomrayUserError, match="already decided"):
        await agent.resume(None, session_id="c1", approvals={"s0000_0": "no"})
    with pytest.raises(LoomrayUserError, match="does not wait"):
        await runtime.decide("c1", "nope", True)
    with pytest.raises(TypeError):
        await agent.resume(None, session_id="c1", approvals={"s0000_0": 1})
    assert effects == []
    assert (await agent.resume(None, session_id="c1")).stop_reason == "completed"  # the stored decision applies
    assert effects == ["transfer-7"]


def _child(data_dir: Path, out: Path, kill: str = "", **env: str) -> subprocess.CompletedProcess:
    e = {**os.environ, "CRASH_POSITION": "both", "PYTHONPATH": str(REPO), **env}
    return run_child([str(data_dir), "sess-ctl", str(out), kill], e, out.with_suffix(".log"))


def _parsed(path: Path):
    """The JSON in ``path`` once it is whole, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if "stop_reason" in data else None


def _calls(d: Path) -> list[int]:
    return count_calls(d / "model_calls")


def _effects(d: Path) -> list[str]:
    return (d / "effects").read_text().split() if (d / "effects").exists() else []


@pytest.mark.parametrize("kill", ["exit:kill", "event:checkpoint:6"])
async def test_an_approval_survives_the_waiting_process_being_killed(tmp_path, kill):
    """Process 1 runs until it waits for approval of page 2 and is SIGKILLed (after the run returned, or right
    after its awaiting checkpoint landed); process 2 approves: the call runs once, no model call repeats."""
    d = tmp_path / "data"
    d.mkdir()
    env = {"CONTROL_APPROVE_PAGE": "2"}
    first = _child(d, d / "first.json", kill, **env)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert _calls(d) == [0, 1, 2] and _effects(d) == ["ray-0", "ray-1"]
    if kill == "exit:kill":
        assert json.loads((d / "first.json").read_text())["pending"] == ["s0002_0"]
    second = _child(d, d / "second.json", **env, CONTROL_APPROVE="s0002_0")
    assert second.returncode == 0, second.stderr
    out = json.loads((d / "second.json").read_text())
    assert out["stop_reason"] == "completed" and out["output"] == "report: done"
    assert _calls(d) == [0, 1, 2, 3, 4, 5]  # every reply served once across both processes
    assert _effects(d) == [f"ray-{i}" for i in range(5)]  # the approved call ran once


async def test_an_approved_call_cut_short_runs_again_without_a_new_decision_or_model_call(tmp_path):
    """Process 2 approves and dies inside the approved tool; process 3 resumes without passing a decision:
    the journaled decision applies (the tool is at-least-once, as always), no model call repeats."""
    d = tmp_path / "data"
    d.mkdir()
    env = {"CONTROL_APPROVE_PAGE": "2"}
    assert _child(d, d / "first.json", "exit:kill", **env).returncode == -signal.SIGKILL
    second = _child(d, d / "second.json", "tool:1", **env, CONTROL_APPROVE="s0002_0")
    assert second.returncode == -signal.SIGKILL, second.stderr
    third = _child(d, d / "third.json", **env, CRASH_RESUME="1")
    assert third.returncode == 0, third.stderr
    assert json.loads((d / "third.json").read_text())["output"] == "report: done"
    assert _calls(d) == [0, 1, 2, 3, 4, 5]
    assert _effects(d) == ["ray-0", "ray-1", "ray-2-partial", "ray-2", "ray-3", "ray-4"]
    from loomray.storage import open_store

    store = open_store(d / "store")
    try:
        approvals = [e for e in journal(store, "sess-ctl") if e.kind == "approval"]
        assert len(approvals) == 1 and approvals[0].output["approved"] is True
        assert control_keys(store, "sess-ctl") == []
    finally:
        store.close()


# -- signals -----------------------------------------------------------------------------------------------
async def test_a_signal_sent_during_a_tool_call_is_delivered_once_at_the_next_boundary(tmp_path, runtime):
    gate = Gate()
    m = ScriptedModel([{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"],
                      counter_path=tmp_path / "c")
    agent = agent_for(runtime, m, tools=(lookup, tool(gate.async_tool())))
    events = []
    task = asyncio.ensure_future(agent.run("go", session_id="s1", emit=events.append))
    await gate.wait_started()
    name = await agent.signal("s1", "use metric units")
    assert name.startswith("signal-") and control_keys(runtime.store, "s1") != []
    gate.release.set()
    result = await asyncio.wait_for(task, DEADLINE_S)
    assert result.stop_reason == "completed"
    # Delivered at the boundary after the slow pass: the second model call saw it last, the first did not.
    assert user_texts(m.requests[0].messages) == ["go"]
    assert m.requests[1].messages[-1].content == "use metric units" and m.requests[1].messages[-1].role == "user"
    assert user_texts(result.messages) == ["go", "use metric units"]
    assert count_calls(tmp_path / "c") == [0, 1, 2]
    sigs = [e for e in journal(runtime.store, "s1") if e.kind == "signal"]
    assert [(e.step_key, e.output["text"]) for e in sigs] == [(f"t0001-{name}", "use metric units")]
    assert [e.kind for e in events if e.type == "control"] == ["signal"]
    assert control_keys(runtime.store, "s1") == []


class Crash(BaseException):
    """A crash in the middle of a run (not an Exception: nothing catches it, nothing is recorded)."""


async def test_a_consumed_signal_is_replayed_at_the_same_boundary_after_a_crash(tmp_path, runtime_factory):
    gate = Gate()
    crash = {"armed": True}

    def lookup_or_crash(key: str) -> str:
        """Look something up (crashes once)."""
        if crash["armed"]:
            crash["armed"] = False
            raise Crash()
        effects.append(key)
        return f"value of {key}"

    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup_or_crash", "args": {"key": "b"}}, "done"]
    calls = tmp_path / "c"
    rt = runtime_factory()
    tools = (tool(gate.async_tool()), tool(lookup_or_crash))
    agent = agent_for(rt, ScriptedModel(script, counter_path=calls), tools=tools)
    task = asyncio.ensure_future(agent.run("go", session_id="s2"))
    await gate.wait_started()
    await agent.signal("s2", "also check b")
    gate.release.set()
    with pytest.raises(Crash):
        await asyncio.wait_for(task, DEADLINE_S)
    assert count_calls(calls) == [0, 1]  # the signal was consumed and answered before the crash

    # A new runtime re-issues the run: it continues, re-applying the journaled signal at the same boundary.
    again = agent_for(runtime_factory(), ScriptedModel(script, counter_path=calls), tools=tools)
    result = await again.run("go", session_id="s2")
    assert result.stop_reason == "completed" and result.replayed_steps >= 1
    assert count_calls(calls) == [0, 1, 2]  # the model call that saw the signal was replayed, not repeated
    assert user_texts(result.messages) == ["go", "also check b"]
    assert effects == ["slow-a", "b"]
    assert len([e for e in journal(rt.store, "s2") if e.kind == "signal"]) == 1
    assert control_keys(rt.store, "s2") == []


# Appends: run_start, the model answers of passes 0 and 1 (their tool results are in the checkpoints written right
# after them), the signal's consumption (4), the next model answer (5).
@pytest.mark.parametrize("kill", ["store:journal.append:before:4", "store:journal.append:after:4",
                                  "store:journal.append:after:5"])
async def test_a_signal_survives_a_killed_process_exactly_once(tmp_path, kill):
    """The research tool of pass 1 stores a signal (as another client would); the process is SIGKILLed around
    the signal's journal entry (append 4) or the model call that follows it; a new process re-issues the run."""
    d = tmp_path / "data"
    d.mkdir()
    env = {"CONTROL_SIGNAL_AT_PAGE": "1"}
    first = _child(d, d / "first.json", kill, **env)
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = _child(d, d / "second.json", **env)
    assert second.returncode == 0, second.stderr
    out = json.loads((d / "second.json").read_text())
    users = [m["content"] for m in out["messages"] if m["role"] == "user"]
    assert users == ["research ray for me", "SIGNAL: keep it short"]
    at = next(i for i, m in enumerate(out["messages"]) if m["content"] == "SIGNAL: keep it short")
    assert out["messages"][at - 1]["role"] == "tool" and out["messages"][at + 1]["role"] == "assistant"
    assert _calls(d) == [0, 1, 2, 3, 4, 5]
    assert _effects(d) == [f"ray-{i}" for i in range(5)]
    from loomray.storage import open_store

    store = open_store(d / "store")
    try:
        assert len([e for e in journal(store, "sess-ctl") if e.kind == "signal"]) == 1
        assert control_keys(store, "sess-ctl") == []
    finally:
        store.close()


# -- pause ---------------------------------------------------------------------------------------------------
async def test_pause_then_resume_repeats_no_model_call(tmp_path, runtime_factory):
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    rt = runtime_factory()
    tools = (lookup, tool(gate.async_tool()))
    agent = agent_for(rt, ScriptedModel(script, counter_path=calls), tools=tools)
    task = asyncio.ensure_future(agent.run("go", session_id="p1"))
    await gate.wait_started()
    assert (await agent.pause("p1")).startswith("pause-")
    gate.release.set()
    paused = await asyncio.wait_for(task, DEADLINE_S)
    assert paused.stop_reason == "paused" and count_calls(calls) == [0] and effects == ["slow-a"]
    ckpt = await agent.get_checkpoint("p1")
    assert ckpt.execution_status == "paused" and ckpt.turn == 1 and ckpt.checkpoint_id == paused.checkpoint_id
    assert rt.store.sessions.get("p1").status == "paused"
    assert await agent.pause("p1") is None  # paused already: nothing to ask

    other = agent_for(runtime_factory(), ScriptedModel(script, counter_path=calls), tools=tools)
    done = await other.resume(None, session_id="p1")
    assert done.stop_reason == "completed" and done.run_id == paused.run_id
    assert count_calls(calls) == [0, 1, 2] and effects == ["slow-a", "b"]
    assert user_texts(done.messages) == ["go"]  # nothing appended by the resume
    assert [e.kind for e in journal(rt.store, "p1")].count("pause") == 1
    assert control_keys(rt.store, "p1") == []
    with pytest.raises(LoomrayUserError, match="not running"):
        await other.pause("p1")


async def test_a_pause_recorded_before_a_crash_still_stops_the_run(tmp_path, runtime):
    """The pause's journal entry landed but its checkpoint did not: the continued run stops there, once."""
    gate = Gate()
    calls = tmp_path / "c"
    script = [{"tool": "slow", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"]
    tools = (lookup, tool(gate.async_tool()))

    def dies_at_paused_checkpoint(put, data, info):
        if info.execution_status == "paused":
            raise Crash()
        return put(data, info)

    real = runtime.store
    runtime.store = HookedCheckpoints(real, dies_at_paused_checkpoint)
    agent = agent_for(runtime, ScriptedModel(script, counter_path=calls), tools=tools)
    try:
        task = asyncio.ensure_future(agent.run("go", session_id="p2"))
        await gate.wait_started()
        await agent.pause("p2")
        gate.release.set()
        with pytest.raises(Crash):
            await asyncio.wait_for(task, DEADLINE_S)
    finally:
        runtime.store = real
    assert [e.kind for e in journal(real, "p2")].count("pause") == 1
    assert (await agent.get_checkpoint("p2")).execution_status == "active"

    stopped = await agent.run("go", session_id="p2")  # re-issued after the crash: the pause still holds
    assert stopped.stop_reason == "paused" and count_calls(calls) == [0]
    assert (await agent.get_checkpoint("p2")).execution_status == "paused"
    assert real.sessions.get("p2").status == "paused"
    done = await agent.resume(None, session_id="p2")
    assert done.stop_reason == "completed" and count_calls(calls) == [0, 1, 2]
    assert [e.kind for e in journal(real, "p2")].count("pause") == 1 and effects == ["slow-a", "b"]


# -- cancel -----------------------------------------------------------------------------------------------------
class WriteLog:
    """Records every PUT/DELETE of the store's object layer, and whether it came after the cancel's acknowledgment."""

    def __init__(self, store) -> None:
        self.acked = False
        self.late: list[str] = []
        objects = store.objects
        real_put, real_delete = objects.put, objects.delete

        def put(*, key, **kw):
            if self.acked:
                self.late.append(key)
            return real_put(key=key, **kw)

        def delete(*, keys):
            if self.acked:
                self.late.extend(keys)
            return real_delete(keys=keys)

        objects.put, objects.delete = put, delete  # instance attributes shadow the methods for this test


@pytest.mark.parametrize("flavour", ["async", "sync"])
async def test_cancel_during_a_long_tool_call_makes_nothing_durable_afterwards(tmp_path, runtime, flavour):
    gate = Gate()
    slow = tool(gate.async_tool() if flavour == "async" else gate.sync_tool())
    m = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "slow", "args": {"key": "b"}}, "done"],
                      counter_path=tmp_path / "c")
    agent = agent_for(runtime, m, tools=(lookup, slow), position="both", durability="async")
    writes = WriteLog(runtime.store)
    task = asyncio.ensure_future(agent.run("go", session_id="x1"))
    await gate.wait_started()
    await agent.cancel("x1")
    writes.acked = True
    acked = await agent.get_checkpoint("x1")  # what is durable when the cancel is acknowledged
    result = await asyncio.wait_for(task, DEADLINE_S)  # already returned: the cancel waited for it
    assert result.stop_reason == "cancelled" and task.done()
    if flavour == "async":
        assert gate.cancelled  # the in-flight tool's task was cancelled
    gate.release.set()
    if flavour == "sync":  # the abandoned thread finishes its work; nothing of it may reach the store
        assert await asyncio.to_thread(gate.finished.wait, DEADLINE_S)
    assert runtime.store.sessions.get("x1").status == "cancelled"
    assert writes.late == [], writes.late
    # The session stays cancelled: nothing runs, nothing is written.
    again = await agent.run("go", session_id="x1")
    assert again.stop_reason == "cancelled" and (await agent.resume(None, session_id="x1")).stop_reason == "cancelled"
    assert count_calls(tmp_path / "c") == [0, 1] and writes.late == []
    latest = await agent.get_checkpoint("x1")
    assert (latest and latest.checkpoint_id) == (acked and acked.checkpoint_id)
    with pytest.raises(LoomrayUserError, match="cancelled"):
        await agent.signal("x1", "hello?")


async def test_cancel_from_another_process_stops_its_run_and_fences_it(tmp_path):
    """A LocalRuntime run in a child process blocks in a tool; this process cancels it through the store
    (the CLI's path): the child's run returns "cancelled" while the tool is still blocked, and nothing
    durable changes afterwards, not even when the abandoned tool finishes."""
    from loomray import control
    from loomray.storage import open_store

    d = tmp_path / "data"
    d.mkdir()
    env = {**os.environ, "CRASH_POSITION": "both", "PYTHONPATH": str(REPO), "CONTROL_BLOCK_AT_PAGE": "1",
           "LOOMRAY_CANCEL_POLL_S": "0.05"}
    child = subprocess.Popen([sys.executable, str(CHILD), str(d), "sess-ctl", str(d / "out.json"), ""], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = open_store(d / "store")
    try:
        await until(lambda: (d / "started").exists() or child.poll() is not None, "the blocking tool")
        assert child.poll() is None, child.communicate()[1]
        await asyncio.to_thread(control.cancel_session, store, "sess-ctl", None, source="test")

        def durable() -> dict[str, str]:
            prefix = layout.session_prefix("sess-ctl", None)
            return {o.key: o.etag for o in store.objects.list(prefix=prefix)
                    if "/checkpoints/" in o.key or "/journal/" in o.key}

        await until(lambda: _parsed(d / "out.json") is not None or child.poll() is not None, "the child's result")
        out = _parsed(d / "out.json")
        assert out is not None and out["stop_reason"] == "cancelled", child.poll()
        snapshot = durable()
        (d / "release").write_text("go")
        _, err = await asyncio.to_thread(child.communicate, timeout=120)
        assert child.returncode == 0, err
        assert durable() == snapshot
        assert store.sessions.get("sess-ctl").status == "cancelled"
        # The abandoned tool finished its own work once released (a thread cannot be killed); the run did not
        # go on: no model call after it, nothing of it in the store.
        assert _calls(d) == [0, 1] and _effects(d) == ["ray-0", "ray-1"]
        assert control.is_cancelled(store, "sess-ctl", None)
    finally:
        if child.poll() is None:
            (d / "release").write_text("go")
            child.kill()
            child.wait()
        store.close()


async def test_control_on_an_unknown_session_is_a_user_error(runtime):
    agent = agent_for(runtime, ScriptedModel(["hi"]))
    for call in (agent.signal("nope", "x"), agent.pause("nope"), agent.cancel("nope")):
        with pytest.raises(LoomrayUserError, match="unknown session"):
            await call


async def test_a_pass_boundary_costs_one_list_of_the_control_prefix(tmp_path):
    """Per live boundary: one LIST of control/ (the docstring's promise); replayed boundaries list nothing."""
    rt = LocalRuntime(tmp_path / "store")
    lists: list[str] = []
    objects = rt.store.objects
    real = objects.list

    def counting(*, prefix):
        if "/control/" in prefix:
            lists.append(prefix)
        return real(prefix=prefix)

    objects.list = counting
    agent = agent_for(rt, ScriptedModel([{"tool": "lookup", "args": {"key": str(i)}} for i in range(3)] + ["done"]))
    assert (await agent.run("go", session_id="l1")).stop_reason == "completed"
    assert len(lists) == 4  # four passes, four boundaries
    rt.close()
