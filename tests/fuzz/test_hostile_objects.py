"""What the fuzzer found, one regression test each: a hostile object of each kind ends in a typed error or a
logged skip, and a row forged into one user's index never leads a reader to another user's data."""

from __future__ import annotations

import gzip
import io
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fuzz_targets import _open
from fuzz_world import OTHER_USER_MARK, SESSION, USER, world

from loomray.checkpoint_format import load_checkpoint
from loomray.control.requests import list_requests
from loomray.runtime.active import parse
from loomray.storage.chains import Pins
from loomray.storage.errors import StorageError

DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads recurses once per level: RecursionError, not ValueError


@pytest.fixture
def objects():
    return dict(world().objects)


def _key(objects, *parts):
    return next(k for k in sorted(objects) if all(p in k for p in parts))


def _rewrite(data: bytes, edit) -> bytes:
    table = edit(pq.read_table(io.BytesIO(data)))
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def test_json_nested_too_deep_is_a_skip_not_a_recursion_error(objects):
    for key in (f"sessions/{USER}/{SESSION}/lease.json", _key(objects, f"{SESSION}/pins/"),
                _key(objects, f"{SESSION}/control/"), f"active/{USER}/{SESSION}.json"):
        objects[key] = DEEP
    store = _open("memory", 0, objects, None)
    assert store.checkpoints.list(SESSION, user_id=USER)  # lease.json unreadable: its fences are not applied
    assert load_checkpoint(store, SESSION, user_id=USER) is not None
    assert Pins(store.objects).pinned(SESSION, USER) is None  # an unreadable pin protects everything
    assert len(list_requests(store, SESSION, USER)) == 1  # the other request
    assert parse(DEEP) == {}


@pytest.mark.parametrize("manifest", ["days of the wrong type", "bad deflate data"])
def test_a_hostile_table_manifest_is_a_storage_error_or_a_rebuild(objects, manifest):
    key = f"index/table/user={USER}/_manifest.json.gz"
    if manifest == "days of the wrong type":
        doc = json.loads(gzip.decompress(objects[key]))
        for state in doc["sessions"].values():
            state[1] = [5]
        objects[key] = gzip.compress(json.dumps(doc).encode())
    else:
        objects[key] = objects[key][:10] + bytes(b ^ 0x5A for b in objects[key][10:])
    store = _open("memory", 0, objects, None)
    try:
        store.compact()
    except StorageError:
        pass
    assert {r["session_id"] for r in store.query(user_id=USER).to_pylist()} >= {SESSION, "s-c"}


def test_an_index_file_of_another_users_rows_in_this_partition_is_not_read_as_this_users(objects):
    """A copy of bob's index files into alice's partitions (or a forged one like it): alice's reads never return
    bob's rows, and never fetch his objects."""
    for kind in ("checkpoints", "sessions"):
        for key in [k for k in objects if k.startswith(f"index/{kind}/user=bob/session=s-b/")]:
            objects[key.replace("user=bob/session=s-b/", f"user={USER}/session={SESSION}/")] = objects[key]
    part = _key(objects, "index/table/user=bob/day=")
    objects[part.replace("user=bob/", f"user={USER}/")] = objects[part]
    store = _open("memory", 0, objects, None)
    assert {r.user_id for r in store.checkpoints.list(SESSION, user_id=USER, limit=None)} == {USER}
    assert set(store.query(user_id=USER)["user_id"].to_pylist()) == {USER}
    assert {r.user_id for r in store.sessions.list(user_id=USER)} == {USER}
    assert OTHER_USER_MARK not in repr(load_checkpoint(store, SESSION, user_id=USER))


