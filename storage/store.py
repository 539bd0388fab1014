"""``Store``: checkpoints, journal, leases, session index and queries over one :class:`ObjectStore`.

Everything here is backend-neutral; the memory, local-directory and S3
adapters only move bytes. See the package docstring for the layout and the
partitioning choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from storage import layout
from storage.errors import CorruptObjectError, LeaseLostError, PreconditionFailed
from storage.ids import user_segment, validate_id
from storage.index import ParquetIndex, conform, live_checkpoints
from storage.objects import ObjectStore
from storage.rows import (CHECKPOINT_SCHEMA, SESSION_SCHEMA, CheckpointRow, CompactReport, JournalEntry, Lease,
                          PruneReport, SessionRow, as_utc, checkpoint_rows_from_table, checkpoint_rows_table,
                          session_rows_from_table, session_rows_table, utcnow)

log = logging.getLogger("storage")
ANY: Any = ...  # "any user" in queries; None means "no user"
_LEASE_ATTEMPTS = 16
_ROW_CACHE_FILES = 16384
_VIEW_REFRESH = 32


class Store:
    """The storage API of docs/contracts.md. All methods are synchronous and thread-safe."""

    def __init__(self, objects: ObjectStore, url: str) -> None:
        self.objects = objects
        self.url = url
        self.index = ParquetIndex(objects)
        self._lock = threading.RLock()
        #: Parsed rows per immutable index file key (LRU).
        self._rows: OrderedDict[str, list[tuple[CheckpointRow, bool]]] = OrderedDict()
        #: Per-session live rows for retention: [rows by checkpoint id, writes since the last full LIST].
        self._views: dict[tuple[str | None, str], list] = {}

    def describe(self, key: str | None = None) -> str:
        """Backend, root and (optionally) key, for messages and the CLI."""
        return self.objects.describe(key)

    def fsspec(self) -> tuple[Any, str]:
        """``(filesystem, root)``: e.g. ``pyarrow.dataset.dataset(root + "/index/checkpoints", filesystem=fs,
        partitioning="hive")``. Not available for ``memory://``."""
        return self.objects.fsspec()

    def close(self) -> None:
        """Release clients and reader threads."""
        self.index.close()
        self.objects.close()

    def __repr__(self) -> str:
        return f"Store({self.describe()})"

    # -- leases ------------------------------------------------------------
    def _read_lease(self, session_id: str, user_id: str | None) -> tuple[int, str | None]:
        key = layout.lease_key(session_id, user_id)
        obj = self.objects.get(key=key)
        if obj is None:
            return 0, None
        try:
            epoch = int(json.loads(obj.data)["epoch"])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptObjectError(f"{self.describe(key)}: unreadable lease: {e}") from e
        return epoch, obj.etag

    def acquire_lease(self, session_id: str, *, user_id: str | None = None, owner: str) -> Lease:
        """Take the session's lease, bumping its epoch with a conditional write; fences every older holder."""
        key = layout.lease_key(session_id, user_id)
        for _ in range(_LEASE_ATTEMPTS):
            epoch, etag = self._read_lease(session_id, user_id)
            body = json.dumps({"type": "lease", "v": 1, "session_id": session_id, "user_id": user_id,
                               "epoch": epoch + 1, "owner": str(owner), "acquired_at": utcnow().isoformat()}).encode()
            try:
                self.objects.put(key=key, data=body, if_none_match=etag is None, if_match=etag)
            except PreconditionFailed:
                continue  # another acquirer won this round; read its epoch and go above it
            return Lease(session_id, user_id, epoch + 1, str(owner))
        raise LeaseLostError(f"{self.describe(key)}: lease of session {session_id!r} is contended; gave up after "
                             f"{_LEASE_ATTEMPTS} attempts")

    def current_epoch(self, session_id: str, *, user_id: str | None = None) -> int:
        """The session's lease epoch; 0 when it was never leased."""
        return self._read_lease(session_id, user_id)[0]

    def check_lease(self, lease: Lease) -> None:
        """Raise :class:`LeaseLostError` if a newer epoch has taken the session."""
        current = self.current_epoch(lease.session_id, user_id=lease.user_id)
        if current != lease.epoch:
            raise LeaseLostError(
                f"{self.describe(layout.lease_key(lease.session_id, lease.user_id))}: session {lease.session_id!r} "
                f"is at epoch {current}; this writer ({lease.owner}) holds epoch {lease.epoch}")

    def _fence(self, lease: Lease | None, session_id: str, user_id: str | None) -> int:
        if lease is None:
            return 0
        if lease.session_id != session_id or lease.user_id != user_id:
            raise LeaseLostError(f"lease for session {lease.session_id!r}/user {lease.user_id!r} used to write "
                                 f"session {session_id!r}/user {user_id!r}")
        self.check_lease(lease)
        return lease.epoch

    # -- checkpoints -------------------------------------------------------
    def put_checkpoint(self, data: bytes, *, session_id: str, checkpoint_id: str, user_id: str | None = None,
                       turn: int, created_at: datetime, position: str, execution_status: str, message_count: int,
                       input_tokens: int = 0, output_tokens: int = 0, cost_usd: float | None = None,
                       parent_checkpoint_id: str | None = None, forked_from: str | None = None,
                       agent_id: str | None = None, lease: Lease | None = None, keep: int = 20) -> CheckpointRow:
        """One PUT of ``data`` plus one index row, then retention; see docs/contracts.md."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"checkpoint data must be bytes, got {type(data).__name__}")
        key = layout.checkpoint_key(session_id, user_id, checkpoint_id)
        for name, value in (("parent_checkpoint_id", parent_checkpoint_id), ("forked_from", forked_from),
                            ("agent_id", agent_id)):
            if value is not None:
                validate_id(value, name)
        epoch = self._fence(lease, session_id, user_id)
        # sha256 and size once, over the caller's buffer; the same buffer is the PUT body.
        row = CheckpointRow(session_id, user_id, checkpoint_id, int(turn), as_utc(created_at), str(position),
                            str(execution_status), int(message_count), int(input_tokens), int(output_tokens),
                            None if cost_usd is None else float(cost_usd), parent_checkpoint_id, forked_from,
                            agent_id, epoch, key, len(data), hashlib.sha256(data).hexdigest())
        self.objects.put(key=key, data=data)
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self._write_rows(partition, [row], tombstone=False)
        if lease is not None:
            try:
                self.check_lease(lease)
            except LeaseLostError:
                # A takeover raced this write: retire it so it can never be "latest".
                self._retire(session_id, user_id, [row])
                raise
        if keep >= 1:
            self._apply_retention(session_id, user_id, row, keep)
        return row

    def _apply_retention(self, session_id: str, user_id: str | None, row: CheckpointRow, keep: int) -> None:
        """Drop the oldest live checkpoints beyond ``keep``.

        The session's live rows come from a per-store view refreshed by a full
        partition LIST on first use and every ``_VIEW_REFRESH`` writes, so a
        steady-state write costs no LIST. The view can only miss rows another
        process wrote; it never deletes beyond the ``keep`` newest rows it knows,
        so a session never drops below ``keep`` checkpoints.
        """
        view_key = (user_id, session_id)
        with self._lock:
            view = self._views.get(view_key)
            if view is not None and view[1] < _VIEW_REFRESH:
                view[0][row.checkpoint_id] = row
                view[1] += 1
                rows = dict(view[0])
            else:
                rows = None
        if rows is None:
            rows = self._live_rows(session_id, user_id)
        if len(rows) > keep:
            ordered = sorted(rows.values(), key=lambda r: r.order)
            self._retire(session_id, user_id, ordered[:len(ordered) - keep])

    def _file_rows(self, keys: list[str]) -> list[list[tuple[CheckpointRow, bool]]]:
        """Parsed rows of each readable index file; files are immutable, so parsing is cached by key."""
        with self._lock:
            missing = [k for k in keys if k not in self._rows]
        parsed = {}
        for key, table in self.index.read_files(missing, cache=False):
            try:
                parsed[key] = checkpoint_rows_from_table(conform(table, CHECKPOINT_SCHEMA))
            except (KeyError, ValueError, TypeError, pa.ArrowInvalid) as e:
                log.warning("skipping index file with a foreign schema: %s: %s", self.describe(key), e)
        with self._lock:
            for key, rows in parsed.items():
                self._cache_rows(key, rows)
            return [self._rows[k] for k in keys if k in self._rows]

    def _cache_rows(self, key: str, rows: list[tuple[CheckpointRow, bool]]) -> None:
        self._rows[key] = rows
        self._rows.move_to_end(key)
        while len(self._rows) > _ROW_CACHE_FILES:
            self._rows.popitem(last=False)

    def _write_rows(self, partition: str, rows: list[CheckpointRow], *, tombstone: bool) -> None:
        key = self.index.write(partition, checkpoint_rows_table(rows, tombstone=tombstone, written_at=utcnow()),
                               cache=False)
        with self._lock:
            self._cache_rows(key, [(r, tombstone) for r in rows])

    def _live_rows(self, session_id: str, user_id: str | None) -> dict[str, CheckpointRow]:
        """The session's live rows from a fresh LIST of its partition (strongly consistent); refreshes the view."""
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        live: dict[str, CheckpointRow] = {}
        dead: set[str] = set()
        for rows in self._file_rows(self.index.list_files(partition)):
            for row, tomb in rows:
                if tomb:
                    dead.add(row.checkpoint_id)
                else:
                    live[row.checkpoint_id] = row
        result = {cid: r for cid, r in live.items() if cid not in dead}
        with self._lock:
            self._views[(user_id, session_id)] = [dict(result), 0]
        return result

    def _retire(self, session_id: str, user_id: str | None, rows: list[CheckpointRow]) -> None:
        """Delete objects, then write tombstones (a crash between leaves rows whose object is gone: listings skip them)."""
        if not rows:
            return
        self.objects.delete(keys=[r.key for r in rows])
        partition = layout.index_partition(layout.CHECKPOINT_INDEX, session_id, user_id)
        self._write_rows(partition, rows, tombstone=True)
        with self._lock:
            view = self._views.get((user_id, session_id))
            if view is not None:
                for r in rows:
                    view[0].pop(r.checkpoint_id, None)

    def list_checkpoints(self, session_id: str, *, user_id: str | None = None, limit: int | None = 50) -> list[CheckpointRow]:
        """Newest first by (epoch, checkpoint_id); rows whose object is missing or truncated are skipped."""
        rows = self._live_rows(session_id, user_id)
        present = {o.key: o.size for o in self.objects.list(prefix=layout.session_prefix(session_id, user_id) + "checkpoints/")}
        out = []
        for row in sorted(rows.values(), key=lambda r: r.order, reverse=True):
            size = present.get(row.key)
            if size is None:
                continue
            if size != row.size:
                log.warning("skipping checkpoint: %s is %d bytes, %d were written (truncated or replaced)",
                            self.describe(row.key), size, row.size)
                continue
            out.append(row)
            if limit is not None and limit > 0 and len(out) >= limit:
                break
        return out

    def get_checkpoint(self, session_id: str, checkpoint_id: str = "latest", *, user_id: str | None = None) -> bytes | None:
        """The checkpoint's bytes, verified against the size and sha256 recorded at write time."""
        if checkpoint_id != "latest":
            layout.checkpoint_key(session_id, user_id, checkpoint_id)  # validates the id
        rows = self._live_rows(session_id, user_id)
        if checkpoint_id == "latest":
            candidates = sorted(rows.values(), key=lambda r: r.order, reverse=True)
        else:
            candidates = [rows[checkpoint_id]] if checkpoint_id in rows else []
        for row in candidates:
            obj = self.objects.get(key=row.key)
            if obj is None:
                continue  # deleted behind the index's back; the next newest is the latest that exists
            if len(obj.data) != row.size or hashlib.sha256(obj.data).hexdigest() != row.sha256:
                raise CorruptObjectError(
                    f"{self.describe(row.key)}: checkpoint {row.checkpoint_id!r} of session {session_id!r} is corrupt "
                    f"or truncated ({len(obj.data)} bytes, {row.size} written; sha256 mismatch)")
            return obj.data
        return None

    def delete_checkpoint(self, session_id: str, checkpoint_id: str, *, user_id: str | None = None) -> bool:
        """Delete one checkpoint (object + tombstone); False when it does not exist."""
        layout.checkpoint_key(session_id, user_id, checkpoint_id)
        row = self._live_rows(session_id, user_id).get(checkpoint_id)
        if row is None:
            return False
        self._retire(session_id, user_id, [row])
        return True

    # -- journal -----------------------------------------------------------
    def journal_append(self, entry: JournalEntry, *, lease: Lease | None = None) -> None:
        """Create-only write of one journal entry; PreconditionFailed if that (run, seq, step) exists."""
        key = layout.journal_key(entry.session_id, entry.user_id, entry.run_id, entry.seq, entry.step_key)
        epoch = self._fence(lease, entry.session_id, entry.user_id)
        if lease is not None and entry.epoch != epoch:
            entry = entry.model_copy(update={"epoch": epoch})
        self.objects.put(key=key, data=entry.__pydantic_serializer__.to_json(entry), if_none_match=True)

    def _read_entries(self, keys: list[str]) -> list[JournalEntry]:
        def load(key: str) -> JournalEntry | None:
            obj = self.objects.get(key=key)
            if obj is None:
                return None
            try:
                return JournalEntry.model_validate_json(obj.data)
            except ValueError as e:
                log.warning("skipping unreadable journal entry: %s: %s", self.describe(key), e)
                return None
        return [e for e in self.index._pool.map(load, keys) if e is not None]

    def journal_list(self, session_id: str, run_id: str, *, user_id: str | None = None) -> list[JournalEntry]:
        """The run's entries by seq; unreadable entries are skipped with a warning."""
        keys = [o.key for o in self.objects.list(prefix=layout.journal_prefix(session_id, user_id, run_id))]
        return sorted(self._read_entries(keys), key=lambda e: (e.seq, e.step_key))

    def journal_runs(self, session_id: str, *, user_id: str | None = None) -> list[str]:
        """Run ids with journal entries, sorted."""
        return self.objects.list_dirs(prefix=layout.journal_prefix(session_id, user_id))

    # -- session index -----------------------------------------------------
    def put_session(self, row: SessionRow) -> None:
        """Append a status row for the session."""
        validate_id(row.session_id, "session_id")
        row = SessionRow(**{**row.__dict__, "updated_at": as_utc(row.updated_at)})
        partition = layout.index_partition(layout.SESSION_INDEX, row.session_id, row.user_id)
        self.index.write(partition, session_rows_table([row]))

    def _session_table(self, prefix: str) -> pa.Table:
        keys, table = self.index.read_prefix(prefix, SESSION_SCHEMA)
        return table

    def get_session(self, session_id: str, *, user_id: str | None = None) -> SessionRow | None:
        """The session's latest status row, or None."""
        rows = session_rows_from_table(self._session_table(layout.index_partition(layout.SESSION_INDEX, session_id, user_id)))
        return _latest_sessions(rows)[0] if rows else None

    def list_sessions(self, *, status: str | None = None, user_id: Any = ANY) -> list[SessionRow]:
        """The latest row of every session (of ``user_id``; ``...`` = any user), filtered by status."""
        prefix = layout.SESSION_INDEX if user_id is ANY else f"{layout.SESSION_INDEX}user={user_segment(user_id)}/"
        rows = _latest_sessions(session_rows_from_table(self._session_table(prefix)))
        return [r for r in rows if status is None or r.status == status]

    # -- queries -----------------------------------------------------------
    def query(self, *, user_id: Any = ANY, session_id: str | None = None, status: str | None = None,
              since: datetime | None = None, until: datetime | None = None, min_cost: float | None = None,
              max_cost: float | None = None, columns: list[str] | None = None) -> pa.Table:
        """Live checkpoint rows across sessions as an Arrow table (``user_id=...`` = any user).

        ``since`` is inclusive, ``until`` exclusive (on ``created_at``); rows
        with an unknown cost never match a cost filter.
        """
        prefix = layout.CHECKPOINT_INDEX
        if user_id is not ANY:
            prefix += f"user={user_segment(user_id)}/"
            if session_id is not None:
                prefix += f"session={validate_id(session_id, 'session_id')}/"
        keys = self.index.list_files(prefix)
        if session_id is not None and user_id is ANY:
            validate_id(session_id, "session_id")
            keys = [k for k in keys if f"/session={session_id}/" in k]
        _, table = self.index.read_keys(keys, CHECKPOINT_SCHEMA, cache=False)
        table = live_checkpoints(table)
        mask = None
        for cond in (
            pc.equal(table["execution_status"], status) if status is not None else None,
            pc.greater_equal(table["created_at"], pa.scalar(as_utc(since), table["created_at"].type)) if since else None,
            pc.less(table["created_at"], pa.scalar(as_utc(until), table["created_at"].type)) if until else None,
            pc.greater_equal(table["cost_usd"], float(min_cost)) if min_cost is not None else None,
            pc.less_equal(table["cost_usd"], float(max_cost)) if max_cost is not None else None,
        ):
            if cond is not None:
                mask = cond if mask is None else pc.and_(mask, cond)
        if mask is not None:
            table = table.filter(pc.fill_null(mask, False))
        table = table.drop_columns(["tombstone", "written_at"])
        return table.select(columns) if columns else table

    def index_files(self, kind: str = "checkpoints") -> list[str]:
        """Keys of the index files of ``kind`` ("checkpoints" or "sessions")."""
        if kind not in ("checkpoints", "sessions"):
            raise ValueError(f"index kind must be 'checkpoints' or 'sessions', got {kind!r}")
        return self.index.list_files(f"index/{kind}/")

    def compact(self) -> CompactReport:
        """Merge each partition's files into one, dropping tombstoned rows; only merged files are deleted."""
        from storage.maintenance import compact

        return compact(self)

    def prune(self, before: datetime | None = None, session_id: str | None = None,
              user_id: str | None = None) -> PruneReport:
        """Delete checkpoints and journal entries matching all filters (None = any), and nothing else."""
        from storage.maintenance import prune

        return prune(self, before=before, session_id=session_id, user_id=user_id)


def _latest_sessions(rows: list[SessionRow]) -> list[SessionRow]:
    """Latest row per (user, session); a later row wins a tie on updated_at."""
    latest: dict[tuple[str | None, str], SessionRow] = {}
    for row in rows:  # rows arrive in file (write) order
        k = (row.user_id, row.session_id)
        if k not in latest or row.updated_at >= latest[k].updated_at:
            latest[k] = row
    return sorted(latest.values(), key=lambda r: r.updated_at, reverse=True)


__all__ = ["ANY", "Store"]
