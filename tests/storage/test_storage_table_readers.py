"""The reader commands of docs/readers.md, run against the moto S3 bucket: DuckDB, polars and pyarrow read the
compacted table straight from the bucket, prune by user and day, and see retention and prune applied."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pyarrow.dataset as ds
import pytest
from pyarrow import fs as pafs

from loomray.storage import CheckpointInfo
from loomray.storage.testing import write_checkpoint

DAYS = (1, 2, 3)
CUTOFF = "2026-12-02"


def _fill(store) -> None:
    """Two users, one session a day for three days, two checkpoints each (retention keeps both)."""
    for user in (None, "alice"):
        for day in DAYS:
            for n in (1, 2):
                write_checkpoint(store, b"{}", CheckpointInfo(
                    session_id=f"s{day}", checkpoint_id=f"c{day}-{n}", user_id=user, turn=n,
                    created_at=datetime(2026, 12, day, 12, tzinfo=timezone.utc), position="after_tools",
                    execution_status="active", message_count=n, cost_usd=0.25 * n))
    store.compact(tombstone_grace=timedelta(0))


@pytest.fixture
def bucket(s3_server):
    store = s3_server.open_store()
    _fill(store)
    fs, root = store.fsspec()
    return store, fs, root


def test_duckdb_reads_a_user_and_days_and_opens_only_their_files(bucket):
    duckdb = pytest.importorskip("duckdb")
    store, fs, root = bucket
    con = duckdb.connect()
    con.register_filesystem(fs)  # offline stand-in for httpfs + CREATE SECRET: same SQL, same s3:// paths
    sql = (f"from read_parquet('s3://{root}/index/table/*/*/*.parquet', hive_partitioning = true) "
           f"where day >= DATE '{CUTOFF}' and user = 'alice'")
    rows = con.sql(f"select session_id, max(turn) as turns, sum(cost_usd) as cost {sql} group by 1 order by 1")
    assert rows.fetchall() == [("s2", 2, 0.75), ("s3", 2, 0.75)]
    plan = con.sql(f"explain analyze select count(*) {sql}").fetchall()[0][1]
    assert "user=alice/day=2026-12-02" in plan and "day=2026-12-01" not in plan and "user=_" not in plan


def test_polars_scans_the_bucket_with_hive_keys(bucket, s3_server):
    pl = pytest.importorskip("polars")
    store, _, root = bucket
    frame = (pl.scan_parquet(f"s3://{root}/index/table/**/*.parquet", hive_partitioning=True, storage_options={
                 "aws_endpoint_url": s3_server.endpoint_url, "aws_access_key_id": "testing",
                 "aws_secret_access_key": "testing", "aws_region": "us-east-1", "aws_allow_http": "true"})
             .filter((pl.col("day") >= pl.date(2026, 12, 2)) & (pl.col("user") == "alice"))
             .collect())
    assert sorted(frame["checkpoint_id"].to_list()) == ["c2-1", "c2-2", "c3-1", "c3-2"]


def test_pyarrow_dataset_filters_on_partition_keys(bucket, s3_server):
    store, _, root = bucket
    s3 = pafs.S3FileSystem(endpoint_override=s3_server.endpoint_url, access_key="testing", secret_key="testing",
                           region="us-east-1", scheme="http")
    dataset = ds.dataset(f"{root}/index/table", filesystem=s3, format="parquet", partitioning="hive")
    table = dataset.to_table(filter=(ds.field("day") >= CUTOFF) & (ds.field("user") == "alice"))
    assert sorted(table["checkpoint_id"].to_pylist()) == ["c2-1", "c2-2", "c3-1", "c3-2"]
    # Retention, deletes and prune reach the table at the next compaction (prune: at once).
    store.checkpoints.delete("s3", "c3-2", user_id="alice")
    store.prune(session_id="s2", user_id="alice")
    store.compact(tombstone_grace=timedelta(0))
    again = ds.dataset(f"{root}/index/table", filesystem=s3, format="parquet", partitioning="hive")
    left = again.to_table(filter=(ds.field("day") >= CUTOFF) & (ds.field("user") == "alice"))
    assert sorted(left["checkpoint_id"].to_pylist()) == ["c3-1"]
