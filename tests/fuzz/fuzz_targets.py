"""Every read loomray makes of a store, run against a mutated copy of the fuzz world, each checked.

A read passes when it returns (a skip is logged as a warning) or raises a documented error
(:class:`loomray.errors.LoomrayError` or :class:`storage.errors.StorageError`), and:

- it ends within :data:`READ_SECONDS` of wall-clock time and allocates at most :data:`READ_PEAK_BYTES` of
  Python memory at its peak (tracemalloc; Arrow's buffers are not traced);
- nothing is imported that is not part of Python or of loomray's own dependencies, no code is exec'd or
  compiled, nothing is unpickled, no process is started (an audit hook: ``sys.addaudithook``);
- nothing outside the store root is created or changed (local store: a canary directory beside the root);
- a read of ``alice``'s session ``s-a`` fetches no object outside ``alice``'s prefixes, and what it returns
  never holds ``bob``'s marker, nor that of ``alice``'s other session ``s-c`` (unless the mutation itself copied
  that session's object into ``s-a``'s prefix).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import threading
import time
import traceback
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from fuzz_mutations import Mutation, mutate
from fuzz_world import OTHER_USER_MARK, SAME_USER_MARK, SESSION, USER, world

from loomray import Agent, Tuning
from loomray.checkpoint_format import load_checkpoint
from loomray.control.consume import SessionControls
from loomray.control.requests import list_requests
from loomray.errors import LoomrayError
from loomray.models import ScriptedModel
from loomray.recovery import journal_records
from loomray.runtime import LocalRuntime
from loomray.runtime.active import candidates
from loomray.storage import Store, open_store
from loomray.storage.chains import Pins
from loomray.storage.errors import StorageError

#: Wall-clock seconds one read may take (generous for a busy 2-core machine: reads here take milliseconds).
READ_SECONDS = 20.0
#: Peak Python memory one read may allocate (the world is ~100 KB; an oversize body is 3 MB).
READ_PEAK_BYTES = 128 * 2**20
#: Prefixes a read of alice's session may fetch from.
ALICE = ("sessions/alice/", "index/checkpoints/user=alice/", "index/sessions/user=alice/", "index/table/user=alice/",
         "active/alice/")
_DEPENDENCIES = {"loomray", "storage", "pyarrow", "pydantic", "pydantic_core", "typing_extensions", "annotated_types",
                 "boto3", "botocore", "s3transfer", "s3fs", "fsspec", "aiobotocore", "aiohttp", "urllib3", "dateutil",
                 "jmespath", "numpy", "six", "certifi", "charset_normalizer", "idna", "multidict", "yarl",
                 "frozenlist", "aiosignal", "attr", "attrs", "wrapt", "aioitertools", "zstandard", "opentelemetry"}
_FORBIDDEN_EVENTS = {"exec", "compile", "pickle.find_class", "os.system", "subprocess.Popen", "os.exec",
                     "os.posix_spawn", "os.spawn", "os.fork", "ctypes.dlopen"}


@dataclass
class Audit:
    """What the audit hook saw while :attr:`active` (process-wide: hooks cannot be removed, so it is installed once)."""

    active: bool = False
    events: list[str] = field(default_factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if not self.active:
            return
        if event == "import":
            top = str(args[0]).split(".")[0]
            if top not in sys.stdlib_module_names and top not in _DEPENDENCIES:
                self.events.append(f"import {args[0]}")
        elif event == "exec" and getattr(args[0], "co_name", None) == "<module>" and \
                str(getattr(args[0], "co_filename", "")).endswith(".py"):
            return  # a module's body run by an import (the import event above judged it)
        elif event in _FORBIDDEN_EVENTS:
            self.events.append(f"{event} {str(args)[:200]}")


AUDIT = Audit()
sys.addaudithook(AUDIT)


@dataclass
class Outcome:
    """One read's result: how it ended, how long it took, its peak memory, what it broke."""

    read: str
    ended: str
    seconds: float
    peak: int
    violations: list[str] = field(default_factory=list)
    #: The traceback of an untyped error.
    trace: str = ""


class Recorder:
    """Records the keys a store's object layer is asked for (GET and LIST), on the instance."""

    def __init__(self, store: Store) -> None:
        self.keys: list[str] = []
        objects = store.objects
        get, listing = objects.get, objects.list

        def recorded_get(*, key: str) -> Any:
            self.keys.append(key)
            return get(key=key)

        def recorded_list(*, prefix: str) -> Any:
            self.keys.append(prefix)
            return listing(prefix=prefix)

        objects.get = recorded_get  # type: ignore[method-assign]
        objects.list = recorded_list  # type: ignore[method-assign]


