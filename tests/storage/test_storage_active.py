"""Active-session marks (the supervisor's worklist), on every backend."""

import pytest

from storage.errors import InvalidIdError


def test_active_marks_round_trip(store):
    assert store.list_active() == []
    store.put_active("s1", data=b'{"placement": "dense"}')
    store.put_active("s.json", user_id="alice")  # ids with dots survive the key's suffix
    store.put_active("s1", data=b'{"placement": "actor"}')  # overwrites
    assert sorted(store.list_active(), key=str) == sorted([(None, "s1"), ("alice", "s.json")], key=str)
    assert store.get_active("s1") == b'{"placement": "actor"}'
    assert store.get_active("s1", user_id="alice") is None  # another user's session is another mark
    store.delete_active("s1")
    store.delete_active("s1")  # absent is fine
    assert store.list_active() == [("alice", "s.json")]
    # Marks are not sessions: the session index and checkpoints know nothing of them.
    assert store.list_sessions() == [] and store.list_checkpoints("s.json", user_id="alice") == []


def test_active_marks_refuse_bad_ids(store):
    with pytest.raises(InvalidIdError):
        store.put_active("../escape")
    with pytest.raises(InvalidIdError):
        store.put_active("s1", user_id="_")
