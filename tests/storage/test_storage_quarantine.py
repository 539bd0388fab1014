"""A foreign file in an index partition: compaction moves it aside and goes on; prune finishes its table update."""

from __future__ import annotations

import io
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq

from loomray.storage import SessionRow, Store, layout
from loomray.storage.testing import T0, put_checkpoint

FOREIGN = "index/checkpoints/user=_/session=s1/0000000000000000009-cafebabe.parquet"


def _foreign_parquet() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"something": [1, 2]}), sink)
    return sink.getvalue()


def _table_rows(store: Store) -> set[tuple[str | None, str, str]]:
    """The compacted table as an outside reader gets it: every Parquet file under ``index/table/``."""
    rows: set[tuple[str | None, str, str]] = set()
    for info in store.objects.list(prefix=layout.TABLE_INDEX):
        if info.key.endswith(".parquet"):
            obj = store.objects.get(key=info.key)
            assert obj is not None
            t = pq.read_table(io.BytesIO(obj.data), columns=["user_id", "session_id", "checkpoint_id"])
            rows |= set(zip(*(t[c].to_pylist() for c in t.column_names), strict=True))
    return rows


def test_compact_moves_a_foreign_file_aside_and_brings_every_table_up_to_date(store, caplog):
    put_checkpoint(store, "s1", "c1", turn=1)
    put_checkpoint(store, "s2", "c1", turn=1, user_id="bob")
    data = _foreign_parquet()
    store.objects.put(key=FOREIGN, data=data)
    with caplog.at_level("WARNING"):
        report = store.compact()
    aside = layout.index_quarantine_key(FOREIGN)
    assert aside == "index/quarantine/checkpoints/user=_/session=s1/0000000000000000009-cafebabe.parquet"
    assert aside in caplog.text and "foreign schema" in caplog.text
    moved = store.objects.get(key=aside)
    assert moved is not None and moved.data == data  # kept, byte for byte, for whoever put it there
    assert store.objects.get(key=FOREIGN) is None
    assert report.table_users == 2
    assert _table_rows(store) == {(None, "s1", "c1"), ("bob", "s2", "c1")}

    # Later writes reach the table too: the foreign file no longer stands in the way.
    put_checkpoint(store, "s1", "c2", turn=2)
    store.compact()
    assert _table_rows(store) == {(None, "s1", "c1"), (None, "s1", "c2"), ("bob", "s2", "c1")}
    assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c2", "c1"]  # newest first
    assert store.compact().table_partitions == 0  # the partition is compact now: nothing left to rewrite


def test_a_partition_holding_only_a_foreign_file(store):
    put_checkpoint(store, "s2", "c1", turn=1)
    store.objects.put(key=FOREIGN, data=_foreign_parquet())
    store.compact()
    assert store.objects.get(key=layout.index_quarantine_key(FOREIGN)) is not None
    assert list(store.objects.list(prefix=layout.index_partition(layout.CHECKPOINT_INDEX, "s1", None))) == []
    assert _table_rows(store) == {(None, "s2", "c1")}


def test_prune_completes_its_table_update_past_a_foreign_file(store):
    for turn in (1, 2, 3):
        put_checkpoint(store, "s1", f"c{turn}", turn=turn)
    store.compact()
    store.objects.put(key=FOREIGN, data=_foreign_parquet())
    report = store.prune(before=T0 + timedelta(minutes=2, seconds=30))  # c1 and c2 are older
    assert report.checkpoints == 2
    assert _table_rows(store) == {(None, "s1", "c3")}
    assert [r.checkpoint_id for r in store.checkpoints.list("s1")] == ["c3"]


def test_a_foreign_file_among_session_status_rows(store, caplog):
    for minutes, status in ((1, "running"), (2, "completed")):
        store.sessions.put(SessionRow(session_id="s1", user_id=None, status=status,
                                     updated_at=T0 + timedelta(minutes=minutes)))
    key = "index/sessions/user=_/session=s1/0000000000000000009-cafebabe.parquet"
    store.objects.put(key=key, data=_foreign_parquet())
    with caplog.at_level("WARNING"):
        store.compact()
    assert layout.index_quarantine_key(key) in caplog.text
    assert store.objects.get(key=layout.index_quarantine_key(key)) is not None
    assert len(list(store.objects.list(prefix="index/sessions/user=_/session=s1/"))) == 1  # merged
    assert store.sessions.get("s1").status == "completed"
