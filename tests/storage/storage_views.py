"""Views of a store the storage tests compare: the ids ``Store.query`` returns, and the compacted table's ids
as any Parquet reader reads its partition files."""

from __future__ import annotations

import io

import pyarrow.parquet as pq

from loomray.storage import Store


def query_ids(store: Store, session_id: str = "s1") -> list[str]:
    """The checkpoint ids ``Store.query`` returns for ``session_id`` (of no user), sorted."""
    return sorted(store.query(user_id=None, session_id=session_id)["checkpoint_id"].to_pylist())


def table_ids(store: Store) -> list[str]:
    """The checkpoint ids of the compacted table's partition files, read as any Parquet reader reads them."""
    out: list[str] = []
    for key in store.index_files("table"):
        obj = store.objects.get(key=key)
        assert obj is not None
        out += pq.read_table(io.BytesIO(obj.data))["checkpoint_id"].to_pylist()
    return sorted(out)
