"""The index is plain hive-partitioned Parquet: pyarrow, DuckDB and s3fs read it without loomray."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow.dataset as ds
import pytest

from loomray.storage import CheckpointInfo, open_store
from loomray.storage.testing import write_checkpoint

NOW = datetime(2026, 7, 4, tzinfo=timezone.utc)


def _fill(store):
    for user in (None, "alice"):
        for i in range(3):
            write_checkpoint(store, b"{}", CheckpointInfo(session_id="sess-a", checkpoint_id=f"c{i}", user_id=user,
                                                       turn=i, created_at=NOW, position="after_tools",
                                                       execution_status="active", message_count=i,
                                                       cost_usd=0.25 * i), keep=2)


def _live_count(table) -> int:
    rows = table.to_pylist()
    dead = {(r["user_id"], r["checkpoint_id"]) for r in rows if r["tombstone"]}
    return sum(1 for r in rows if not r["tombstone"] and (r["user_id"], r["checkpoint_id"]) not in dead)


def test_pyarrow_and_duckdb_read_the_local_index(tmp_path):
    store = open_store(tmp_path / "root")
    _fill(store)
    fs, root = store.fsspec()
    data = ds.dataset(f"{root}/index/checkpoints", format="parquet", partitioning="hive").to_table()
    assert set(data["user"].to_pylist()) == {"_", "alice"} and set(data["session"].to_pylist()) == {"sess-a"}
    assert _live_count(data) == 4 == store.query().num_rows
    duckdb = pytest.importorskip("duckdb")
    n = duckdb.sql(
        f"select count(*) from read_parquet('{root}/index/checkpoints/*/*/*.parquet', hive_partitioning=true) "
        "where user = 'alice' and not tombstone").fetchall()[0][0]
    assert n == 3  # two live + one retired by a tombstone row (readers apply tombstones themselves)
    store.compact()
    n = duckdb.sql(f"select count(*) from read_parquet('{root}/index/checkpoints/*/*/*.parquet', "
                   "hive_partitioning=true) where user = 'alice' and not tombstone").fetchall()[0][0]
    assert n == 2  # the retired row is gone; its young tombstone stays for the grace period
    store.compact(tombstone_grace=timedelta(0))  # the only compactor: tombstones may go at once
    n = duckdb.sql(f"select count(*) from read_parquet('{root}/index/checkpoints/*/*/*.parquet', "
                   "hive_partitioning=true) where user = 'alice'").fetchall()[0][0]
    assert n == 2  # after compaction the files hold only live rows


def test_pyarrow_reads_the_index_straight_from_the_bucket(s3_server):
    store = s3_server.open_store()
    _fill(store)
    store.compact(tombstone_grace=timedelta(0))  # the only compactor: tombstones go at once
    fs, root = store.fsspec()
    data = ds.dataset(f"{root}/index/checkpoints", filesystem=fs, format="parquet", partitioning="hive").to_table()
    assert data.num_rows == 4 and not any(data["tombstone"].to_pylist())
    assert sorted(data.filter(ds.field("user") == "alice")["checkpoint_id"].to_pylist()) == ["c1", "c2"]
    assert fs.cat(f"{root}/sessions/alice/sess-a/checkpoints/c2.json") == store.checkpoints.get("sess-a", "c2",
                                                                                              user_id="alice")


def test_polars_reads_the_index_straight_from_the_bucket(s3_server):
    pl = pytest.importorskip("polars")
    store = s3_server.open_store()
    _fill(store)
    store.compact(tombstone_grace=timedelta(0))  # the only compactor: tombstones go at once
    bucket = store.url.split("/")[2]
    frame = pl.scan_parquet(
        f"s3://{bucket}/root/index/checkpoints/**/*.parquet", hive_partitioning=True,
        storage_options={"aws_endpoint_url": s3_server.endpoint_url, "aws_access_key_id": "testing",
                         "aws_secret_access_key": "testing", "aws_region": "us-east-1", "aws_allow_http": "true"},
    ).filter(pl.col("user") == "alice").collect()
    assert sorted(frame["checkpoint_id"].to_list()) == ["c1", "c2"]


def test_duckdb_queries_the_bucket_through_arrow(s3_server):
    # DuckDB's own S3 reader (httpfs) is an extension it downloads; over an Arrow dataset it needs nothing more.
    duckdb = pytest.importorskip("duckdb")
    store = s3_server.open_store()
    _fill(store)
    fs, root = store.fsspec()
    index = ds.dataset(f"{root}/index/checkpoints", filesystem=fs, format="parquet", partitioning="hive")
    con = duckdb.connect()
    con.register("idx", index)
    rows = con.execute("select checkpoint_id, cost_usd from idx where user = 'alice' and not tombstone "
                       "order by checkpoint_id").fetchall()
    assert [r[0] for r in rows] == ["c0", "c1", "c2"] and rows[2][1] == 0.5