def _text(value: Any) -> str:
    """``value`` as text to look for markers in; a table's text columns as their raw bytes (a Parquet file with
    flipped bytes can hold text that is not UTF-8, which ``to_pylist`` cannot decode)."""
    if isinstance(value, pa.Table):
        raw = value.cast(pa.schema([pa.field(f.name, pa.binary()) if pa.types.is_string(f.type) else
                                    pa.field(f.name, pa.int64()) if pa.types.is_timestamp(f.type) else f
                                    for f in value.schema]))
        return json.dumps(raw.to_pylist(), default=repr)
    return repr(value)


def _invalid(value: Any) -> str | None:
    """Why a table a read returned is not one its caller can use (Arrow's full validation: text that is not
    UTF-8, offsets out of range; a time Python cannot hold), None when it is, or is no table."""
    if not isinstance(value, pa.Table):
        return None
    try:
        value.validate(full=True)
        value.to_pylist()
    except (pa.ArrowException, UnicodeDecodeError, OverflowError) as e:  # a time past year 9999: OverflowError
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def _users(value: Any) -> set[Any]:
    """The ``user_id`` of every row in ``value`` (an Arrow table, or a list or tuple of rows)."""
    if isinstance(value, pa.Table):
        return set(value["user_id"].to_pylist()) if "user_id" in value.column_names else set()
    if isinstance(value, (list, tuple)):
        return {u for v in value for u in _users(v)}
    return {value.user_id} if hasattr(value, "user_id") and hasattr(value, "session_id") else set()


#: The reads that cost most (whole-store or whole-run operations); ``--costly-every`` runs them on fewer seeds.
COSTLY = ("active marks", "compact", "resume")


def reads(store: Store, checkpoint_ids: list[str]) -> list[tuple[str, bool, Callable[[], Any]]]:
    """``(name, scoped to alice's session, call)`` of every read; the ones that write come last."""
    out: list[tuple[str, bool, Callable[[], Any]]] = [
        ("list checkpoints", True, lambda: store.checkpoints.list(SESSION, user_id=USER, limit=None)),
        ("load latest", True, lambda: load_checkpoint(store, SESSION, "latest", user_id=USER)),
        ("get latest bytes", True, lambda: store.checkpoints.get(SESSION, user_id=USER)),
    ]
    for cid in checkpoint_ids:
        out.append((f"load {cid}", True, lambda cid=cid: load_checkpoint(store, SESSION, cid, user_id=USER)))
    out += [
        ("journal replay", True, lambda: [journal_records(store.journal.read(SESSION, run, user_id=USER).entries)
                                          for run in store.journal.runs(SESSION, user_id=USER)]),
        ("run records", True, lambda: (store.runs.list(SESSION, user_id=USER), store.runs.last(SESSION, user_id=USER))),
        ("control consume", True, lambda: asyncio.run(SessionControls(store, SESSION, USER).poll())),
        ("control list", True, lambda: list_requests(store, SESSION, USER)),
        ("pins", True, lambda: Pins(store.objects).pinned(SESSION, USER)),
        ("query", True, lambda: store.query(user_id=USER)),
        ("list_sessions", True, lambda: store.sessions.list(user_id=USER)),
        ("list_sessions running", False, lambda: store.sessions.list(status="running")),
        ("active marks", False, lambda: asyncio.run(candidates(store, lambda key: False, foreign=True))),
        ("lease take", True, lambda: store.leases.acquire(SESSION, user_id=USER, owner="fuzz", timeout=5.0)),
        ("compact", False, lambda: store.compact()),
        ("resume", True, lambda: _resume(store)),
    ]
    return out


def _resume(store: Store) -> Any:
    """A run that continues the session: restores the latest checkpoint, replays the journal, takes the lease
    and consumes control requests."""
    agent = Agent("You look things up.", model=ScriptedModel(["ok"] * 64), runtime=LocalRuntime(store),
                  tuning=Tuning(checkpoint=True))
    return asyncio.run(agent.resume("again", session_id=SESSION, user_id=USER))


