"""``loomray explore``, ``--resume``, and what ``tree`` and ``query`` show of an exploration, end to end.

Each command is a real ``loomray`` process (forked: ``tests/forked.py``) on a
local store; the base session was run in the test process. The result the
command prints, the tree and the query must agree on scores and spend.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from explore_agents import make_agent
from forked import run_loomray

from loomray.runtime import LocalRuntime

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
AGENT = ("--agent", "explore_cli_agent:agent")


def cli(store: Path, *args: str):
    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")}
    env.update(LOOMRAY_STORE=str(store), COLUMNS="120", PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    return run_loomray(list(args), env=env, cwd=REPO)


def ok(out):
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def explored(tmp_path_factory):
    store = tmp_path_factory.mktemp("explore-cli") / "store"
    agent = make_agent(LocalRuntime(store))
    agent.run_sync("task", session_id="base")
    agent.runtime.close()
    more = store.parent / "more.json"
    more.write_text(json.dumps([{"prompt": "variant b q=0.7 passes=2"},
                                {"prompt": "variant c q=0.4 passes=0", "tools": ["step"], "tuning": {"checkpoint": True, "max_turns": 12}}]))
    result = ok(cli(store, "explore", "base", "--variant", '{"prompt": "variant a q=0.2 passes=1"}',
                    "--variant", f"@{more}", "--judge", "explore_agents:judge", *AGENT, "--rounds", "2",
                    "--adopt", "--id", "xpl-cli", "--json"))
    return store, result


def test_explore_prints_the_result_and_adopts_the_winner(explored):
    store, result = explored
    assert result["stop_reason"] == "completed" and result["rounds_run"] == 2
    assert [b["round"] for b in result["branches"]] == [1, 1, 1, 2, 2, 2]
    winner = next(b for b in result["branches"] if b["session_id"] == result["winner"])
    assert winner["round"] == 2 and winner["score"] == 0.7 and winner["prompt"] == "variant b q=0.7 passes=2"
    latest = ok(cli(store, "checkpoints", "base", "--json"))[0]
    assert latest["checkpoint_id"] == result["adopted_checkpoint_id"]
    # A variant given as JSON may set tools (by name) and tuning; each c branch's run request carries them.
    c_branches = [b["session_id"] for b in result["branches"] if b["prompt"].startswith("variant c")]
    assert len(c_branches) == 2
    for sid in c_branches:
        runs = [json.loads(p.read_text()) for p in (store / "sessions" / "_" / sid / "runs").glob("*.json")]
        variants = [r["request"]["variant"] for r in runs if r.get("request", {}).get("variant")]
        assert variants and all(v["tuning"]["max_turns"] == 12 and v["tools"] == ["step"] for v in variants)


def test_tree_and_query_agree_with_the_result(explored):
    store, result = explored
    tree = ok(cli(store, "tree", "base", "--json"))
    nodes, todo = {}, [tree["tree"]]
    while todo:
        node = todo.pop()
        nodes[node["session_id"]] = node
        todo += node["children"]
    for b in result["branches"]:
        mark = nodes[b["session_id"]]["exploration"]
        assert mark["score"] == b["score"] and mark["stop_reason"] == b["stop_reason"]
        assert mark["winner"] == (b["session_id"] == result["winner"])
        assert nodes[b["session_id"]]["own_spend_usd"] == pytest.approx(b["spend_usd"])
    assert sum(b["spend_usd"] for b in result["branches"]) == pytest.approx(result["spend_usd"])
    page = store.parent / "tree.html"
    table = cli(store, "tree", "base", "--html", str(page))
    assert "★ 0.7" in table.stdout and "completed" in table.stdout
    assert "<dt>score</dt><dd>★ 0.7</dd>" in page.read_text()
    rows = ok(cli(store, "query", "--exploration", "xpl-cli", "--min-score", "0.5", "--json"))
    good = {b["session_id"] for b in result["branches"] if b["score"] >= 0.5}
    assert {r["session_id"] for r in rows} == good
    assert all(r["exploration_id"] == "xpl-cli" and r["score"] == 0.7 for r in rows)


def test_resume_continues_from_the_stored_plan_and_refuses_what_does_not_fit(explored):
    store, result = explored
    again = ok(cli(store, "explore", "--resume", "xpl-cli", "--judge", "explore_agents:judge", *AGENT, "--json"))
    assert again == result
    for args, says in [
        (("explore", "--resume", "xpl-cli", *AGENT), "--judge"),
        (("explore", "--resume", "xpl-nope", "--judge", "explore_agents:judge", *AGENT), "no exploration"),
        (("explore", "--resume", "xpl-cli", "--judge", "explore_agents:async_judge", *AGENT), "judge"),
        (("explore", "base", "--variant", '{"tools": ["x"]}', "--judge", "explore_agents:judge", *AGENT), "variant"),
        (("explore", "base", "--variant", "{", "--judge", "explore_agents:judge", *AGENT), "not JSON"),
        (("explore", "base", "--variant", "{}", "--judge", "explore_agents:nothing", *AGENT), "failed to load"),
        (("query", "--min-score", "1"), "--exploration"),
        (("explore", "base", "--variant", "{}", "--judge", "explore_agents:judge", *AGENT, "--submit"), "--address"),
    ]:
        out = cli(store, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert says in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
