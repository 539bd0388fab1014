"""Query the Parquet index: pyarrow, DuckDB and ``store.query`` over the same files.

    python examples/index_query.py [DATA_DIR]

Runs a few research sessions (LocalRuntime, offline model, two users), then
asks questions across sessions three ways. The index lives under
``DATA_DIR/index/checkpoints/user=.../session=.../*.parquet`` (hive-style), so
any Parquet reader works on a directory or an ``s3://`` prefix.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

import pyarrow.compute as pc
import pyarrow.dataset as ds

from loomray import Agent, Tuning
from loomray.models.research import ResearchModel, research_tools
from loomray.runtime import LocalRuntime


async def populate(data_dir: str) -> None:
    runtime = LocalRuntime(data_dir)
    for i, (user, passes) in enumerate([("alice", 3), ("alice", 6), ("bob", 9)]):
        agent = Agent("You are a careful researcher.", model=ResearchModel(passes=passes), tools=research_tools(),
                      runtime=runtime, tuning=Tuning(checkpoint=True))
        await agent.run(f"topic {i}", session_id=f"sess-{i}", user_id=user)
    runtime.close()


def main(data_dir: str) -> int:
    asyncio.run(populate(data_dir))
    runtime = LocalRuntime(data_dir)
    store = runtime.store

    # 1. pyarrow: the index directory as a hive-partitioned dataset (tombstones are rows with tombstone=true).
    table = ds.dataset(f"{data_dir}/index/checkpoints", format="parquet", partitioning="hive").to_table()
    live = table.filter(pc.invert(table["tombstone"]))
    print(f"pyarrow: {live.num_rows} index rows in {len(store.index_files())} files")

    # 2. DuckDB: SQL straight on the files.
    import duckdb

    rows = duckdb.sql(f"""
        select user_id, session_id, max(turn) as turns, round(max(cost_usd), 5) as cost
        from read_parquet('{data_dir}/index/checkpoints/**/*.parquet', hive_partitioning = true)
        where not tombstone group by 1, 2 order by 1, 2""").fetchall()
    for user, session, turns, cost in rows:
        print(f"duckdb:  {user:<6} {session:<7} turns={turns:<3} cost=${cost}")

    # 3. store.query: live rows (retention and tombstones applied), filtered in Arrow.
    done = store.query(status="completed", columns=["user_id", "session_id", "turn", "cost_usd"])
    alice = store.query(user_id="alice", columns=["session_id", "turn"])
    print(f"store.query: {done.num_rows} completed checkpoints; alice has "
          f"{alice.num_rows} checkpoints in {len(set(alice['session_id'].to_pylist()))} sessions")

    # Compaction merges each partition's small files into one; the answers do not change.
    report = store.compact()
    again = store.query(status="completed", columns=["user_id", "session_id", "turn", "cost_usd"])
    same = again.sort_by("session_id").equals(done.sort_by("session_id"))
    print(f"compacted {report.files_before} -> {report.files_after} files; same answers: {same}")
    runtime.close()
    ok = len(rows) == 3 and done.num_rows == 3 and same and sorted(r[2] for r in rows) == [4, 7, 10]
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(tmp))