def test_a_checkpoint_row_whose_key_is_another_users_object_is_not_fetched(objects):
    bob = _key(objects, "sessions/bob/s-b/checkpoints/")
    for key in [k for k in objects if k.startswith(f"index/checkpoints/user={USER}/session={SESSION}/")]:
        objects[key] = _rewrite(objects[key], lambda t: t.set_column(
            t.column_names.index("key"), "key", pa.array([bob] * t.num_rows, pa.string())))
    store = _open("memory", 0, objects, None)
    fetched = []
    get = store.objects.get
    store.objects.get = lambda *, key: fetched.append(key) or get(key=key)
    assert OTHER_USER_MARK.encode() not in (store.checkpoints.get(SESSION, user_id=USER) or b"")
    assert not [k for k in fetched if k.startswith("sessions/bob/")]


def test_an_index_file_with_a_column_of_the_wrong_type_is_skipped(objects):
    key = _key(objects, f"index/sessions/user={USER}/session={SESSION}/")
    objects[key] = _rewrite(objects[key], lambda t: t.set_column(
        t.column_names.index("user_id"), "user_id", pa.array([1.5] * t.num_rows, pa.float64())))
    objects[_key(objects, "index/sessions/user=alice/session=s-c/")] = _rewrite(
        objects[_key(objects, "index/sessions/user=alice/session=s-c/")], lambda t: t.set_column(
            t.column_names.index("status"), "status", pa.array([[1]] * t.num_rows, pa.list_(pa.int64()))))
    store = _open("memory", 0, objects, None)
    assert "s-c" not in {r.session_id for r in store.sessions.list(user_id=USER)}  # its only file is skipped


@pytest.mark.parametrize("checkpoints", ["y" * 3 * 2**20, ["ckpt1"] * 100_000])
def test_a_pin_naming_more_than_a_chain_is_unreadable_at_once(objects, checkpoints):
    """A pin whose ``checkpoints`` was a 3 MB string was read one character at a time (a key built and validated
    per character: longer than the 20 s the fuzzer allows on a busy machine)."""
    key = _key(objects, f"{SESSION}/pins/")
    objects[key] = json.dumps({**json.loads(objects[key]), "checkpoints": checkpoints}).encode()
    store = _open("memory", 0, objects, None)
    began = time.monotonic()
    assert Pins(store.objects).pinned(SESSION, USER) is None  # unreadable: protects every object of the session
    assert time.monotonic() - began < 2.0


def test_session_rows_without_a_time_are_ignored_not_compared(objects):
    key = _key(objects, f"index/sessions/user={USER}/session={SESSION}/")
    objects[key] = _rewrite(objects[key], lambda t: t.set_column(
        t.column_names.index("updated_at"), "updated_at", pa.nulls(t.num_rows, t.schema.field("updated_at").type)))
    store = _open("memory", 0, objects, None)
    assert {r.session_id for r in store.sessions.list(user_id=USER)} >= {SESSION, "s-c"}  # its later rows
    store.compact()
    assert store.sessions.get(SESSION, user_id=USER) is not None


@pytest.mark.parametrize("how", ["column dropped", "nulls"])
def test_an_index_row_without_a_key_still_reads_its_own_checkpoint(objects, how):
    """Seed 934: an index file without ``key`` made a read ask the store for key ``None`` and miss a checkpoint
    whose object is there; the key is its id's object (still checked against the row's size and sha256)."""
    intact = _open("memory", 0, objects, None).checkpoints.list(SESSION, user_id=USER, limit=None)
    for key in [k for k in objects if k.startswith(f"index/checkpoints/user={USER}/session={SESSION}/")]:
        objects[key] = _rewrite(objects[key], lambda t: t.drop_columns(["key"]) if how == "column dropped" else
                                t.set_column(t.column_names.index("key"), "key", pa.nulls(t.num_rows, pa.string())))
    store = _open("memory", 0, objects, None)
    fetched = []
    get = store.objects.get
    store.objects.get = lambda *, key: fetched.append(key) or get(key=key)
    rows = store.checkpoints.list(SESSION, user_id=USER, limit=None)
    assert rows == intact
    for row in rows:
        assert load_checkpoint(store, SESSION, row.checkpoint_id, user_id=USER) is not None
    assert None not in fetched


