"""Fault injection on S3: transient failures are retried by botocore; permanent ones surface typed."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from loomray.storage import CheckpointInfo
from loomray.storage.errors import StorageError, TransientStorageError
from loomray.storage.testing import FaultInjector, write_checkpoint

NOW = datetime(2026, 7, 4, tzinfo=timezone.utc)


@pytest.fixture
def s3(s3_server):
    store = s3_server.open_store(max_attempts=5)
    yield store
    store.close()


def _put(store, cid="c1"):
    return write_checkpoint(store, b'{"ok": true}', CheckpointInfo(session_id="s1", checkpoint_id=cid, turn=1,
                                                                created_at=NOW, position="after_tools",
                                                                execution_status="active", message_count=1))


@pytest.mark.parametrize("kind,failures", [("slowdown", 2), ("unavailable", 2), ("reset", 2), ("timeout", 2)])
def test_transient_failures_are_retried(s3, kind, failures):
    faults = FaultInjector(s3.objects.client, failures=failures, kind=kind, operations={"PutObject"})
    row = _put(s3)
    assert faults.injected == failures
    faults.remove()
    stored = s3.checkpoints.get("s1")
    assert json.loads(stored)["ok"] is True and row.size == len(stored)


def test_reads_and_lists_are_retried(s3):
    _put(s3)
    faults = FaultInjector(s3.objects.client, failures=2, kind="reset", operations={"GetObject", "ListObjectsV2"})
    assert [r.checkpoint_id for r in s3.checkpoints.list("s1")] == ["c1"]
    assert json.loads(s3.checkpoints.get("s1"))["ok"] is True
    assert faults.injected == 2


def test_permanent_transient_failure_surfaces_typed(s3_server):
    s3 = s3_server.open_store(max_attempts=3)
    faults = FaultInjector(s3.objects.client, failures=None, kind="reset", operations={"PutObject"})
    with pytest.raises(TransientStorageError, match="c1.json") as info:
        _put(s3)
    assert faults.injected == 3  # max_attempts counts every try, all of them botocore's
    assert "s3://" in str(info.value)
    faults.remove()
    assert s3.checkpoints.list("s1") == []


def test_access_denied_is_not_retried(s3):
    faults = FaultInjector(s3.objects.client, failures=None, kind="denied", operations={"PutObject"})
    with pytest.raises(StorageError) as info:
        _put(s3)
    assert not isinstance(info.value, TransientStorageError)
    assert faults.injected == 1 and "AccessDenied" in str(info.value)


def test_unreachable_endpoint_is_transient():
    from loomray.storage import open_store

    store = open_store("s3://nobucket/x", endpoint_url="http://127.0.0.1:9", key="k", secret="s",
                       max_attempts=2, connect_timeout=0.5)
    with pytest.raises(TransientStorageError, match="127.0.0.1:9"):
        store.checkpoints.get("s1")
