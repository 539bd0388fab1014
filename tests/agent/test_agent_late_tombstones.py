"""A fenced writer's late retention tombstones retire nothing any reader honours (issue 22, the last gap of the
visibility rule: storage.visibility rule 5).

The writer proves its lease; a takeover claims the session right after that
proof and lists it; only then does the writer's batch file land, with its
rows and the tombstones its retention chose. Every view must still show the
retired checkpoints, with their objects readable: ``list_checkpoints``,
"latest", ``get_checkpoint`` by id, ``Store.query``, the compacted table
read by pyarrow and DuckDB, and a fork from each listed checkpoint.
"""

from __future__ import annotations

import duckdb
import pyarrow.dataset as ds
import pytest
from agent_helpers import lookup

from loomray import Agent, CheckpointConfig, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage import layout, open_store
from loomray.storage.errors import LeaseLostError


def script(n: int) -> list:
    """``n`` passes that each look up one key, then answers that echo the last prompt (for the forks)."""
    def echo(request):
        return f"answer to: {[m for m in request.messages if m.role == 'user'][-1].content}"

    return [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n)] + [echo] * 8


async def test_late_retention_tombstones_of_a_fenced_writer_are_ignored_by_every_view(tmp_path, monkeypatch):
    from loomray import run_writes

    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 3600.0)  # only the batch proofs, whatever the machine's speed
    root = tmp_path / "d"
    store = open_store(root)
    store.checkpoints.batch = 4  # one batch of 4, and retention keeps 2: the batch file retires 2 of them
    runtime = LocalRuntime(store, max_checkpoints_per_session=2)
    tuning = Tuning(checkpoint=CheckpointConfig(position="after_tools"))
    agent = Agent("", model=ScriptedModel(script(12)), tools=[lookup], runtime=runtime, tuning=tuning)
    partition = layout.index_partition(layout.CHECKPOINT_INDEX, "s", None)
    real_put = store.objects.put
    taken: list[object] = []

    def put(*, key, data, **kw):
        if key.startswith(partition) and not taken:
            # The writer's first batch proof passed; its index file (rows and retention's tombstones) is about
            # to land. A takeover claims the session and lists it first.
            taken.append(open_store(root).leases.acquire("s", owner="taker"))
        return real_put(key=key, data=data, **kw)

    monkeypatch.setattr(store.objects, "put", put)
    acked: list[str] = []

    def on_event(event):
        if event.type == "checkpoint" and event.ok:
            acked.append(event.checkpoint_id)

    with pytest.raises(LeaseLostError):  # its next proof finds the takeover
        await agent.run("task", session_id="s", emit=on_event)
    assert taken and len(acked) == 4
    monkeypatch.undo()

    reader = Agent("", model=ScriptedModel(script(0)), tools=[lookup], runtime=LocalRuntime(root), tuning=tuning)
    fresh = open_store(root)
    newest_first = acked[::-1]
    assert [r.checkpoint_id for r in fresh.checkpoints.list("s")] == newest_first
    assert [m.checkpoint_id for m in await reader.list_checkpoints("s")] == newest_first
    assert (await reader.get_checkpoint("s")).checkpoint_id == acked[-1]
    for cid in acked:
        ckpt = await reader.get_checkpoint("s", cid)
        assert ckpt is not None and ckpt.checkpoint_id == cid
        assert fresh.checkpoints.get("s", cid) is not None  # the object is there and verifies
    assert set(fresh.query(session_id="s")["checkpoint_id"].to_pylist()) == set(acked)

    fresh.compact(tombstone_grace=__import__("datetime").timedelta(0))
    assert set(open_store(root).query(session_id="s")["checkpoint_id"].to_pylist()) == set(acked)
    table_dir = root / "index" / "table"
    by_arrow = ds.dataset(table_dir, format="parquet").to_table(columns=["session_id", "checkpoint_id"])
    assert set(by_arrow["checkpoint_id"].to_pylist()) == set(acked)
    by_duck = duckdb.sql(f"select checkpoint_id from read_parquet('{table_dir}/**/*.parquet') "
                         "where session_id = 's'").fetchall()
    assert {r[0] for r in by_duck} == set(acked)
    assert [r.checkpoint_id for r in open_store(root).checkpoints.list("s")] == newest_first

    for cid in acked:  # a fork from each listed checkpoint starts from it
        [forked] = await reader.fork("s", from_checkpoint=cid, prompts=[f"from {cid}"])
        assert forked.forked_from == "s" and forked.output == f"answer to: from {cid}"
    runtime.close()
