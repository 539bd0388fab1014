"""The moves of the newer paths: forks and their pins, deletes, foreign index files, a corrupt lease, control.

Each factory takes the :class:`~durability_world.World` and returns the
function its thread runs (see :data:`durability_actors.ROLES`):

- ``forker``: forks the session from its oldest or newest listed checkpoint
  (the fork holds pins on the parent's chain); with ``crash`` the fork's
  process dies at its first model call, before its first checkpoint;
- ``fork_resumer``: re-issues each crashed fork's request, as a retry would;
- ``deleter``: ``delete_checkpoint`` of the newest, middle or oldest listed
  checkpoint, through the very ``Store`` a writer ran with (or a fresh one);
- ``planter``: puts a foreign Parquet file into the session's index partition;
- ``corrupter``: overwrites ``lease.json`` with bytes no reader can parse;
- ``controller``: budgets and pauses across runs, checkpoints on or off, in
  a session of its own; what it finds wrong goes to ``world.control``.
"""

from __future__ import annotations

import asyncio
import io
import traceback
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from durability_views import fork_agent
from durability_world import World

from loomray import Agent, Tuning
from loomray.checkpoint_format import load_checkpoint
from loomray.control import request_pause
from loomray.models import ModelResponse
from loomray.records import Message, ToolCall, Usage
from loomray.session import RunRequest, execute_request
from loomray.storage import layout
from loomray.storage.errors import StorageError, TransientStorageError
from loomray.storage.faults import ActorCrashed


class _CrashAtFirstCall:
    """A fork's model whose process dies at the first call (before the fork's first checkpoint)."""

    name = "scripted-crash"

    async def complete(self, request: Any) -> ModelResponse:
        raise ActorCrashed("the fork's process died before its first checkpoint")


def forker(world: World, name: str, pick: str = "oldest", crash: bool = True):
    spec = world.spec

    def fn() -> None:
        store = world.new_store()
        world.stores.append(store)
        rec: dict[str, Any] = {"actor": name, "crash": crash, "cid": None, "outcome": None, "resumed": None}
        world.forks.append(rec)
        try:
            rows = store.checkpoints.list(spec.session_id, user_id=spec.user_id, limit=None)
            if not rows:
                rec["outcome"] = "nothing to fork"
                return
            cid = (rows[-1] if pick == "oldest" else rows[0]).checkpoint_id
            rec["cid"] = cid
            rec["messages"] = load_checkpoint(store, spec.session_id, cid, user_id=spec.user_id).messages
        except (StorageError, Exception) as e:  # a read the faults broke: no fork
            rec["outcome"] = f"{type(e).__name__}: {e}"
            return
        rec["request"] = RunRequest(kind="resume", prompt="fork", session_id=f"fork-{name}-{spec.session_id}",
                                    user_id=spec.user_id, from_checkpoint=cid, fork_of=spec.session_id)
        agent = (Agent("Fork.", model=_CrashAtFirstCall(), tools=[], tuning=Tuning(checkpoint=True, journal=True),
                       name="fork-agent") if crash else fork_agent())
        try:
            asyncio.run(execute_request(agent, rec["request"], store, owner=name))
            rec["outcome"] = "ok"
        except ActorCrashed:
            rec["outcome"] = "crashed"
        except Exception as e:
            rec["outcome"] = f"{type(e).__name__}: {e}"
    return fn


def fork_resumer(world: World, name: str):
    """Re-issue every crashed fork's request (a new process), once no other actor runs."""
    spec = world.spec

    def fn() -> None:
        store = world.new_store()
        world.stores.append(store)
        for rec in world.forks:
            if rec["outcome"] != "crashed":
                continue
            try:
                asyncio.run(execute_request(fork_agent(), rec["request"], store, owner=name))
                got = load_checkpoint(store, rec["request"].session_id, "latest", user_id=spec.user_id)
                same = got is not None and got.messages[:len(rec["messages"])] == rec["messages"]
                rec["resumed"] = "ok" if same else "ok, but the transcript is not the fork point's"
            except Exception as e:
                # A load that met an injected transient fault raises a typed error (CheckpointException, the fault
                # as its cause): the caller retries, nothing is lost. Only another failure breaks the promise.
                transient = isinstance(e, TransientStorageError) or isinstance(e.__cause__, TransientStorageError)
                rec["resumed"] = f"transient: {e}" if transient else f"{type(e).__name__}: {e}"
    return fn


