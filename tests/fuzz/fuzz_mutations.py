"""Seeded mutations of the objects of a store, as an attacker with write access to one user's prefix would make.

:func:`mutate` picks a kind of object (:func:`fuzz_world.kind_of`), one object of it (mostly the victim
session's or user's), and a mutation that applies to it. JSON objects are mutated as JSON (a random member of the
wrong type, a huge number, other ids, a chain no writer wrote) and *resealed*: a self-describing checkpoint gets a
valid digest again, so the reader cannot stop at the digest and has to meet the hostile value itself. Parquet
files are rewritten with a column of the wrong type, huge numbers, other ids or a hostile chain; the table
manifest is gunzipped, mutated and gzipped again.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from fuzz_world import OTHERS, SESSION, USER, World, kind_of

from loomray.storage import envelope

SEGMENT = "ckpt" + "0" * 19 + "1"
#: Chains no writer writes: 16.7 million links, one link too many, ranges backwards or across segments, a
#: chain naming the checkpoint itself (a cycle), refs that are not ids, a ref of another user's session.
HOSTILE_CHAINS = [
    [f"{SEGMENT}000000..{SEGMENT}ffffff"],
    [f"{SEGMENT}000000..{SEGMENT}{4096:06x}"],  # one link more than storage.chains.MAX_LINKS
    [f"{SEGMENT}000009..{SEGMENT}000001"],
    [f"{SEGMENT}000000..ckpt{'0' * 19}2000001"],
    [f"{SEGMENT}000000..{SEGMENT}000fff"] * 3,
    ["../../etc/passwd", "a/b/c"],
    [f"s-b/{SEGMENT}000000..{SEGMENT}000003"],
    ["x" * 5000],
    [],
]
WRONG_TYPES: list[Any] = [None, True, -1, 1.5, "x", "", [], {}, [1, "a", None], {"a": {"b": []}}]
HUGE_NUMBERS: list[Any] = [10**30, -(10**30), 2**63, 2**63 - 1, 2**53, -1, 1e308, -1e308, 99_999_999_999]
OTHER_IDS: list[Any] = ["s-c", "s-b", "bob", None, "_", "v1-session", "sess" + "0" * 26]
#: Bytes of an oversize body (a few MB: big against any real object here, small against the memory bound).
OVERSIZE = 3 * 2**20


@dataclass(frozen=True)
class Mutation:
    """What one mutation did, for the report and the replay."""

    kind: str
    target: str
    key: str
    #: Another session's or user's content was copied into the victim's reach by the mutation itself.
    brings: tuple[str, ...] = ()


def _pick_key(rng: random.Random, world: World, kind: str) -> str:
    keys = world.keys_of(kind)
    mine = [k for k in keys if f"/{USER}/{SESSION}/" in k or f"user={USER}/" in k or k.startswith(f"active/{USER}/")]
    return rng.choice(mine if mine and rng.random() < 0.75 else keys)


def mutate(rng: random.Random, world: World, objects: dict[str, bytes]) -> list[Mutation]:
    """Apply one to three mutations to ``objects`` (a copy of the world's), in place."""
    done = []
    kinds = sorted({kind_of(k) for k in world.objects} - {"other"})
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        target = rng.choice(kinds)
        key = _pick_key(rng, world, target)
        if key not in objects:
            continue
        done.append(_one(rng, world, objects, target, key))
    return done


def _one(rng: random.Random, world: World, objects: dict[str, bytes], target: str, key: str) -> Mutation:
    data = objects[key]
    parquet = target.endswith(("file", "partition"))
    kinds = ["truncate", "flip bytes", "delete", "oversize", "wrong type", "huge number", "other ids", "foreign key"]
    if target in ("checkpoint 2.0", "checkpoint index file", "table partition"):
        kinds.append("hostile chain")
    if not parquet:
        kinds.append("deep nesting")
    kind = rng.choice(kinds)
    brings: tuple[str, ...] = ()
    if kind == "truncate":
        objects[key] = data[:rng.randrange(len(data))] if data else b""
    elif kind == "flip bytes":
        raw = bytearray(data or b"\0")
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= rng.randint(1, 255)
        objects[key] = bytes(raw)
    elif kind == "delete":
        del objects[key]
    elif kind == "oversize":
        objects[key] = _oversize(rng, data, parquet)
    elif kind == "deep nesting":
        depth = rng.choice([1000, 100_000])
        objects[key] = b"[" * depth + b"]" * depth if rng.random() < 0.5 else b'{"a":' * depth + b"1" + b"}" * depth
    elif kind == "foreign key":
        brings = _foreign(rng, world, objects, target, key)
    elif parquet:
        try:
            objects[key] = _parquet(rng, data, kind)
        except Exception:  # noqa: BLE001 - a file an earlier mutation broke (names not UTF-8, say): edit its bytes
            objects[key] = data[:-1]
    else:
        objects[key] = _json(rng, data, kind, gz=target == "table manifest")
    return Mutation(kind, target, key, brings)


def _oversize(rng: random.Random, data: bytes, parquet: bool) -> bytes:
    if parquet or rng.random() < 0.3:
        return data + rng.randbytes(OVERSIZE)
    return _json_edit(data, lambda doc: _set_random(rng, doc, "y" * OVERSIZE), gz=False)


def _foreign(rng: random.Random, world: World, objects: dict[str, bytes], target: str, key: str) -> tuple[str, ...]:
    """Copy an object of the same kind from another session (of this user or another) over ``key``, or beside it
    under its own name in the victim's prefix (an index file, a checkpoint, a journal entry of another session)."""
    user, session = rng.choice(OTHERS)
    sources = [k for k in world.keys_of(target) if f"/{user}/{session}/" in k or f"user={user}/session={session}/" in k
               or f"user={user}/" in k and target.startswith("table")]
    if not sources:
        return ()
    source = rng.choice(sources)
    if rng.random() < 0.5:
        objects[key] = world.objects[source]
    else:
        dest = source.replace(f"/{user}/{session}/", f"/{USER}/{SESSION}/").replace(
            f"user={user}/session={session}/", f"user={USER}/session={SESSION}/").replace(
            f"user={user}/", f"user={USER}/")
        objects[dest] = world.objects[source]
    return (session,)


# -- JSON ------------------------------------------------------------------------------------------------------------
def _json(rng: random.Random, data: bytes, kind: str, *, gz: bool) -> bytes:
    if kind == "hostile chain":
        chain = rng.choice(HOSTILE_CHAINS + [["SELF"], ["SELF", "BASE", "SELF"]])
        return _json_edit(data, lambda doc: _chain(doc, chain), gz=gz)
    values = {"wrong type": WRONG_TYPES, "huge number": HUGE_NUMBERS, "other ids": OTHER_IDS}[kind]
    if kind == "other ids":
        return _json_edit(data, lambda doc: _ids(rng, doc, values), gz=gz)
    return _json_edit(data, lambda doc: _set_random(rng, doc, rng.choice(values)), gz=gz)


def _json_edit(data: bytes, edit: Any, *, gz: bool) -> bytes:
    """``data`` parsed, edited, and written back (resealed when it is a self-describing checkpoint); ``data``
    flipped in one byte when it does not parse."""
    try:
        doc = json.loads(gzip.decompress(data) if gz else data)
    except (ValueError, OSError, EOFError, RecursionError, zlib.error):  # an earlier mutation of this seed broke it
        return data[:-1]
    sealed = envelope.is_enveloped(data) and isinstance(doc, dict)
    if sealed:
        doc.pop("sha256", None)
    edit(doc)
    if sealed and isinstance(doc, dict) and "index" in doc:
        header = doc.pop("index")
        return envelope.wrap(json.dumps(doc).encode(), header)
    out = json.dumps(doc).encode()
    return gzip.compress(out) if gz else out


def _containers(doc: Any, depth: int = 0) -> list[tuple[Any, Any]]:
    """(container, key or index) of every member of ``doc``, to depth 6."""
    out: list[tuple[Any, Any]] = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((doc, k))
        if depth < 6:
            out.extend(_containers(v, depth + 1))
    return out


def _set_random(rng: random.Random, doc: Any, value: Any) -> None:
    members = _containers(doc)
    if members:
        container, k = rng.choice(members)
        container[k] = value


def _ids(rng: random.Random, doc: Any, values: list[Any]) -> None:
    members = [(c, k) for c, k in _containers(doc) if k in ("session_id", "user_id", "dependent", "checkpoint_id",
                                                             "run_id", "parent_checkpoint_id", "forked_from")]
    for container, k in members or _containers(doc)[:1]:
        if rng.random() < 0.6:
            container[k] = rng.choice(values)


def _chain(doc: Any, chain: list[str]) -> None:
    header = doc.get("index") if isinstance(doc, dict) else None
    if not isinstance(header, dict):
        return
    own, base = str(header.get("checkpoint_id")), doc.get("base")
    header["chain"] = [own if c == "SELF" else str(base) if c == "BASE" else c for c in chain]
    if chain and chain[-1] == "SELF":
        doc["base"] = own


# -- Parquet ---------------------------------------------------------------------------------------------------------
def _parquet(rng: random.Random, data: bytes, kind: str) -> bytes:
    try:
        table = pq.read_table(io.BytesIO(data))
        names = table.column_names
    except Exception:  # noqa: BLE001 - an earlier mutation of this seed broke the file: edit its bytes instead
        return data[:-1]
    if not names:
        return data
    n = table.num_rows
    if kind == "hostile chain" and "chain" in table.column_names:
        chain = json.dumps(rng.choice(HOSTILE_CHAINS))
        table = _replace(table, "chain", pa.array([chain] * n, pa.string()))
    elif kind == "other ids":
        name = rng.choice([c for c in ("session_id", "user_id", "key", "checkpoint_id") if c in table.column_names]
                          or table.column_names)
        value = rng.choice(["s-b", "bob", "s-c", "sessions/bob/s-b/checkpoints/x.json", "../../x", None])
        table = _replace(table, name, pa.array([value] * n, pa.string()))
    elif kind == "huge number":
        ints = [c for c in table.column_names if pa.types.is_integer(table.schema.field(c).type)]
        name = rng.choice(ints or table.column_names)
        table = _replace(table, name, pa.array([rng.choice([2**63 - 1, -(2**63), -1])] * n, pa.int64()))
    elif rng.random() < 0.3:
        table = table.drop_columns([rng.choice(table.column_names)])
    else:
        name = rng.choice(table.column_names)
        value, typ = rng.choice([("x", pa.string()), (7, pa.int64()), (None, pa.null()), (True, pa.bool_()),
                                 ([1], pa.list_(pa.int64())), (1.5, pa.float64())])
        table = _replace(table, name, pa.array([value] * n, typ))
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def _replace(table: pa.Table, name: str, column: pa.Array) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, pa.field(name, column.type), column).replace_schema_metadata(table.schema.metadata)
