"""The command line on an 80-column terminal, and what scripts read from it.

Tables fit 80 columns without cutting a status, a time or an id ("…" never
appears); ``--json`` times are ISO 8601 with the "T" and a zone, dollars are
rounded to 6 decimals (and shown as ``$0.2218`` in tables); ``prune`` has
``--dry-run`` and asks before deleting (on a terminal; elsewhere it needs
``--yes``); ``query``/``prune``/``compact`` report progress on stderr only on a
terminal or with ``--progress``. Processes of ``loomray`` (forked from one that imported loomray,
``tests/forked.py``; the terminal tests run the console script on a pty); no Ray.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from forked import run_loomray

REPO = Path(__file__).resolve().parents[2]
LOOMRAY = Path(sys.executable).with_name("loomray")
CMD = [str(LOOMRAY)] if LOOMRAY.exists() else [sys.executable, "-m", "loomray.cli"]
TURNS = 15
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")
CELL_TIME = r"(\d\d:\d\d:\d\d|\d{4}-\d\d-\d\d \d\d:\d\d)"


def _env(store: Path, columns: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")}
    env.update(LOOMRAY_STORE=str(store), COLUMNS=str(columns))
    return env


def run_cli(*args: str, store: Path, columns: int = 80, timeout: float = 90) -> subprocess.CompletedProcess:
    """``loomray ARGS`` in a process of its own, forked from one that imported loomray (``tests/forked.py``);
    the terminal tests below run the console script on a pty."""
    return run_loomray(list(args), env=_env(store, columns), cwd=REPO, timeout=timeout)


def ok(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return out.stdout


def ok_json(out: subprocess.CompletedProcess):
    return json.loads(ok(out))


def assert_fits(text: str, width: int = 80) -> None:
    assert "…" not in text, text
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, (len(line), line)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """s-one and s-two (no user), s-one of user alice, and two forks of s-one (30-character sess... ids)."""
    from loomray.cli.demo_agent import research_agent
    from loomray.runtime import LocalRuntime

    root = tmp_path_factory.mktemp("cli-columns") / "store"
    agent = copy.copy(research_agent)
    agent.runtime = LocalRuntime(root)
    agent.run_sync("Durable agents", session_id="s-one")
    agent.run_sync("Parquet indexes", session_id="s-two")
    agent.run_sync("Leases", session_id="s-one", user_id="alice")
    base = next(r for r in agent.runtime.store.checkpoints.list("s-one", limit=50) if r.turn == 5)
    agent.fork_sync("s-one", from_checkpoint=base.checkpoint_id, prompts=["Costs?", "Risks?"])
    agent.runtime.close()
    return root


def _sessions(store: Path) -> list[dict]:
    return ok_json(run_cli("status", "--json", store=store))["sessions"]


# --------------------------------------------------------------------- tables at 80 columns


def test_status_fits_80_columns_with_whole_ids_statuses_and_times(store):
    sessions = _sessions(store)
    assert len(sessions) == 5 and any(len(s["session_id"]) == 30 for s in sessions)
    out = ok(run_cli("status", store=store))
    assert_fits(out)
    for s in sessions:
        line = next(ln for ln in out.splitlines() if f" {s['session_id']} " in ln)
        assert re.search(rf"│ completed +│.*│ {CELL_TIME} +│", line), line
    assert "alice" in out  # a user column, since one session has a user


def test_checkpoints_and_default_query_fit_80_columns(store):
    rows = ok_json(run_cli("checkpoints", "s-one", "--json", store=store))
    out = ok(run_cli("checkpoints", "s-one", store=store))
    assert_fits(out)
    for r in rows:
        assert re.search(rf"│ {r['checkpoint_id']} │ +{r['turn']} │ {r['execution_status']} +│ {CELL_TIME} │", out)
    assert "$0." in out

    # Many sessions: the default view is session, checkpoint, turn, status, time and cost; never 20 cut columns.
    everything = ok_json(run_cli("query", "--limit", "1000", "--json", store=store))
    out = ok(run_cli("query", "--limit", "1000", store=store))
    assert_fits(out)
    assert f"{len(everything)} rows" in out and "cost_usd" not in out and "sha256" not in out
    for r in everything:
        assert r["checkpoint_id"] in out and r["session_id"] in out
    assert len(re.findall(r"\bcompleted\b", out)) == 5 and re.search(CELL_TIME, out)

    one = ok(run_cli("query", "--session", "s-two", store=store))
    assert_fits(one)
    assert f"{TURNS} rows of session s-two" in one and re.search(r"\$\d\.\d{4}", one)
    picked = ok(run_cli("query", "--session", "s-two", "--columns", "turn,cost_usd,epoch", store=store))
    assert_fits(picked)
    assert "turn" in picked and "cost_usd" in picked and "checkpoint" not in picked
    bad = run_cli("query", "--columns", "turn,nope", store=store)
    assert bad.returncode == 2 and "unknown column(s) nope" in bad.stderr and "cost_usd" in bad.stderr


def test_a_wide_sql_result_is_shown_row_by_row_not_cut(store):
    sql = "select * from checkpoints where session_id = 's-two' order by turn limit 2"
    rows = ok_json(run_cli("query", sql, "--json", store=store))
    out = ok(run_cli("query", sql, store=store))
    assert_fits(out)
    assert "-[ row 1 ]" in out and "-[ row 2 ]" in out
    for r in rows:
        assert r["checkpoint_id"] in out
    narrow = ok(run_cli("query", "select session_id, sum(cost_usd) as total_cost from checkpoints group by 1 "
                                 "order by 1", store=store))
    assert_fits(narrow)
    assert "total_cost ┃" in narrow
    assert re.search(r"│ s-one +│ +\$\d+\.\d{4} │", narrow)  # money, not 0.22175700000000004


def test_fork_prints_new_session_ids_whole(store, tmp_path):
    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    before = {s["session_id"] for s in _sessions(mine)}
    base = ok_json(run_cli("checkpoints", "s-two", "--json", store=mine))[-3]
    long_prompt = "Add a long section on the costs of running many agents, with numbers and a table. " * 2
    out = ok(run_cli("fork", "s-two", "--from", base["checkpoint_id"], "--agent", "loomray.cli.demo_agent:research_agent",
                     "--prompt", long_prompt, "--prompt", "Risks?", store=mine, timeout=120))
    assert_fits(out)
    new = {s["session_id"] for s in _sessions(mine)} - before
    assert len(new) == 2
    for sid in new:
        assert re.search(rf"│ {sid} │", out), out  # whole, on one line, in its own cell


# --------------------------------------------------------------------- JSON times and money


def test_json_times_are_iso_8601_with_T_and_zone_and_money_is_rounded(store):
    for r in ok_json(run_cli("checkpoints", "s-one", "--json", store=store)):
        assert ISO.match(r["created_at"]), r["created_at"]
        assert r["cost_usd"] == round(r["cost_usd"], 6)
    for s in _sessions(store):
        assert ISO.match(s["updated_at"]), s["updated_at"]
    for r in ok_json(run_cli("query", "--limit", "1000", "--json", store=store)):
        assert ISO.match(r["created_at"]) and r["cost_usd"] == round(r["cost_usd"], 6)
    total = ok_json(run_cli("query", "select sum(cost_usd) as total_cost, max(created_at) as last from checkpoints",
                            "--json", store=store))[0]
    assert total["total_cost"] == round(total["total_cost"], 6) and len(repr(total["total_cost"]).split(".")[1]) <= 6
    assert ISO.match(total["last"])


def test_emit_json_and_money_formatting(capsys):
    from loomray.cli.output import emit_json, money, time_cells

    emit_json({"at": datetime(2026, 5, 1, 12, 0, 0), "cost_usd": 0.22175700000000004,
               "rows": [{"own_spend_usd": 1 / 3, "turn": 1.123456789}], "sum(cost_usd)": 2.0000000001})
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"at": "2026-05-01T12:00:00+00:00", "cost_usd": 0.221757,
                   "rows": [{"own_spend_usd": 0.333333, "turn": 1.123456789}], "sum(cost_usd)": 2.0}
    assert money(0.22175700000000004) == "$0.2218" and money(None) == "-" and money(0.0) == "$0.0000"
    assert money(0.00001) == "<$0.0001" and money(12.5) == "$12.5000"
    now = datetime(2026, 5, 1, 18, 0, tzinfo=timezone.utc)
    assert time_cells([datetime(2026, 5, 1, 9, 5, 7, tzinfo=timezone.utc), None], now) == ["09:05:07", "-"]
    assert time_cells([datetime(2026, 4, 30, 9, 5, 7, tzinfo=timezone.utc)], now) == ["2026-04-30 09:05"]


# --------------------------------------------------------------------- prune: --dry-run, --yes, asking


def test_prune_dry_run_lists_exactly_what_prune_then_deletes(store, tmp_path):
    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    files = sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file())

    plan = ok_json(run_cli("prune", "--session", "s-two", "--dry-run", "--json", store=mine))
    assert plan["dry_run"] is True and plan["checkpoints"] == TURNS and plan["journal_entries"] > 0
    (entry,) = [s for s in plan["sessions"] if s["checkpoints"]]
    listed = {r["checkpoint_id"] for r in ok_json(run_cli("checkpoints", "s-two", "--json", store=mine))}
    assert entry["session_id"] == "s-two" and set(entry["checkpoint_ids"]) == listed
    text = ok(run_cli("prune", "--session", "s-two", "--dry-run", store=mine))
    assert_fits(text)
    assert "nothing deleted" in text and all(cid in text for cid in listed)
    assert sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file()) == files  # nothing touched

    done = ok_json(run_cli("prune", "--session", "s-two", "--yes", "--json", store=mine))
    assert {k: done[k] for k in ("checkpoints", "journal_entries", "run_records")} == \
        {k: plan[k] for k in ("checkpoints", "journal_entries", "run_records")}

    # With a cutoff (everything older than far in the future), across every session and user.
    cutoff = "2999-01-01T00:00:00Z"
    left = ok_json(run_cli("query", "--json", "--limit", "1000", store=mine))
    assert len({(r["user_id"], r["session_id"]) for r in left}) == 4
    plan = ok_json(run_cli("prune", "--before", cutoff, "--dry-run", "--json", store=mine))
    assert plan["before"] == "2999-01-01T00:00:00+00:00" and plan["checkpoints"] == len(left)
    done = ok_json(run_cli("prune", "--before", cutoff, "--yes", "--json", store=mine))
    assert {k: done[k] for k in ("checkpoints", "journal_entries", "run_records")} == \
        {k: plan[k] for k in ("checkpoints", "journal_entries", "run_records")}
    empty = ok(run_cli("prune", "--before", cutoff, "--dry-run", store=mine))
    assert "nothing matches" in empty


def _on_a_terminal(args: list[str], store: Path, answer: str | None) -> tuple[int, str]:
    """Run ``loomray ARGS`` with a pseudo-terminal as stdin/stdout/stderr, answering its question."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen([*CMD, *args], stdin=slave, stdout=slave, stderr=slave, env=_env(store, 80), cwd=REPO,
                            close_fds=True)
    os.close(slave)
    out, sent = b"", False
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], deadline - time.monotonic())
            if not ready:
                continue
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the command exited and closed the terminal
                break
            if not chunk:
                break
            out += chunk
            if answer is not None and not sent and b"[y/N]" in out:
                os.write(master, answer.encode() + b"\n")
                sent = True
        return proc.wait(timeout=30), out.decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_prune_asks_on_a_terminal_and_refuses_without_one(store, tmp_path):
    mine = tmp_path / "store"
    shutil.copytree(store, mine)

    def count() -> int:
        return len(ok_json(run_cli("checkpoints", "s-two", "--json", store=mine)))

    refused = run_cli("prune", "--session", "s-two", store=mine)  # stdin is a pipe: nobody to ask
    assert refused.returncode == 2 and "not a terminal" in refused.stderr and "--yes" in refused.stderr
    assert count() == TURNS

    rc, text = _on_a_terminal(["prune", "--session", "s-two"], mine, "n")
    assert rc == 1 and "prune would delete 15 checkpoints" in text and "nothing deleted" in text, text
    assert count() == TURNS

    rc, text = _on_a_terminal(["prune", "--session", "s-two"], mine, "y")
    assert rc == 0 and "pruned 15 checkpoints" in text, text
    assert count() == 0


