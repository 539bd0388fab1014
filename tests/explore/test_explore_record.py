"""The exploration record is a stored contract: a record written by release 1 reads back the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loomray.explore.record import ExplorationRecord, find_exploration
from loomray.explore.summary import summarize
from loomray.storage import open_store

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "exploration_v1"


@pytest.fixture
def record():
    """The fixture's objects in a fresh memory store, where an exploration of session ``base`` keeps them."""
    store = open_store("memory://exploration-fixture")
    rec = ExplorationRecord(store.objects, "base", None, "xpl-fixture")
    for path in FIXTURE.glob("*.json"):
        store.objects.put(key=rec.prefix + path.name, data=path.read_bytes())
    yield rec
    store.close()


def test_a_stored_v1_record_reads_back_as_the_exploration_it_was(record):
    docs = record.load()
    x = summarize(docs, "xpl-fixture", "base")
    stored = json.loads((FIXTURE / "result.json").read_text())
    assert (x.winner, x.stop_reason) == (stored["winner"], stored["stop_reason"])
    assert x.spend_usd == pytest.approx(stored["spend_usd"]) and x.saved_usd == pytest.approx(stored["saved_usd"])
    assert x.rounds_run == 2 and x.adopted_checkpoint_id == docs["adopt"]["checkpoint_id"]
    # Successive halving over three rungs: 4 -> 2 -> 1 in each round.
    assert [b.stop_reason for b in x.branches if b.round == 1] == [
        "early_stopped", "completed", "early_stopped", "early_stopped"]
    assert [b.score for b in x.branches if b.round == 2] == [0.1, 0.9, 0.3, 0.7]
    assert x.branch("xpl-fixture-r2-003").interim == [(2, 0.7), (4, 0.7)]
    assert x.branches[0].variant.prompt == "variant a q=0.1 passes=6"


def test_a_decision_is_taken_once_and_a_newer_record_is_refused(record):
    kept = record.get("r001-keep")
    assert record.put("r001-keep", {"kept": ["someone-else"]}) == kept  # the first writer's decision stands
    record.objects.put(key=record.prefix + "r009-keep.json", data=json.dumps({"v": 2, "kept": []}).encode())
    with pytest.raises(ValueError, match="newer"):
        record.load()
    assert find_exploration(record.objects, "xpl-fixture", None) is None  # no pointer: the id alone finds nothing


def test_a_variant_reads_back_from_its_record_with_its_tool_names_and_tuning():
    """What a continued exploration (``--resume``, a supervisor's) and the tree rebuild from the store."""
    from loomray import Tuning, Variant
    from loomray.explore.record import variant_doc, variant_from_doc

    given = Variant(prompt="p", model="m", tools=["step", "look"], tuning=Tuning(checkpoint=True, max_turns=7))
    doc = json.loads(json.dumps(variant_doc(given)))
    assert doc["tools"] == ["look", "step"]  # names as given, never the type of a name ("str")
    again = variant_from_doc(doc)
    assert again.tuning == given.tuning and sorted(again.tools) == ["look", "step"] and again.model == "m"
    assert variant_doc(again) == doc
