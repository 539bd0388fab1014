"""``loomray tree`` and ``loomray timeline`` end to end, on an 80-column terminal (processes of ``loomray``,
forked from one that imported loomray: ``tests/forked.py``).

Data comes from real runs of the offline research agent on a ``LocalRuntime``:
a session with two forks and a fork of a fork (plus an unrelated fork pair
that must not show up), and a session with three incarnations: a run that
failed mid-way, its recovery by a second epoch, and a resume with a new prompt.
No Ray here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from forked import run_loomray

REPO = Path(__file__).resolve().parents[2]
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def run_cli(*args: str, store: Path, columns: int = 80, timeout: float = 90) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")}
    env.update(LOOMRAY_STORE=str(store), COLUMNS=str(columns))
    return run_loomray(list(args), env=env, cwd=REPO, timeout=timeout)


def ok_json(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


def assert_fits(text: str, width: int = 80) -> None:
    """Every line within the terminal, nothing cut with an ellipsis."""
    assert "…" not in text, text
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, (len(line), line)


class _Failing:
    """A model that fails at its ``fail_at``-th call (a provider outage mid-run)."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner, self.fail_at, self.calls = inner, fail_at, 0

    async def complete(self, request):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("model endpoint went away (injected)")
        return await self.inner.complete(request)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from loomray.cli.demo_agent import research_agent
    from loomray.runtime import LocalRuntime

    root = tmp_path_factory.mktemp("cli-views") / "store"
    runtime = LocalRuntime(root)
    agent = copy.copy(research_agent)
    agent.runtime = runtime

    def at_turn(session_id: str, turn: int):
        return next(r for r in runtime.store.checkpoints.list(session_id, limit=50) if r.turn == turn)

    agent.run_sync("Durable agents", session_id="t-root")
    base = at_turn("t-root", 5)
    a, b = (r.session_id for r in agent.fork_sync("t-root", from_checkpoint=base.checkpoint_id,
                                                  prompts=["Costs?", "Risks?"]))
    base_a = at_turn(a, 9)
    g = agent.fork_sync(a, from_checkpoint=base_a.checkpoint_id, prompts=["Deeper?"])[0].session_id
    agent.run_sync("Unrelated", session_id="t-other")
    other = agent.fork_sync("t-other", from_checkpoint=at_turn("t-other", 3).checkpoint_id, prompts=["X?"])

    bad = copy.copy(research_agent)
    bad.runtime, bad.model = runtime, _Failing(research_agent.model, 4)
    with pytest.raises(RuntimeError, match="injected"):
        bad.run_sync("Durable agents", session_id="t-crash")
    agent.resume_sync(session_id="t-crash")  # epoch 2 continues the failed run
    agent.resume_sync("Add a section on costs.", session_id="t-crash")  # epoch 3: a new run
    runtime.close()
    return {"store": root, "a": a, "b": b, "g": g, "base": base, "base_a": base_a,
            "other_fork": other[0].session_id}


# --------------------------------------------------------------------- tree


def test_tree_json_links_forks_of_forks_with_their_base_and_own_spend(world):
    store = world["store"]
    data = ok_json(run_cli("tree", "t-root", "--json", store=store))
    assert data["session_id"] == "t-root" and data["sessions"] == 4
    root = data["tree"]
    assert root["forked_from"] is None and root["parent_checkpoint_id"] is None
    kids = {c["session_id"]: c for c in root["children"]}
    assert set(kids) == {world["a"], world["b"]}  # t-other's fork is not in this tree
    assert [c["session_id"] for c in kids[world["a"]]["children"]] == [world["g"]]
    assert kids[world["b"]]["children"] == []

    a = kids[world["a"]]
    assert a["forked_from"] == "t-root" and a["parent_checkpoint_id"] == world["base"].checkpoint_id
    assert a["base_turn"] == 5 and a["turns"] == 15 and a["own_turns"] == 10 and a["status"] == "completed"
    g = a["children"][0]
    assert g["forked_from"] == world["a"] and g["parent_checkpoint_id"] == world["base_a"].checkpoint_id
    assert g["base_turn"] == 9

    # Own spend: the fork's cost minus what its base checkpoint had cost (rounded to 6 decimals in JSON).
    carried = world["base"].cost_usd
    assert a["carried_cost_usd"] == pytest.approx(carried, abs=1e-6)
    assert a["own_spend_usd"] == pytest.approx(a["cost_usd"] - carried, abs=2e-6)
    assert root["own_spend_usd"] == pytest.approx(root["cost_usd"], abs=1e-6)
    nodes = [root, *root["children"], g]
    assert data["spend_complete"] is True
    assert data["spend_usd"] == pytest.approx(sum(n["own_spend_usd"] for n in nodes), abs=1e-5)
    for n in nodes:
        assert n["own_spend_usd"] == round(n["own_spend_usd"], 6)
        assert ISO.match(n["first_checkpoint_at"]) and ISO.match(n["updated_at"])

    # A subtree: the fork's own tree names its parent.
    sub = ok_json(run_cli("tree", world["a"], "--json", store=store))
    assert sub["sessions"] == 2 and sub["tree"]["forked_from"] == "t-root"


def test_tree_table_draws_branches_and_fits_80_columns(world):
    out = run_cli("tree", "t-root", store=world["store"])
    assert out.returncode == 0, out.stderr
    assert_fits(out.stdout)
    lines = out.stdout.splitlines()
    body = [ln for ln in lines if not ln.startswith("fork tree of")]
    row = {sid: next(ln for ln in body if sid in ln) for sid in ("t-root", world["a"], world["b"], world["g"])}
    # Children in fork order (the two forks ran concurrently: either may be first); the last child closes the
    # branch, and the grandchild hangs under its parent.
    a, b = world["a"], world["b"]
    first, last = (a, b) if body.index(row[a]) < body.index(row[b]) else (b, a)
    assert ("├── " + first) in row[first] and ("└── " + last) in row[last]
    assert re.search((r"│" if first == a else " ") + r"\s+└── " + world["g"], row[world["g"]])
    assert body.index(row[a]) < body.index(row[world["g"]])
    assert "5→15" in row[world["a"]] and "9→15" in row[world["g"]]  # forked at -> now
    for _sid, line in row.items():
        assert "completed" in line and re.search(r"\$\d+\.\d{4}", line), line
    assert world["other_fork"] not in out.stdout
    assert "4 sessions, own spend $" in out.stdout
    wide = run_cli("tree", "t-root", store=world["store"], columns=160)
    assert world["base"].checkpoint_id in wide.stdout  # the parent checkpoint, when there is room


class _TreePage(HTMLParser):
    """Collects ``div.node`` elements and the ``a`` links inside each."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, dict[str, str]] = {}
        self.links: list[tuple[str, str, str]] = []  # (node id it sits in, class, href)
        self.external: list[tuple[str, str]] = []
        self.tags: set[str] = set()
        self._stack: list[str | None] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("#"):
                self.external.append((tag, a[key]))
        if tag == "div":
            is_node = "node" in (a.get("class") or "").split()
            if is_node:
                self.nodes[a["id"]] = a
            self._stack.append(a["id"] if is_node else None)
        if tag == "a":
            inside = next((n for n in reversed(self._stack) if n), None)
            self.links.append((inside, a.get("class", ""), a.get("href", "")))

    def handle_endtag(self, tag):
        if tag == "div" and self._stack:
            self._stack.pop()


def test_tree_html_is_one_self_contained_page_with_parent_to_child_links(world, tmp_path):
    page = tmp_path / "tree.html"
    out = run_cli("tree", "t-root", "--html", str(page), store=world["store"])
    assert out.returncode == 0, out.stderr
    text = page.read_text(encoding="utf-8")
    parser = _TreePage()
    parser.feed(text)
    assert text.startswith("<!DOCTYPE html>") and "style" in parser.tags
    assert parser.external == [] and not {"script", "link", "img", "iframe"} & parser.tags  # no external assets

    by_anchor = {anchor: attrs["data-session"] for anchor, attrs in parser.nodes.items()}
    expected = {"t-root", world["a"], world["b"], world["g"]}
    assert sorted(by_anchor.values()) == sorted(expected)  # one node per session
    edges = {(by_anchor[inside], by_anchor[href[1:]]) for inside, cls, href in parser.links if cls == "child"}
    assert edges == {("t-root", world["a"]), ("t-root", world["b"]), (world["a"], world["g"])}
    ups = {(by_anchor[href[1:]], by_anchor[inside]) for inside, cls, href in parser.links if cls == "parent"}
    assert ups == edges  # and each child links back to its parent
    for attrs in parser.nodes.values():
        if attrs["data-session"] != "t-root":
            assert (attrs["data-parent"], attrs["data-session"]) in edges

    both = ok_json(run_cli("tree", "t-root", "--json", "--html", str(tmp_path / "again.html"), store=world["store"]))
    assert both["html"].endswith("again.html") and (tmp_path / "again.html").exists()


def test_tree_of_an_unknown_session_is_one_line(world):
    out = run_cli("tree", "nobody", store=world["store"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown session 'nobody'" in lines[0]


# --------------------------------------------------------------------- timeline


def test_timeline_json_shows_each_incarnation_and_why(world):
    data = ok_json(run_cli("timeline", "t-crash", "--json", store=world["store"]))
    assert data["session_id"] == "t-crash" and data["current_epoch"] == 3
    one, two, three = data["incarnations"]
    assert [x["epoch"] for x in (one, two, three)] == [1, 2, 3]
    for x in (one, two, three):
        assert x["owner"] and ISO.match(x["start"]) and ISO.match(x["end"]) and x["start"] <= x["end"]
    assert one["end"] <= two["start"] <= two["end"] <= three["start"]
    run = one["runs"][0]
    assert one["status"] == "failed" and "injected" in one["outcome"] and one["cause"] == f"new run {run}"
    assert two["runs"] == [run] and f"took over run {run} from epoch 1" in two["cause"]
    assert two["status"] == "completed" and two["turns"]["last"] == 15 and two["turns"]["first"] > 1
    assert three["cause"].startswith("resumed from ckpt") and "new prompt" in three["cause"]
    assert three["runs"] != [run] and three["turns"]["last"] == 19
    assert three["outcome"] == "completed"


def test_timeline_of_a_fork_names_where_it_came_from(world):
    data = ok_json(run_cli("timeline", world["a"], "--json", store=world["store"]))
    (only,) = data["incarnations"]
    assert only["cause"] == f"forked from t-root at {world['base'].checkpoint_id}"


def test_timeline_table_fits_80_columns(world):
    out = run_cli("timeline", "t-crash", store=world["store"])
    assert out.returncode == 0, out.stderr
    assert_fits(out.stdout)
    assert "incarnations of t-crash" in out.stdout and "lease: epoch 3" in out.stdout
    body = " ".join(out.stdout.split())
    assert "took over run" in body and "failed: RuntimeError" in body
    for epoch in ("1", "2", "3"):
        assert re.search(rf"│\s+{epoch} │.*│ (\d\d:\d\d:\d\d|\d{{4}}-\d\d-\d\d \d\d:\d\d) │", out.stdout), out.stdout
    missing = run_cli("timeline", "nobody", store=world["store"])
    assert missing.returncode == 2 and "unknown session 'nobody'" in missing.stderr
