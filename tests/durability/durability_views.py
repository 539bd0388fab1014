"""The oracle that compares every view of a session's history, after the final compaction.

One history, many readers. After a scenario (and a fault-free compaction that
drops every tombstone, as the supervisor's does an hour later), the
session's checkpoints as seen by

- ``list_checkpoints`` (``list``), "latest" (must be the list's head),
- ``get_checkpoint`` of each listed id, read back whole (``get``), and of
  every other checkpoint id the session ever wrote (must be ``None``),
- ``Store.query`` (``query``),
- the compacted table (``index/table/``) read by pyarrow and by DuckDB from
  the directory or bucket (``table-pyarrow``, ``table-duckdb``; on S3 DuckDB
  reads the pyarrow dataset over s3fs, since its httpfs extension is a
  download),
- a fork from each listed checkpoint (at most :data:`MAX_FORKS`, 2 on S3,
  newest, oldest and evenly between), whose restored transcript must equal
  the checkpoint's,

must be one and the same set (``views-agree``; a writer's unacknowledged,
never-indexed tail may be missing from the index readers, query and table,
until a writer indexes it); each checkpoint read through
the API must ``==`` its own JSON round trip (``json-roundtrip``); the set
must hold every acknowledged checkpoint that retention, delete and prune did
not remove by their rules (``acked-visible``) and nothing a fenced writer
wrote or a rule retired (``dead-visible``).
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from durability_history import History, Violation, _incs_by_epoch, _v

from loomray import Agent, Tuning
from loomray.checkpoint_format import load_checkpoint
from loomray.errors import CheckpointException
from loomray.models import ModelResponse
from loomray.records import Message, Usage
from loomray.session import RunRequest, execute_request
from loomray.storage.errors import StorageError

#: Forks the oracle starts per scenario (newest, oldest and evenly between): each is a run of its own.
MAX_FORKS = 4


class _Done:
    """A model that ends every run at once (a fork's one pass)."""

    name = "scripted-done"

    async def complete(self, request: Any) -> ModelResponse:
        return ModelResponse(message=Message(role="assistant", content="fork done"), usage=Usage())


def fork_agent() -> Agent:
    return Agent("Fork.", model=_Done(), tools=[], tuning=Tuning(checkpoint=True, journal=True), name="fork-agent")


def _table_rows(world: Any, store: Any) -> dict[str, list[dict]]:
    """The compacted table's rows as pyarrow and DuckDB read them (``index/table/**/*.parquet``)."""
    import duckdb

    cols = ["session_id", "checkpoint_id", "user_id"]
    if world.spec.backend == "memory":
        parts = [pq.read_table(io.BytesIO(world.inner.get(key=o.key).data))
                 for o in world.inner.list(prefix="index/table/") if o.key.endswith(".parquet")]
        table = pa.concat_tables(parts, promote_options="default") if parts else None
        paths = None
    else:
        import pyarrow.dataset as ds

        fs, root = store.fsspec()
        base = f"{root}/index/table"
        paths = [p for p in fs.find(base) if p.endswith(".parquet")] if fs.exists(base) else []
        if world.spec.backend == "local":
            table = ds.dataset(paths, format="parquet").to_table(columns=cols) if paths else None
        else:
            from pyarrow.fs import FSSpecHandler, PyFileSystem

            table = (ds.dataset(paths, format="parquet", filesystem=PyFileSystem(FSSpecHandler(fs)))
                     .to_table(columns=cols) if paths else None)
    if table is None or table.num_rows == 0:
        return {"table-pyarrow": [], "table-duckdb": []}
    out = {"table-pyarrow": table.select(cols).to_pylist()}
    con = duckdb.connect()
    try:
        if world.spec.backend == "local" and paths:
            rel = con.execute(f"select {', '.join(cols)} from read_parquet(?)", [paths])
        else:
            con.register("tbl", table)
            rel = con.execute(f"select {', '.join(cols)} from tbl")
        out["table-duckdb"] = [dict(zip(cols, r, strict=True)) for r in rel.fetchall()]
    finally:
        con.close()
    return out


def _mine(rows: list[dict], spec: Any) -> set[str]:
    return {r["checkpoint_id"] for r in rows if r["session_id"] == spec.session_id and r["user_id"] == spec.user_id}


def collect_views(world: Any, store: Any, out: list[Violation]) -> dict[str, Any]:
    """Every reader's view of the session's live checkpoints (ids), plus "latest" and the loaded checkpoints."""
    spec = world.spec
    sid, uid = spec.session_id, spec.user_id
    listed = [r.checkpoint_id for r in store.checkpoints.list(sid, user_id=uid, limit=None)]
    views: dict[str, Any] = {"list": set(listed), "order": listed}
    raw = store.checkpoints.get(sid, "latest", user_id=uid)
    views["latest"] = load_checkpoint(store, sid, "latest", user_id=uid).checkpoint_id if raw is not None else None
    loaded, unequal = {}, []
    for cid in listed:
        try:
            ckpt = load_checkpoint(store, sid, cid, user_id=uid)
        except CheckpointException as e:
            _v(out, "views-agree", f"listed checkpoint {cid} does not read back through get_checkpoint: {e}")
            continue
        if ckpt is not None:
            loaded[cid] = ckpt
            again = type(ckpt).model_validate_json(ckpt.model_dump_json())
            if again != ckpt:
                unequal.append(cid)
    if unequal:
        _v(out, "json-roundtrip", f"{len(unequal)} checkpoint(s) read through the API != their own JSON round trip "
                                  f"(model_validate_json(model_dump_json())), e.g. {unequal[0]}")
    views["get"], views["loaded"] = set(loaded), loaded
    query = store.query(user_id=uid, session_id=sid, columns=["checkpoint_id"])
    views["query"] = set(query.column("checkpoint_id").to_pylist())
    for name, rows in _table_rows(world, store).items():
        views[name] = _mine(rows, spec)
    return views


def probe_unlisted(world: Any, store: Any, h: History, listed: set[str]) -> dict[str, str]:
    """Checkpoint ids of the session outside the list that ``get_checkpoint(id)`` still returns."""
    spec = world.spec
    found = {}
    for cid in sorted(set(h.rows) - listed):
        try:
            raw = store.checkpoints.get(spec.session_id, cid, user_id=spec.user_id)
        except (CheckpointException, StorageError) as e:
            raw, found[cid] = None, f"raises {type(e).__name__}"
        if raw is not None:
            found[cid] = "returns it"
    return found


def fork_each(world: Any, store: Any, views: dict[str, Any], out: list[Violation]) -> set[str]:
    """Fork from (up to MAX_FORKS of) the listed checkpoints; the ids whose fork restored their transcript."""
    spec = world.spec
    order = views["order"]
    most = MAX_FORKS if spec.backend != "s3" else 2  # a fork on moto's S3 costs about a second
    picks = order if len(order) <= most else sorted(
        {order[round(i * (len(order) - 1) / (most - 1))] for i in range(most)})
    agent, good = fork_agent(), set()
    for i, cid in enumerate(picks):
        fork_sid = f"fork{i}-{spec.session_id}"
        req = RunRequest(kind="resume", prompt="fork", session_id=fork_sid, user_id=spec.user_id,
                         from_checkpoint=cid, fork_of=spec.session_id)
        try:
            asyncio.run(execute_request(agent, req, store, owner=f"oracle-fork-{i}"))
            got = load_checkpoint(store, fork_sid, "latest", user_id=spec.user_id)
        except Exception as e:  # any failure to fork a listed checkpoint is the finding
            _v(out, "views-agree", f"fork from listed checkpoint {cid} failed: {type(e).__name__}: {e}")
            continue
        want = views["loaded"].get(cid)
        if want is None or got is None or got.messages[:len(want.messages)] != want.messages:
            _v(out, "views-agree", f"fork from {cid}: its restored transcript is not the checkpoint's "
                                   f"({None if got is None else len(got.messages)} messages)")
            continue
        good.add(cid)
    views["forked"] = set(picks)
    return good


def _removed_by_rule(world: Any, row: Any) -> str | None:
    """Why prune or delete may have removed ``row`` (None: neither may have)."""
    if any(before > row.created_at for _, _, _, before, _ in world.prunes):
        return "prune"
    if row.checkpoint_id in {cid for _, cid, _ in world.deletes}:
        return "delete"
    return None


def _retired_validly(world: Any, h: History) -> tuple[dict[str, str], dict[str, str]]:
    """Checkpoints a rule retired by a writer entitled to (tombstone or object delete): they must stay gone; and
    those only a tombstone that landed while a takeover was under way retired (claimed, ``lease.json`` not
    swapped yet): honoured if the takeover listed it, ignored if not (storage.visibility rule 5), so either way."""
    by_epoch = _incs_by_epoch(world, h)
    actors = {name for name, *_ in world.prunes} | {name for name, _, _ in world.deletes}
    out: dict[str, str] = {}
    maybe: dict[str, str] = {}
    for cid, calls in h.tomb_calls.items():
        for n in calls:
            actor = h.calls[n - 1].actor
            inc = next((i for incs in by_epoch.values() for i in incs if i.actor == actor and i.start < n
                        and (i.end is None or n <= i.end)), None)
            if actor in actors:
                out[cid] = f"tombstone by {actor} at call {n}"
            elif inc is not None and (inc.epoch or 0) >= h.max_epoch_before(n):
                if h.max_marker_before(n) > (inc.epoch or 0):
                    maybe.setdefault(cid, f"tombstone by {actor} at call {n}, an epoch above claimed")
                else:
                    out[cid] = f"tombstone by {actor} at call {n}"
    for row in h.rows.values():
        if any(c.actor in actors for c in h.obj_deletes.get(row.key, ())):
            out.setdefault(row.checkpoint_id, "object deleted by prune/delete")
    return out, {cid: why for cid, why in maybe.items() if cid not in out}


def check_views(world: Any, store: Any) -> list[Violation]:
    """Every view agrees, holds what is owed and nothing fenced or retired (see the module docstring)."""
    out: list[Violation] = []
    h = History.build(world.faulty.calls, world.spec.session_id)
    views = collect_views(world, store, out)
    listed = views["list"]
    if views["latest"] != (views["order"][0] if views["order"] else None):
        _v(out, "views-agree", f"'latest' is {views['latest']}, the head of list_checkpoints "
                               f"{views['order'][0] if views['order'] else None}")
    acked = {cid for inc in world.incarnations for _, cid, _, _ in inc.acks}
    # A writer's unacknowledged tail (an object no index file names) is listed, but the readers of index files
    # (query, the table) see it only once a writer indexes it: a lag, not a second rule.
    tails = {cid for cid in listed if cid not in h.indexed and cid not in acked}
    for name in ("get", "query", "table-pyarrow", "table-duckdb"):
        extra, missing = views[name] - listed, listed - views[name] - (tails if name != "get" else set())
        if extra or missing:
            _v(out, "views-agree", f"{name} differs from list_checkpoints: only in {name} {sorted(extra)[:4]}, "
                                   f"missing {sorted(missing)[:4]}")
    for cid, what in probe_unlisted(world, store, h, listed).items():
        row = h.rows.get(cid)
        how = "a fenced write" if row is not None and not row.valid else "not listed"
        _v(out, "views-agree", f"get_checkpoint({cid}) {what}, {how} (written by {row.actor if row else '?'})")
    everything = set().union(*(views[k] for k in ("list", "get", "query", "table-pyarrow", "table-duckdb")))
    retired, maybe = _retired_validly(world, h)
    _owed(world, h, {**maybe, **retired}, views, out)
    for cid in sorted(everything):
        row = h.rows.get(cid)
        if row is not None and not row.valid:
            _v(out, "dead-visible", f"{cid}, written by {row.actor} at epoch {row.epoch} at call {row.n} after "
                                    f"epoch {h.max_epoch_before(row.n)} was taken, is visible")
        elif cid in retired:
            _v(out, "dead-visible", f"{cid} is visible again after it was retired ({retired[cid]})")
    fork_each(world, store, views, out)
    return out


def _owed(world: Any, h: History, retired: dict[str, str], views: dict[str, Any], out: list[Violation]) -> None:
    """Every acknowledged checkpoint of a writer that held the lease is in every view, unless prune or delete
    removed it or a writer entitled to retired it (retention, by a tombstone of a writer not fenced then)."""
    seen = set()
    for inc in world.incarnations:
        for pos, cid, _st, _ in inc.acks:
            row = h.rows.get(cid)
            if row is None or not row.valid or cid in seen or cid in retired or _removed_by_rule(world, row):
                continue
            seen.add(cid)
            missing = [k for k in ("list", "get", "query", "table-pyarrow", "table-duckdb") if cid not in views[k]]
            if missing:
                why = f"; a fenced writer's tombstone retired it at call {h.tombstones[cid]}" if cid in h.tombstones else ""
                _v(out, "acked-visible", f"{inc.id}: checkpoint {cid} (epoch {row.epoch}) acknowledged at call {pos},"
                                         f" removed by no rule, is missing from {', '.join(missing)}{why}")
