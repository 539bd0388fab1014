"""The session page's fork tree shows what an exploration decided: each branch's score and stop, the winner,
and what each branch's variant changed."""

from __future__ import annotations

import html

import pytest

from loomray import Agent, Score, Tuning, Variant
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.ui.server import build_app

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402


def test_the_fork_tree_shows_scores_stops_the_winner_and_variants(tmp_path):
    root = tmp_path / "store"
    agent = Agent("Write a title.", model=ScriptedModel([lambda r: r.messages[-1].content.upper()] * 4),
                  runtime=LocalRuntime(root), tuning=Tuning(checkpoint=True))
    agent.run_sync("draft", session_id="titles")
    variants = [Variant(prompt="short"), Variant(prompt="a longer one", instructions="Shout.")]
    result = agent.explore_sync("titles", variants=variants,
                                judge=lambda b: Score(len(b.result.output), "longer is better"))
    loser, winner = (b.session_id for b in result.branches)
    assert result.winner == winner

    page = TestClient(build_app(str(root)), base_url="http://127.0.0.1").get("/session/titles")
    assert page.status_code == 200
    tree = html.unescape(page.text.split('id="fork-tree"', 1)[1].split("</ul>\n", 1)[0])
    assert "score ★ 12 · completed · winner" in tree and "score 5 · completed" in tree
    items = {sid: item for item in tree.split("<li>") for sid in (loser, winner) if f">{sid}</a>" in item}
    assert "score 5 · completed" in items[loser] and "winner" not in items[loser]
    assert "score ★ 12 · completed · winner" in items[winner]
    assert "variant:" in tree and "Shout." in tree
