"""CLI points a newcomer trips on: relative times, every status, --store before the command, exit codes,
a confirmation before a final cancel, and a list of the calls waiting for approval."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import click
import pytest
from click.testing import CliRunner
from control_tools import lookup, reset_effects, transfer  # noqa: F401 - reset_effects is an autouse fixture

from loomray import Agent, CheckpointConfig, Tuning, control
from loomray.cli.common import CliError, guarded, parse_time
from loomray.cli.main import main
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage.errors import CorruptObjectError, InvalidIdError, StorageConfigError, TransientStorageError


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def make_agent(store_dir) -> Agent:
    script = [{"tool": "transfer", "args": {"amount": 3}}, "done"]
    return Agent("You help.", model=ScriptedModel(script), tools=[lookup, transfer], runtime=LocalRuntime(store_dir),
                 tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))


@pytest.fixture
async def world(tmp_path):
    store_dir = tmp_path / "store"
    agent = make_agent(store_dir)
    assert (await agent.run("pay", session_id="w1")).stop_reason == "awaiting_approval"
    assert (await agent.run("pay", session_id="w2", user_id="alice")).stop_reason == "awaiting_approval"
    control.cancel_session(agent.runtime.store, "w2", "alice", source="test")
    assert (await agent.run("pay", session_id="w3")).stop_reason == "awaiting_approval"
    return store_dir, agent


def test_times_may_be_spans_before_now():
    now = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)
    assert parse_time("7d", now=now) == now - timedelta(days=7)
    assert parse_time("90s", now=now) == now - timedelta(seconds=90)
    assert parse_time("2w", now=now) == now - timedelta(weeks=2)
    assert parse_time("2026-12-01", now=now) == datetime(2026, 12, 1, tzinfo=timezone.utc)
    with pytest.raises(CliError, match="30m, 12h, 7d"):
        parse_time("7 days", now=now)


async def test_query_takes_relative_times_and_session_statuses(world):
    store_dir, _ = world
    recent = json.loads(run("query", "--since", "7d", "--json", "--store", str(store_dir)).stdout)
    assert {r["session_id"] for r in recent} == {"w1", "w2", "w3"}
    assert json.loads(run("query", "--until", "7d", "--json", "--store", str(store_dir)).stdout) == []
    cancelled = run("query", "--status", "cancelled", "--json", "--store", str(store_dir))
    assert cancelled.exit_code == 0, cancelled.output
    assert {(r["user_id"], r["session_id"]) for r in json.loads(cancelled.stdout)} == {("alice", "w2")}
    assert json.loads(run("query", "--status", "failed", "--json", "--store", str(store_dir)).stdout) == []
    waiting = json.loads(run("query", "--status", "awaiting_approval", "--json", "--store", str(store_dir)).stdout)
    assert {r["session_id"] for r in waiting} >= {"w1", "w3"}


async def test_store_may_come_before_the_command_and_wins_over_the_environment(world, tmp_path):
    store_dir, _ = world
    before = run("--store", str(store_dir), "checkpoints", "w1", "--json", env={"LOOMRAY_STORE": str(tmp_path / "no")})
    assert before.exit_code == 0, before.output
    after = run("checkpoints", "w1", "--json", "--store", str(store_dir))
    assert json.loads(before.stdout) == json.loads(after.stdout) and json.loads(after.stdout)
    # given at both levels, the one after the command wins
    both = run("--store", str(tmp_path / "no"), "checkpoints", "w1", "--json", "--store", str(store_dir))
    assert both.exit_code == 0 and json.loads(both.stdout) == json.loads(after.stdout)


async def test_approvals_lists_waiting_calls_and_their_stored_decisions(world):
    store_dir, agent = world
    listed = run("approvals", "--json", "--store", str(store_dir))
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    # w2 was cancelled: it waits on nothing any more
    assert sorted((r["session_id"], r["tool"], r["arguments"]["amount"], r["decision"]) for r in rows) == [
        ("w1", "transfer", 3, None), ("w3", "transfer", 3, None)]
    call = rows[0]["call_id"]
    assert run("approve", "w1", call, "--store", str(store_dir)).exit_code == 0
    one = json.loads(run("approvals", "--session", "w1", "--json", "--store", str(store_dir)).stdout)
    assert [(r["call_id"], r["decision"]) for r in one] == [(call, "approved")]
    text = run("approvals", "--store", str(store_dir))
    assert "w3" in text.output and "transfer" in text.output and "loomray approve" in text.output
    assert (await make_agent(store_dir).resume(None, session_id="w1")).stop_reason == "completed"
    assert json.loads(run("approvals", "--session", "w1", "--json", "--store", str(store_dir)).stdout) == []
    unknown = run("approvals", "--session", "nobody", "--store", str(store_dir))
    assert unknown.exit_code == 2 and "unknown session" in unknown.output


@pytest.mark.parametrize("raised, code", [
    (TransientStorageError("s3://b/k: GET failed after retries: connection refused"), 1),
    (CorruptObjectError("s3://b/k: not JSON"), 1),
    (InvalidIdError("session_id 'a/b' may not contain '/'"), 2),
    (StorageConfigError("s3://b/k: LIST not allowed: the AWS access key id is not known"), 2),
    (KeyboardInterrupt(), 130),
])
def test_exit_codes_tell_a_typo_from_an_outage(raised, code):
    @click.command()
    @guarded
    def failing() -> None:
        raise raised

    out = CliRunner().invoke(failing, [])
    assert out.exit_code == code, out.output
    assert "Traceback" not in out.output


def test_importing_the_cli_leaves_the_environment_alone():
    import subprocess
    import sys

    code = ("import os; os.environ.pop('RAY_USAGE_STATS_ENABLED', None); import loomray.cli.main; "
            "print(os.environ.get('RAY_USAGE_STATS_ENABLED'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr
