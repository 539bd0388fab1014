"""What a reader takes from an index file it did not write: values it can convert, and its partition's rows only.

Every index file a reader GETs passes through :func:`checked` and
:func:`own_rows`. Below ``_FEW_ROWS`` rows (a session's own files) Arrow's
per-call cost outweighs the rest of a parse, so both look at the values in
Python and accept a file that passes; a file that fails, or a large one,
takes the column-wide path, which decides what is dropped.
"""

from __future__ import annotations

import logging
import re

import pyarrow as pa
import pyarrow.compute as pc

from .errors import InvalidIdError
from .ids import user_from_segment, validate_id

log = logging.getLogger("storage.index")

#: Rows up to which a check reads the values in Python (measured on one-row files: 10 us instead of 35 for the
#: times, 15 us instead of 175 for the partition).
_FEW_ROWS = 64
#: Seconds since 1970 of Python's first and last datetime (years 1 and 9999), a day inside each end (time zones).
_PYTHON_SECONDS = (-62135596800 + 86400, 253402300799 - 86400)
_PER_SECOND = {"s": 1, "ms": 10**3, "us": 10**6, "ns": 10**9}


def checked(table: pa.Table) -> pa.Table:
    """``table`` when a caller can convert every value of it, else ``pyarrow.ArrowInvalid``: text that is not
    UTF-8 (the Parquet reader does not check it), a time outside Python's years 1-9999 (``to_pylist`` would
    raise ``OverflowError``)."""
    table.validate(full=True)
    for i, field in enumerate(table.schema):
        if not pa.types.is_timestamp(field.type):
            continue
        column = table.column(i)
        if column.null_count == table.num_rows:
            continue
        first, last = (s * _PER_SECOND[field.type.unit] for s in _PYTHON_SECONDS)
        if table.num_rows <= _FEW_ROWS:
            # The raw integers, without converting them to datetimes (which is what could overflow).
            ticks = [t for chunk in column.chunks for t in chunk.view(pa.int64()).to_pylist() if t is not None]
            low, high = min(ticks), max(ticks)
        else:
            lo, hi = pc.min_max(column.cast(pa.int64())).values()
            low, high = lo.as_py(), hi.as_py()
        if low < first or high > last:
            raise pa.ArrowInvalid(f"column {field.name} holds a time outside the years 1-9999")
    return table


_PARTITION = re.compile(r"^index/(?:checkpoints|sessions|table)/user=([^/]+)/(?:session=([^/]+)/)?")


def own_rows(table: pa.Table, key: str) -> pa.Table:
    """The rows of index or table file ``key`` (checkpoint or session status rows) that belong to the partition
    its key names.

    Anyone who may write one user's (or session's) partition could put rows of
    another user or session there, or a checkpoint row whose ``key`` is not
    its own checkpoint's; a reader of that partition would then follow them
    to the other's objects, or act on the other session (the supervisor). Such
    rows are dropped, with a warning. A
    ``user_id``, ``session_id``, ``checkpoint_id`` or ``key`` column that is
    not text is another schema (``ValueError``: the file is skipped).

    A checkpoint row's ``key`` is a function of its partition and its id, so
    a file without the column, or a row whose ``key`` is null, gets the key
    its checkpoint's object has: a reader never asks the store for a null key,
    nor loses a checkpoint whose object is there (it is still checked against
    the row's size and sha256).
    """
    m = _PARTITION.match(key)
    if m is None or table.num_rows == 0:
        return table
    user, session = user_from_segment(m.group(1)), m.group(2)
    objects = f"sessions/{m.group(1)}/{session}/checkpoints/"
    if session is not None and "checkpoint_id" in table.column_names:
        table = _keyed(table, objects)
    names = set(table.column_names)
    checks = [(c, v) for c, v in (("user_id", user), ("session_id", session))
              if c in names and not (c == "session_id" and v is None)]
    keyed = session is not None and {"key", "checkpoint_id"} <= names
    columns = {c: text_column(table, c) for c, _ in checks}  # ValueError for a column that is not text
    if keyed:
        columns.update(checkpoint_id=text_column(table, "checkpoint_id"), key=text_column(table, "key"))
    if table.num_rows <= _FEW_ROWS and _all_own(columns, checks, objects if keyed else None):
        return table
    keep = None
    for column, value in checks:
        col = columns[column]
        same = pc.is_null(col) if value is None else pc.fill_null(pc.equal(col, value), False)
        keep = same if keep is None else pc.and_(keep, same)
    if keyed:
        keep = pc.and_(keep, _own_keys(table, objects))
    if keep is None or pc.all(keep).as_py():
        return table
    log.warning("dropping rows of another user or session from index file %s", key)
    return table.filter(keep)


def _all_own(columns: dict[str, pa.ChunkedArray], checks: list[tuple[str, str | None]], objects: str | None) -> bool:
    """True when every row passes what :func:`own_rows`'s column-wide path checks (its values read in Python);
    False when one may not (that path then decides which rows go)."""
    for column, value in checks:
        if any(v != value for v in columns[column].to_pylist()):  # a null is None: equal only to no user
            return False
    if objects is None:
        return True
    ids = columns["checkpoint_id"].to_pylist()
    keys = columns["key"].to_pylist()
    return all(isinstance(c, str) and k == f"{objects}{c}.json" for c, k in zip(ids, keys, strict=True)) and all(
        _is_id(c) for c in set(ids))


def _keyed(table: pa.Table, prefix: str) -> pa.Table:
    """``table`` with the ``key`` of each checkpoint row that lacks one (no column, or null) filled in: the
    object of its ``checkpoint_id`` under ``prefix``."""
    if "key" in table.column_names and text_column(table, "key").null_count == 0:
        return table
    ids = text_column(table, "checkpoint_id").cast(pa.string())
    expected = pc.binary_join_element_wise(prefix, ids, ".json", "")
    if "key" not in table.column_names:
        return table.append_column("key", expected)
    keys = text_column(table, "key")
    return table.set_column(table.column_names.index("key"), "key", pc.coalesce(keys.cast(pa.string()), expected))


def _own_keys(table: pa.Table, prefix: str) -> pa.ChunkedArray:
    """Per checkpoint row: its id is valid and its ``key`` is that checkpoint's object under ``prefix``."""
    ids, keys = text_column(table, "checkpoint_id"), text_column(table, "key")
    bad = [c for c in pc.unique(ids).to_pylist() if not _is_id(c)]
    expected = pc.binary_join_element_wise(prefix, ids, ".json", "")
    same = pc.fill_null(pc.equal(keys, expected), False)
    return pc.and_(same, pc.invert(pc.is_in(ids, value_set=pa.array(bad, pa.string())))) if bad else same


def text_column(table: pa.Table, column: str) -> pa.ChunkedArray:
    """A column of ids or keys as plain strings (a compacted file dictionary-encodes some); ``ValueError`` when it
    holds anything but text."""
    col = table[column]
    if pa.types.is_dictionary(col.type):
        col = col.cast(col.type.value_type)
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_null(col.type)):
        raise ValueError(f"column {column} is {col.type}, not text")
    return col


def _is_id(value: object) -> bool:
    try:
        validate_id(value)
    except InvalidIdError:
        return False
    return True
