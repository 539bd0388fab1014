"""Query the compacted checkpoint table: pyarrow, DuckDB and ``store.query`` over the same files.

    python examples/index_query.py [DATA_DIR]

Runs a few research sessions (LocalRuntime, offline model, two users),
compacts, then asks questions across sessions three ways. The table lives
under ``DATA_DIR/index/table/user=.../day=YYYY-MM-DD/part-0.parquet``
(hive-style, live rows only), so any Parquet reader works on a directory or
an ``s3://`` prefix (docs/readers.md has the commands for each).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

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
    done = store.query(status="completed", columns=["user_id", "session_id", "turn", "cost_usd"])
    report = store.compact()  # what the supervisor does every 10 minutes: the table outside readers open
    print(f"compacted {report.files_before} -> {report.files_after} index files")

    # 1. pyarrow: the table as a hive-partitioned dataset (keys user and day); only live rows are in it.
    table = ds.dataset(f"{data_dir}/index/table", format="parquet", partitioning="hive").to_table(
        filter=ds.field("user") == "alice")
    print(f"pyarrow: alice has {table.num_rows} checkpoints on {len(set(table['day'].to_pylist()))} day(s)")

    # 2. DuckDB: SQL straight on the files, pruned by the partition keys.
    import duckdb

    rows = duckdb.sql(f"""
        select user_id, session_id, max(turn) as turns, round(max(cost_usd), 5) as cost
        from read_parquet('{data_dir}/index/table/*/*/*.parquet', hive_partitioning = true)
        where day >= current_date - 1 group by 1, 2 order by 1, 2""").fetchall()
    for user, session, turns, cost in rows:
        print(f"duckdb:  {user:<6} {session:<7} turns={turns:<3} cost=${cost}")

    # 3. store.query: the table plus what was written since, retention and tombstones applied.
    again = store.query(status="completed", columns=["user_id", "session_id", "turn", "cost_usd"])
    alice = store.query(user_id="alice", columns=["session_id", "turn"])
    same = again.sort_by("session_id").equals(done.sort_by("session_id"))
    print(f"store.query: {again.num_rows} completed checkpoints; alice has "
          f"{alice.num_rows} checkpoints in {len(set(alice['session_id'].to_pylist()))} sessions; "
          f"same answers as before compaction: {same}")
    runtime.close()
    ok = (len(rows) == 3 and again.num_rows == 3 and same and sorted(r[2] for r in rows) == [4, 7, 10]
          and table.num_rows == alice.num_rows)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(main(sys.argv[1]))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(tmp))
