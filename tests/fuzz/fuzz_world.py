"""The store the fuzzer mutates: a few real sessions of two users, written once per process through the public API.

``alice``'s session ``s-a`` is the one every read looks at. It has two finished runs (a chain of format-2.0
checkpoints, journal entries, run records), a fork (so ``s-a`` holds a pin), control requests, an active mark, a
compacted table and index files written after it. Beside it: ``alice``'s ``s-c`` and ``bob``'s ``s-b``, whose
transcripts carry markers that must never appear in what a read of ``s-a`` returns, and the format-1.0 session
of ``tests/fixtures/store_v1_0`` (no user).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loomray import Agent, Tuning
from loomray.control.requests import create_request, request_body
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.runtime.active import note
from loomray.storage import open_store

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "store_v1_0"
USER, SESSION = "alice", "s-a"
#: Text only ``alice``'s other session ``s-c`` holds.
SAME_USER_MARK = "MARK-ALICE-SC-7f3e"
#: Text only ``bob``'s session holds (the tenant boundary).
OTHER_USER_MARK = "MARK-BOB-SB-91c2"
OTHERS = (("alice", "s-c"), ("bob", "s-b"))


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def _agent(runtime: LocalRuntime, replies: list) -> Agent:
    return Agent("You look things up.", model=ScriptedModel(replies), tools=[lookup], runtime=runtime,
                 tuning=Tuning(checkpoint=True))


async def _populate(root: Path) -> None:
    runtime = LocalRuntime(root)
    store = runtime.store
    calls = [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(3)]
    more = [{"tool": "lookup", "args": {"key": f"m{i}"}} for i in range(2)]
    await _agent(runtime, [*calls, "first answer"]).run("research", session_id=SESSION, user_id=USER)
    await _agent(runtime, [*calls, f"{SAME_USER_MARK} answer"]).run(f"task {SAME_USER_MARK}", session_id="s-c",
                                                                      user_id="alice")
    await _agent(runtime, [*calls, f"{OTHER_USER_MARK} answer"]).run(f"task {OTHER_USER_MARK}", session_id="s-b",
                                                                       user_id="bob")
    middle = (await runtime.list_checkpoints(SESSION, user_id=USER, limit=10))[2].checkpoint_id
    await _agent(runtime, ["fork answer"] * 8).fork(SESSION, from_checkpoint=middle, prompts=["fork"], user_id=USER)
    store.compact()
    await _agent(runtime, [*calls, "first answer", *more, "second answer"]).run(
        "more", session_id=SESSION, user_id=USER)  # index files and a run after the compacted table
    for name, kind, fields in (("00000001-sig", "signal", {"text": "hello"}), ("00000002-pause", "pause", {})):
        create_request(store, SESSION, USER, name, request_body(kind, name, SESSION, USER, "api", **fields))
    for user, session in ((USER, SESSION), ("bob", "s-b")):
        store.active.put(session, user_id=user, data=note("local"))
    runtime.close()


@dataclass(frozen=True)
class World:
    """The template store's objects, by key."""

    objects: dict[str, bytes]

    def keys_of(self, kind: str) -> list[str]:
        """Keys of one kind of object (see :func:`kind_of`), sorted."""
        return sorted(k for k in self.objects if kind_of(k) == kind)


_WORLD: list[World] = []


def world() -> World:
    """The template (built once per process, in a temporary directory that is removed after)."""
    if not _WORLD:
        tmp = Path(tempfile.mkdtemp(prefix="loomray-fuzz-world-"))
        try:
            root = tmp / "store"
            shutil.copytree(FIXTURE, root)
            asyncio.run(_populate(root))
            store = open_store(root)
            _WORLD.append(World({info.key: store.objects.get(key=info.key).data
                                 for info in store.objects.list(prefix="")}))
            store.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _WORLD[0]


def kind_of(key: str) -> str:
    """Which kind of object ``key`` holds (the fuzzer covers each kind)."""
    parts = key.split("/")
    if key.startswith("index/table/"):
        return "table manifest" if key.endswith("_manifest.json.gz") else "table partition"
    if key.startswith("index/checkpoints/"):
        return "checkpoint index file"
    if key.startswith("index/sessions/"):
        return "session index file"
    if key.startswith("active/"):
        return "active mark"
    if parts[0] != "sessions" or len(parts) < 4:
        return "other"
    section = parts[3]
    if section == "checkpoints":
        return "checkpoint 1.0" if parts[2] == "v1-session" else "checkpoint 2.0"
    return {"journal": "journal entry", "runs": "run record", "lease.json": "lease", "leases": "lease copy",
            "epochs": "epoch marker", "pins": "pin", "control": "control request"}.get(section, "other")
