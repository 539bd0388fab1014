"""Active-session marks (the supervisor's worklist), on every backend."""

import pytest

from loomray.storage.errors import InvalidIdError


def test_active_marks_round_trip(store):
    assert store.active.list() == []
    store.active.put("s1", data=b'{"placement": "dense"}')
    store.active.put("s.json", user_id="alice")  # ids with dots survive the key's suffix
    store.active.put("s1", data=b'{"placement": "actor"}')  # overwrites
    assert sorted(store.active.list(), key=str) == sorted([(None, "s1"), ("alice", "s.json")], key=str)
    assert store.active.get("s1") == b'{"placement": "actor"}'
    assert store.active.get("s1", user_id="alice") is None  # another user's session is another mark
    store.active.delete("s1")
    store.active.delete("s1")  # absent is fine
    assert store.active.list() == [("alice", "s.json")]
    # Marks are not sessions: the session index and checkpoints know nothing of them.
    assert store.sessions.list() == [] and store.checkpoints.list("s.json", user_id="alice") == []


def test_active_marks_refuse_bad_ids(store):
    with pytest.raises(InvalidIdError):
        store.active.put("../escape")
    with pytest.raises(InvalidIdError):
        store.active.put("s1", user_id="_")
