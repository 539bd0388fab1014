"""Bad input: a clear typed error, nothing written, nothing outside the root."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

import pytest

from loomray.storage import CheckpointInfo, InvalidStoreUrl, JournalEntry, SessionRow, open_store
from loomray.storage.errors import InvalidIdError
from loomray.storage.testing import write_checkpoint

BAD_IDS = ["a/b", "../x", "..", "a\\b", "x\x00y", "tab\there", "new\nline", "\x7f", "", "x" * 129, "a..b", "/abs"]
NOW = datetime(2026, 7, 4, tzinfo=timezone.utc)


def _put(store, **ids):
    args = {"session_id": "s1", "checkpoint_id": "c1", "user_id": None, **ids}
    return write_checkpoint(store, b"{}", CheckpointInfo(turn=0, created_at=NOW, position="after_tools",
                                                      execution_status="active", message_count=0, **args))


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("field", ["session_id", "checkpoint_id", "user_id"])
def test_bad_ids_on_put_write_nothing(store, field, bad):
    with pytest.raises(InvalidIdError) as info:
        _put(store, **{field: bad})
    assert isinstance(info.value, ValueError)
    assert list(store.objects.list(prefix="")) == []


@pytest.mark.parametrize("bad", BAD_IDS)
def test_bad_ids_everywhere(store, bad):
    calls = [
        lambda: store.checkpoints.get(bad),
        lambda: store.checkpoints.get("s1", bad),
        lambda: store.checkpoints.get("s1", user_id=bad),
        lambda: store.checkpoints.list(bad),
        lambda: store.checkpoints.delete("s1", bad),
        lambda: store.leases.acquire(bad, owner="x"),
        lambda: store.leases.current_epoch("s1", user_id=bad),
        lambda: store.journal.append(JournalEntry(session_id="s1", run_id=bad, seq=0, step_key="k", kind="model")),
        lambda: store.journal.append(JournalEntry(session_id="s1", run_id="r", seq=0, step_key=bad, kind="model")),
        lambda: store.journal.list("s1", bad),
        lambda: store.sessions.put(SessionRow(bad, None, "running", NOW)),
        lambda: store.query(user_id=bad),
        lambda: store.prune(session_id=bad),
    ]
    for call in calls:
        with pytest.raises(InvalidIdError):
            call()
    assert list(store.objects.list(prefix="")) == []


def test_underscore_user_is_reserved(store):
    with pytest.raises(InvalidIdError, match="reserved"):
        _put(store, user_id="_")


def test_max_length_id_is_fine(store):
    long_id = "s" * 128
    _put(store, session_id=long_id, checkpoint_id="c" * 128, user_id="u" * 128)
    assert json.loads(store.checkpoints.get(long_id, user_id="u" * 128))["index"]["checkpoint_id"] == "c" * 128


def test_nothing_written_outside_the_local_root(tmp_path):
    root = tmp_path / "root"
    store = open_store(root)
    for bad in BAD_IDS:
        for field in ("session_id", "checkpoint_id", "user_id"):
            with pytest.raises(InvalidIdError):
                _put(store, **{field: bad})
    _put(store)
    assert sorted(os.listdir(tmp_path)) == ["root"]
    assert sorted(os.listdir(root)) == ["index", "sessions"]
    # No temporary left behind (they are written next to their targets, named %tmp-...).
    assert [p for p in root.rglob("*") if "%tmp" in p.name] == []


def test_bad_store_urls():
    for url in ("ftp://x/y", "gs://bucket", "", "s3://ab"):
        with pytest.raises(InvalidStoreUrl):
            open_store(url)
    with pytest.raises(InvalidStoreUrl, match="endpoint_url"):
        open_store("memory://", endpoint_url="http://127.0.0.1:1")


def test_file_url_and_path_are_the_same_store(tmp_path):
    a = open_store(tmp_path / "d")
    _put(a)
    b = open_store(f"file://{tmp_path / 'd'}")
    assert b.checkpoints.get("s1") == a.checkpoints.get("s1") is not None and a.url == b.url


def test_s3_from_environment(s3_store_url):
    """No options: endpoint and credentials come from the usual AWS environment variables."""
    store = open_store(s3_store_url)
    _put(store)
    assert json.loads(store.checkpoints.get("s1"))["index"]["session_id"] == "s1"
    assert "s3://" in store.describe()


def test_local_temporaries_are_never_listed_nor_named(tmp_path):
    from loomray.storage.errors import StorageError
    from loomray.storage.localdir import LocalObjectStore

    objects = LocalObjectStore(tmp_path)
    objects.put(key="sessions/_/s1/a.json", data=b"1")
    # What a writer killed between writing its temporary and publishing it leaves next to the target.
    (tmp_path / "sessions" / "_" / "s1" / "%tmp-0123").write_bytes(b"half")
    assert [o.key for o in objects.list(prefix="sessions/")] == ["sessions/_/s1/a.json"]
    with pytest.raises(StorageError, match="outside the root"):
        objects.put(key="sessions/_/s1/%tmp-0123", data=b"x")
    assert (tmp_path / "sessions" / "_" / "s1" / "%tmp-0123").read_bytes() == b"half"


@pytest.mark.parametrize("unnamed", [True, False], ids=["unnamed-temporaries", "named-temporaries"])
def test_local_puts_mean_the_same_with_or_without_unnamed_temporaries(tmp_path, monkeypatch, unnamed):
    """A put through an unnamed file linked in place (Linux) and one through a named temporary (elsewhere, or a
    plain put over an existing file) publish whole files with the same preconditions and leave nothing else."""
    from loomray.storage import localdir
    from loomray.storage.errors import PreconditionFailed

    if unnamed and not localdir._UNNAMED["ok"]:
        pytest.skip("no unnamed temporaries on this system")
    monkeypatch.setitem(localdir._UNNAMED, "ok", unnamed)
    objects = localdir.LocalObjectStore(tmp_path)
    first = objects.put(key="a/b/c.json", data=b"one", if_none_match=True)  # its directories are made on the way
    with pytest.raises(PreconditionFailed):
        objects.put(key="a/b/c.json", data=b"two", if_none_match=True)
    assert (objects.get(key="a/b/c.json").data, objects.get(key="a/b/c.json").etag) == (b"one", first)
    second = objects.put(key="a/b/c.json", data=b"three")  # a plain put replaces
    assert second != first and objects.get(key="a/b/c.json").data == b"three"
    objects.put(key="a/b/d.json", data=b"four")
    with pytest.raises(PreconditionFailed):
        objects.put(key="a/b/c.json", data=b"x", if_match=first)
    objects.put(key="a/b/c.json", data=b"five", if_match=second)
    assert [(o.key, objects.get(key=o.key).data) for o in objects.list(prefix="a/")] == [
        ("a/b/c.json", b"five"), ("a/b/d.json", b"four")]
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == ["c.json", "d.json"]  # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "a" / "b" / "d.json").stat().st_mode & 0o777 == 0o666 & ~umask
    assert localdir._UNNAMED["ok"] is unnamed  # the unnamed path did not turn itself off on this system