def deleter(world: World, name: str, pick: str = "newest", own: str | None = "holder"):
    """``delete_checkpoint`` through the store writer ``own`` ran with (None: a freshly opened store)."""
    spec = world.spec

    def fn() -> None:
        incs = [i for i in world.incarnations if i.actor == own and i.store is not None]
        store = incs[-1].store if incs else world.new_store()
        if not incs:
            world.stores.append(store)
        try:
            rows = store.checkpoints.list(spec.session_id, user_id=spec.user_id, limit=None)
        except StorageError as e:
            world.deletes.append((name, "", f"list failed: {e}"))
            return
        if not rows:
            return
        forked = [f["cid"] for f in world.forks if f["cid"]]
        cid = {"newest": rows[0], "middle": rows[len(rows) // 2], "oldest": rows[-1]}.get(pick, rows[0]).checkpoint_id
        cid = forked[0] if pick == "forked" and forked else cid
        world.deletes.append((name, cid, "started"))
        try:
            outcome = f"ok {store.checkpoints.delete(spec.session_id, cid, user_id=spec.user_id)}"
        except StorageError as e:
            outcome = f"{type(e).__name__}: {e}"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
            world.unexpected.append((name, traceback.format_exc()))
        world.deletes[-1] = (name, cid, outcome)
    return fn


def planter(world: World, name: str, where: str = "checkpoints"):
    """A foreign Parquet file (a user's export, another tool's output) in the session's index partition."""
    spec = world.spec

    def fn() -> None:
        buf = io.BytesIO()
        pq.write_table(pa.table({"note": ["not an index file"], "n": [1]}), buf)
        prefix = layout.CHECKPOINT_INDEX if where == "checkpoints" else layout.SESSION_INDEX
        key = layout.index_partition(prefix, spec.session_id, spec.user_id) + "foreign-export.parquet"
        try:
            world.faulty.put(key=key, data=buf.getvalue())
            world.vandalism.append((name, world.faulty.call_count))
        except TransientStorageError:
            pass
    return fn


def corrupter(world: World, name: str):
    """Overwrite the session's ``lease.json`` with bytes no reader can parse (a bad tool, a half-copied object)."""
    spec = world.spec

    def fn() -> None:
        key = layout.lease_key(spec.session_id, spec.user_id)
        try:
            world.faulty.put(key=key, data=b"{not a lease")
            world.corruptions.append(world.faulty.call_count)
        except TransientStorageError:
            pass
    return fn


class _Billed:
    """A model that asks for the ``noop`` tool on every call (``stop`` calls, then it is done), each call billed
    ``cost`` USD, and counts its calls."""

    name = "scripted-billed"

    def __init__(self, cost: float, stop: int = 10**6) -> None:
        self.cost, self.stop, self.calls = cost, stop, 0

    async def complete(self, request: Any) -> ModelResponse:
        self.calls += 1
        usage = Usage(input_tokens=1, output_tokens=1, requests=1, cost_usd=self.cost)
        if self.calls > self.stop:
            return ModelResponse(message=Message(role="assistant", content="done"), usage=usage)
        call = ToolCall(id=f"c{self.calls}", name="noop", arguments={})
        return ModelResponse(message=Message(role="assistant", content="", tool_calls=[call]), usage=usage)


def controller(world: World, name: str, what: str = "budget", checkpoint: bool = True):
    """Budgets (a stopped session gets no fresh budget) or pauses (resume continues) across runs."""
    spec = world.spec
    sid = f"ctl-{what}-{'on' if checkpoint else 'off'}-{spec.session_id}"

    def fn() -> None:
        store = world.new_store()
        world.stores.append(store)
        try:
            (_budget if what == "budget" else _pause)(world, store, sid, checkpoint)
        except (StorageError, Exception) as e:  # injected faults may stop a run: no finding then
            world.spec.notes.append(f"{name}: {type(e).__name__}: {e}")
    return fn


def _budget(world: World, store: Any, sid: str, checkpoint: bool) -> None:
    model = _Billed(0.001)

    def noop() -> str:
        """Do nothing."""
        return "ok"

    agent = Agent("Spend.", model=model, tools=[noop], name="budget-agent",
                  tuning=Tuning(checkpoint=checkpoint, journal=True, max_cost_usd=0.0025, max_turns=40))
    uid = world.spec.user_id
    first = asyncio.run(execute_request(agent, RunRequest(prompt="spend", session_id=sid, user_id=uid), store))
    billed = model.calls
    second = asyncio.run(execute_request(agent, RunRequest(prompt="spend more", session_id=sid, user_id=uid), store))
    if first.stop_reason == "budget_exceeded" and model.calls > billed:
        world.control.append(("budget-carried", f"{sid} (checkpoint={checkpoint}): stopped by budget_exceeded after "
                                                f"{billed} model calls, the next run made {model.calls - billed} more "
                                                f"(stop_reason {second.stop_reason!r}): the budget started afresh"))


def _pause(world: World, store: Any, sid: str, checkpoint: bool) -> None:
    uid = world.spec.user_id
    asked: list[str | None] = []

    def noop() -> str:
        """Ask once for a pause."""
        if not asked:
            asked.append(request_pause(store, sid, uid))
        return "ok"

    agent = Agent("Pause.", model=_Billed(0.0, stop=3), tools=[noop], name="pause-agent",
                  tuning=Tuning(checkpoint=checkpoint, journal=True, max_turns=40))
    first = asyncio.run(execute_request(agent, RunRequest(prompt="work", session_id=sid, user_id=uid), store))
    if first.stop_reason != "paused":
        return
    again = asyncio.run(execute_request(agent, RunRequest(kind="resume", session_id=sid, user_id=uid), store))
    if again.stop_reason == "paused":
        world.control.append(("pause-consumed", f"{sid} (checkpoint={checkpoint}): resume() after a pause returned "
                                                f"'paused' again"))