def run_read(name: str, scoped: bool, call: Callable[[], Any], recorder: Recorder,
             allowed_marks: set[str]) -> Outcome:
    """Run one read in a thread (so a hang is seen, not waited for) and check it."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # noqa: BLE001 - every way a read ends is judged below
            box["error"] = e

    recorder.keys.clear()
    AUDIT.events.clear()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    began = time.monotonic()
    AUDIT.active = True
    worker = threading.Thread(target=body, name=f"fuzz read {name}", daemon=True)
    worker.start()
    worker.join(READ_SECONDS)
    AUDIT.active = False
    seconds = time.monotonic() - began
    peak = tracemalloc.get_traced_memory()[1] - base
    if worker.is_alive():
        return Outcome(name, "hang", seconds, peak, [f"{name}: still running after {READ_SECONDS:g} s"])
    error = box.get("error")
    ended = "ok" if error is None else type(error).__name__
    out = Outcome(name, ended, seconds, peak)
    if error is not None and not isinstance(error, (LoomrayError, StorageError)):
        where = traceback.extract_tb(error.__traceback__)[-1]
        out.violations.append(f"{name}: untyped {type(error).__name__}: {str(error)[:300]} "
                              f"(at {Path(where.filename).name}:{where.lineno})")
        out.trace = "".join(traceback.format_exception(error))
    if peak > READ_PEAK_BYTES:
        out.violations.append(f"{name}: peak memory {peak / 2**20:.0f} MiB")
    out.violations += [f"{name}: {event}" for event in AUDIT.events]
    if scoped:
        out.violations += [f"{name}: fetched {k!r}" for k in sorted(set(recorder.keys), key=str)
                           if not str(k).startswith(ALICE)]
    if "value" in box and scoped:
        out.violations += [f"{name}: returned a row of user {u!r}" for u in sorted(_users(box["value"]) - {USER}, key=repr)]
    if "value" in box and (why := _invalid(box["value"])) is not None:
        out.violations.append(f"{name}: returned a table its caller cannot read: {why}")
    if "value" in box:
        text = _text(box["value"])
        for mark in (OTHER_USER_MARK, SAME_USER_MARK):
            if mark in text and mark not in allowed_marks:
                out.violations.append(f"{name}: returned another session's content ({mark})")
    return out


def snapshot_outside(base: Path, root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``base`` but outside ``root``, with its size and mtime."""
    out = {}
    for path in base.rglob("*"):
        if path == root or root in path.parents:
            continue
        st = path.stat()
        out[str(path)] = (st.st_size, st.st_mtime_ns)
    return out


@dataclass
class SeedResult:
    """One seed: the mutations it made, each read's outcome, and every violation."""

    seed: int
    backend: str
    mutations: list[Mutation]
    outcomes: list[Outcome]
    violations: list[str]


def _open(backend: str, seed: int, objects: dict[str, bytes], base: Path,
          opener: Callable[[], Store] | None = None) -> Store:
    if opener is not None:
        store = opener()
    else:
        store = open_store(f"memory://fuzz-{seed}" if backend == "memory" else base / "store")
    for key, data in objects.items():
        store.objects.put(key=key, data=data)
    return store


_WARM: list[bool] = []


def _checkpoint_ids() -> list[str]:
    """The oldest and newest checkpoint of alice's session in the world (each read by id)."""
    ids = [k.rsplit("/", 1)[1][:-5] for k in world().keys_of("checkpoint 2.0") if f"/{USER}/{SESSION}/" in k]
    return [ids[0], ids[-1]]


def warm_up() -> None:
    """Run every read once on the unmutated world, unjudged: what a library sets up lazily on first use (a
    module it imports, a named tuple it compiles) happens here, not inside a judged read."""
    if not _WARM:
        import pyarrow.acero  # noqa: F401 - imported lazily by some Arrow operations, compiling a named tuple
        import pyarrow.dataset  # noqa: F401

        store = _open("memory", -1, dict(world().objects), Path())
        for _, _, call in reads(store, _checkpoint_ids()):
            try:
                call()
            except Exception:  # noqa: BLE001, S110 - only the side effect of a first call matters here
                pass
        store.close()
        _WARM.append(True)


def run_seed(seed: int, backend: str, base: Path, *, costly: bool = True,
             opener: Callable[[], Store] | None = None) -> SeedResult:
    """Mutate a copy of the world with ``seed`` and run every read on it (``backend``: memory or local, or any
    name with ``opener`` making the store, e.g. on S3; ``base``: an empty directory of this seed's own, beside
    which nothing may change; ``costly=False``: all reads but :data:`COSTLY`)."""
    warm_up()
    world_ = world()
    objects = dict(world_.objects)
    mutations = mutate(random.Random(seed), world_, objects)
    allowed = {OTHER_USER_MARK if "s-b" in m.brings else SAME_USER_MARK for m in mutations if m.brings}
    root = base / "store"
    (base / "outside").mkdir(parents=True, exist_ok=True)
    (base / "outside" / "canary.txt").write_text("outside the store root")
    before = snapshot_outside(base, root)
    store = _open(backend, seed, objects, base, opener)
    recorder = Recorder(store)
    outcomes: list[Outcome] = []
    for name, scoped, call in reads(store, _checkpoint_ids()):
        if not costly and name in COSTLY:
            continue
        outcomes.append(run_read(name, scoped, call, recorder, allowed))
        if outcomes[-1].ended == "hang":
            break  # the thread still runs: nothing after it would be judged fairly
    violations = [v for o in outcomes for v in o.violations]
    if outcomes[-1].ended != "hang":
        try:
            store.close()
        except Exception as e:  # noqa: BLE001 - judged like a read
            if not isinstance(e, (LoomrayError, StorageError)):
                violations.append(f"close: untyped {type(e).__name__}: {e}")
    after = snapshot_outside(base, root)
    if after != before:
        changed = sorted(set(after.items()) ^ set(before.items()))
        violations.append(f"paths outside the store root changed: {changed[:5]}")
    return SeedResult(seed, backend, mutations, outcomes, violations)
