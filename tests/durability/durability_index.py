"""The index after the final compaction: live per-session rows, as pyarrow and DuckDB read them from the
directory or bucket, equal the checkpoint objects (``index-objects``, see :mod:`durability_checks`)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
from durability_history import _CKPT_OBJ, History, Violation, _v
from durability_views import _retired_validly

from loomray.storage import chains


# -- the index after compaction ------------------------------------------------------
def _ours(path: str, schema: pa.Schema) -> bool:
    """An index file of ours (a foreign Parquet file a user put in a partition is skipped, as readers skip it)."""
    return "checkpoint_id" in schema.names and "tombstone" in schema.names


def index_tables(world, final) -> dict[str, list[dict]]:
    """Checkpoint index rows as pyarrow and DuckDB read them from the directory or bucket (or from bytes).

    Each file's schema is read first and foreign files are left out of both reads (on S3, DuckDB reads the
    pyarrow table, since its httpfs extension is a download).
    """
    import duckdb

    cols = ["checkpoint_id", "key", "epoch", "tombstone"]
    paths: list[str] = []
    if world.spec.backend == "memory":
        tables = [pq.read_table(io.BytesIO(world.inner.get(key=o.key).data))
                  for o in world.inner.list(prefix="index/checkpoints/") if o.key.endswith(".parquet")]
        tables = [t for t in tables if _ours("", t.schema)]
    else:
        fs, root = final.fsspec()
        base = f"{root}/index/checkpoints"
        found = [p for p in fs.find(base) if p.endswith(".parquet")] if fs.exists(base) else []
        tables = []
        for p in found:
            with fs.open(p, "rb") as f:
                t = pq.read_table(f)
            if _ours(p, t.schema):
                tables.append(t)
                paths.append(p)
    table = pa.concat_tables([t.select(cols) for t in tables], promote_options="default") if tables else None
    if table is None:
        return {"pyarrow": [], "duckdb": []}
    out = {"pyarrow": table.to_pylist()}
    con = duckdb.connect()
    if world.spec.backend == "local":
        rel = con.execute(f"select {', '.join(cols)} from read_parquet(?, union_by_name=true)", [paths])
    else:
        con.register("idx", table)
        rel = con.execute(f"select {', '.join(cols)} from idx")
    out["duckdb"] = [dict(zip(cols, r, strict=True)) for r in rel.fetchall()]
    con.close()
    return out


def _live(rows: list[dict]) -> set[str]:
    dead = {r["checkpoint_id"] for r in rows if r["tombstone"]}
    return {r["checkpoint_id"] for r in rows if not r["tombstone"] and r["checkpoint_id"] not in dead}


def _needed_objects(world, final) -> set[str]:
    """Checkpoint ids (of the scenario's session) a live row's chain names: their objects stay, rows or not."""
    spec = world.spec
    rows = final.checkpoints.list(spec.session_id, user_id=spec.user_id, limit=None)
    return {cid for r in rows for sid, cid in chains.expand(r.chain, spec.session_id) if sid == spec.session_id}


def check_index(world, final) -> list[Violation]:
    """After a final compaction: live rows (pyarrow and DuckDB) match the checkpoint objects."""
    out: list[Violation] = []
    h = History.build(world.faulty.calls, world.spec.session_id)
    tables = index_tables(world, final)
    live = {name: _live(rows) for name, rows in tables.items()}
    if live.get("pyarrow") != live.get("duckdb"):
        _v(out, "index-objects", f"pyarrow and DuckDB disagree on live rows: "
                                 f"{sorted(live['pyarrow'] ^ live['duckdb'])[:5]}")
    rows_live = live.get("pyarrow", set())
    objects = set()
    for o in world.inner.list(prefix="sessions/"):
        m = _CKPT_OBJ.match(o.key)
        if m:
            objects.add(m.group(3))
    # Only a tombstone of a writer entitled to it must stay honoured: a fenced writer's is ignored, and one that
    # landed while a takeover was under way may be (storage.visibility rule 5).
    retired, _ = _retired_validly(world, h)
    for cid in sorted(rows_live & set(retired)):
        _v(out, "index-objects", f"row {cid} is live again after it was retired ({retired[cid]}; a retired row "
                                 "came back)")
    for cid in sorted(rows_live - objects - set(h.tombstones)):
        row = h.rows.get(cid)
        deleted = row is not None and row.key in h.obj_deletes
        if not deleted:
            _v(out, "index-objects", f"live row {cid} has no checkpoint object and nothing deleted it")
        # else: a retire deleted the object and never got to write the tombstone (interrupted): explained
    needed = _needed_objects(world, final)
    for cid in sorted(objects - rows_live - needed):
        row = h.rows.get(cid)
        if row is None or cid not in h.indexed:
            continue  # never indexed: a write interrupted between object and row, or a tail (its row rides in it)
        if cid in h.tombstones:
            # Rows are retired before their objects are collected: an object whose collection was interrupted
            # (a failed delete, a writer fenced or dead in between) is garbage a later sweep removes. One that a
            # delete said it removed is not.
            last_delete = max((c.n for c in h.obj_deletes.get(row.key, ())), default=0)
            if last_delete > max((c.n for c in h.obj_puts.get(row.key, ())), default=0):
                _v(out, "index-objects", f"checkpoint object {cid} exists but its row was retired at call "
                                         f"{h.tombstones[cid]} and a delete of it took effect at call {last_delete}")
        else:
            _v(out, "index-objects", f"checkpoint object {cid} exists, its row was written at call {row.n}, "
                                     f"but no live row lists it after compaction")
    return out
