"""Persisted records are a contract: the committed 1.0 fixture loads, bad data raises CheckpointException."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from loomray import Checkpoint, CheckpointException, Message, Usage, new_id

FIXTURE = Path(__file__).parent.parent / "fixtures" / "checkpoint_v1_0.json"


def test_v1_0_fixture_loads_exactly():
    data = json.loads(FIXTURE.read_text())
    ckpt = Checkpoint.from_dict(data)
    assert ckpt.schema_version == "1.0"
    assert ckpt.session_id == "research-2026-07-04"
    assert ckpt.user_id == "alice"
    assert ckpt.turn == 2 and ckpt.message_count == 6 == len(ckpt.messages)
    assert ckpt.messages[1].content.endswith("überblick")
    assert ckpt.messages[2].tool_calls[0].arguments == {"query": "durable agents"}
    assert ckpt.messages[5].is_error is True
    assert ckpt.cumulative_usage == Usage(input_tokens=1200, output_tokens=85, requests=2, cost_usd=0.0049)
    assert ckpt.created_at.tzinfo is not None
    # Round trip: what we write back is what we read.
    assert Checkpoint.from_json(ckpt.to_json_bytes()) == ckpt
    assert ckpt.to_dict() == json.loads(ckpt.to_json_bytes())


def test_unknown_schema_version_raises():
    data = json.loads(FIXTURE.read_text())
    data["schema_version"] = "9.9"
    with pytest.raises(CheckpointException, match="9.9"):
        Checkpoint.from_dict(data)


@pytest.mark.parametrize("mutate", [
    lambda d: d.pop("session_id"),
    lambda d: d.__setitem__("turn", -1),
    lambda d: d.__setitem__("message_count", 99),
    lambda d: d["messages"][0].__setitem__("role", "wizard"),
])
def test_invalid_checkpoint_data_raises(mutate):
    data = json.loads(FIXTURE.read_text())
    mutate(data)
    with pytest.raises(CheckpointException):
        Checkpoint.from_dict(data)


def test_truncated_json_raises():
    raw = FIXTURE.read_bytes()
    with pytest.raises(CheckpointException, match="corrupt or truncated"):
        Checkpoint.from_json(raw[: len(raw) // 2])
    with pytest.raises(CheckpointException):
        Checkpoint.from_dict(["not", "a", "dict"])


def test_checkpoint_is_frozen_and_ids_sort_by_time():
    ckpt = Checkpoint(session_id="s", turn=0, messages=[Message(role="user", content="x")])
    with pytest.raises(ValidationError):
        ckpt.turn = 3  # type: ignore[misc]
    ids = [new_id("ckpt") for _ in range(200)]
    assert ids == sorted(ids) and len(set(ids)) == 200 and all(i.startswith("ckpt") for i in ids)


def test_usage_adds_and_unknown_cost_stays_unknown():
    a = Usage(input_tokens=1, output_tokens=2, requests=1, cost_usd=0.5)
    b = Usage(input_tokens=10, output_tokens=20, requests=1, cost_usd=None)
    assert (a + a).cost_usd == 1.0 and (a + a).requests == 2
    assert (a + b).cost_usd is None and (a + b).input_tokens == 11