def test_index_rows_without_an_epoch_are_dropped_not_compared(objects, caplog):
    """A row without an epoch cannot be ranked (nor fenced): dropped with a warning, never a raw TypeError."""
    first = min(k for k in objects if k.startswith(f"index/checkpoints/user={USER}/session={SESSION}/"))
    objects[first] = _rewrite(objects[first], lambda t: t.set_column(
        t.column_names.index("epoch"), "epoch", pa.nulls(t.num_rows, pa.int64())))
    store = _open("memory", 0, objects, None)
    rows = store.checkpoints.list(SESSION, user_id=USER, limit=None)
    assert rows and all(r.epoch is not None for r in rows) and "without an epoch" in caplog.text
    assert load_checkpoint(store, SESSION, user_id=USER) is not None


def test_a_table_partition_whose_text_is_not_utf8_is_unreadable_not_returned(objects):
    """Seed 325: flipped bytes in a partition's text (not UTF-8, which the Parquet reader does not check) were
    returned by ``query``, to fail only in the caller's ``to_pylist`` with a raw ``UnicodeDecodeError``."""
    key = _key(objects, f"index/table/user={USER}/day=")
    table = pq.read_table(io.BytesIO(objects[key]))
    table = table.set_column(table.column_names.index("position"), "position",
                             pa.array(["QZQZ"] * table.num_rows, pa.string()))
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="none", use_dictionary=False)
    objects[key] = sink.getvalue().replace(b"QZQZ", b"\xffZ\xfeZ")
    store = _open("memory", 0, objects, None)
    with pytest.raises(StorageError, match="unreadable table partition"):
        store.query(user_id=USER)
    store.compact()  # rebuilds the partition from the per-session index
    assert {r["session_id"] for r in store.query(user_id=USER).to_pylist()} >= {SESSION, "s-c"}


@pytest.mark.parametrize("where", ["top", "epoch"])
def test_a_fence_with_an_epoch_no_writer_writes_is_ignored(objects, where):
    """Seed 2987: a lease fence naming epoch 10**30 reached an Arrow comparison with the int64 epoch column
    (a raw ``TypeError`` from ``query`` and ``compact``); it is malformed, so it fences nothing."""
    key = f"sessions/{USER}/{SESSION}/lease.json"
    body = json.loads(objects[key])
    fence = body["checkpoints"]
    if where == "top":
        fence["top"] = [10**30, fence["top"][1]]
    else:
        fence["prev"] = [{"epoch": 10**30, "top": None}]
    objects[key] = json.dumps(body).encode()
    store = _open("memory", 0, objects, None)
    assert SESSION in set(store.query(user_id=USER)["session_id"].to_pylist())
    store.compact()
    assert store.checkpoints.list(SESSION, user_id=USER)


@pytest.mark.parametrize("kind, column", [("checkpoints", "created_at"), ("checkpoints", "written_at"),
                                          ("sessions", "updated_at")])
def test_an_index_file_with_a_time_past_year_9999_is_skipped(objects, kind, column):
    """Seed 3767: a flipped timestamp (year 146,000) made every read converting the file's rows raise a raw
    ``OverflowError``; such a file is unreadable, skipped with a warning like any corrupt one."""
    key = _key(objects, f"index/{kind}/user={USER}/session={SESSION}/")
    objects[key] = _rewrite(objects[key], lambda t: t.set_column(
        t.column_names.index(column), column, pa.array([2**62] * t.num_rows, t.schema.field(column).type)))
    store = _open("memory", 0, objects, None)
    store.checkpoints.list(SESSION, user_id=USER, limit=None)
    store.query(user_id=USER).to_pylist()
    assert {r.session_id for r in store.sessions.list(user_id=USER)} >= {"s-c"}
    store.compact()