def test_progress_goes_to_stderr_only_on_a_terminal_or_with_progress(store, tmp_path):
    mine = tmp_path / "store"
    shutil.copytree(store, mine)
    quiet = run_cli("compact", "--json", store=mine)
    assert json.loads(ok(quiet))["files_after"] > 0 and quiet.stderr == ""
    loud = run_cli("compact", "--json", "--progress", store=mine)
    assert json.loads(ok(loud))["files_before"] > 0
    assert "compact: listing index files" in loud.stderr and "compact: done in" in loud.stderr

    quiet = run_cli("query", "--json", "--limit", "1", store=mine)
    assert len(json.loads(ok(quiet))) == 1 and quiet.stderr == ""
    rows = len(ok_json(run_cli("query", "--json", "--limit", "1000", store=mine)))
    loud = run_cli("query", "select count(*) as n from checkpoints", "--json", "--progress", store=mine)
    assert json.loads(ok(loud)) == [{"n": rows}]
    assert "query: reading the checkpoint index" in loud.stderr and "query: running SQL" in loud.stderr

    loud = run_cli("prune", "--before", "2000-01-01T00:00:00Z", "--dry-run", "--json", "--progress", store=mine)
    assert json.loads(ok(loud))["checkpoints"] == 0
    assert "prune --dry-run: session 1/5" in loud.stderr and "prune --dry-run: session 5/5" in loud.stderr
    loud = run_cli("prune", "--before", "2000-01-01T00:00:00Z", "--yes", "--json", "--progress", store=mine)
    assert json.loads(ok(loud))["checkpoints"] == 0 and "prune: done in" in loud.stderr
