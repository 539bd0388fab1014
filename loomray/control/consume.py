"""What a run consumes: the control requests of its session, looked at once per pass boundary."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from loomray.control.cancel import RunHandle
from loomray.control.requests import CANCEL, read_request
from loomray.journal import CONTROL_KINDS, JournalRecord
from loomray.loop import ControlSnapshot, ToolDecision
from loomray.session_store import SessionStore
from loomray.storage import layout
from loomray.storage.rows import JournalEntry

log = logging.getLogger("loomray.control")


class WriteRunner(Protocol):
    """Runs a store call that writes so that a cancel can wait for it to finish (a run's in-flight writes)."""

    async def run(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> object: ...


class SessionControls:
    """The control requests of one run's session, as the loop consumes them (``LoopOptions.controls``).

    ``consumed``: request names whose consumption is journaled (by the run this
    one continues or the session's last run); they are never consumed again,
    and deleted when seen. ``inflight`` runs the store calls that write (so a
    cancel can wait for them); ``journaled=False`` deletes as it consumes.
    """

    def __init__(self, store: SessionStore, session_id: str, user_id: str | None, *, consumed: Iterable[str] = (),
                 handle: RunHandle | None = None, journaled: bool = True, inflight: WriteRunner | None = None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self.consumed: set[str] = set(consumed)
        self._durable = set(self.consumed)  # journaled by an earlier incarnation: deletable on sight
        self.handle = handle
        self.journaled = journaled
        self._inflight = inflight
        self._bodies: dict[str, dict[str, Any]] = {}
        self._queue: list[str] = []  # consumed by this run, deleted once provably durable

    @property
    def cancel_requested(self) -> bool:
        """True once a cancel reached this run (:class:`RunHandle`)."""
        return self.handle is not None and self.handle.cancel_requested

    def _key(self, name: str) -> str:
        return layout.control_key(self.session_id, self.user_id, name)

    def _look(self) -> tuple[ControlSnapshot, list[str]]:
        """One LIST and the GETs of requests not read yet (runs in a worker thread)."""
        prefix = layout.control_prefix(self.session_id, self.user_id)
        names = []
        for info in self.store.objects.list(prefix=prefix):
            if info.key.endswith(".json"):
                names.append(info.key[len(prefix):-len(".json")])
        snap = ControlSnapshot()
        stale = []
        signals: list[tuple[str, str, str]] = []
        for name in names:
            if name == CANCEL:
                snap.cancelled = True
                continue
            if name in self.consumed:
                if name in self._durable:
                    stale.append(name)
                continue
            body = self._bodies.get(name)
            if body is None:
                body = read_request(self.store, self._key(name))
                if body is None:
                    continue
                self._bodies[name] = body
            kind = body.get("kind")
            if kind == "signal" and isinstance(body.get("text"), str):
                signals.append((name.split("-", 1)[-1], name, body["text"]))
            elif kind == "pause":
                snap.pauses.append(name)
            elif kind == "decision" and isinstance(body.get("call_id"), str):
                snap.decisions[body["call_id"]] = (name, ToolDecision.from_fields(body))
        snap.signals = [(name, text) for _, name, text in sorted(signals)]
        return snap, stale

    async def poll(self) -> ControlSnapshot:
        """One look at the session's requests: one LIST of ``control/`` plus one GET per request not read
        before (bodies are cached: requests are create-only). A failed look is logged and finds nothing (the
        next one retries)."""
        try:
            snap, stale = await asyncio.to_thread(self._look)
        except Exception as e:
            log.warning("control requests of session %r could not be listed: %s: %s", self.session_id,
                        type(e).__name__, e)
            return ControlSnapshot(cancelled=self.cancel_requested)
        if stale:
            await self._delete(stale)
        if self.cancel_requested:
            snap.cancelled = True
        return snap

    def consume(self, name: str) -> None:
        """``name``'s consumption was journaled: never again; delete it once that is durable."""
        self.consumed.add(name)
        self._queue.append(name)
        if not self.journaled:  # nothing records the consumption: delete now (at most once)
            self._schedule_delete()

    def _schedule_delete(self) -> None:
        names, self._queue = self._queue, []
        if names:
            asyncio.ensure_future(self._delete(names))

    def durable_mark(self) -> list[str]:
        """Requests consumed so far: durable once the checkpoint write starting now succeeds."""
        return list(self._queue)

    async def durable(self, names: list[str]) -> None:
        """A checkpoint write that re-read the lease succeeded after ``names`` were journaled: delete them."""
        done = set(names)
        self._queue = [n for n in self._queue if n not in done]
        self._durable |= done
        await self._delete(names)

    async def release(self, prove_lease: Callable[[], object] | None = None) -> None:
        """At the end of a run: delete what it consumed since its last checkpoint, after ``prove_lease()``."""
        names = list(self._queue)
        if not names:
            return
        if prove_lease is not None:
            try:
                await asyncio.to_thread(prove_lease)
            except Exception as e:  # unprovable: leave them; the next run that sees them deletes them
                log.info("control requests %s of session %r not deleted: %s", names, self.session_id, e)
                return
        await self.durable(names)

    async def _delete(self, names: list[str]) -> None:
        keys = [self._key(n) for n in names]
        try:
            if self._inflight is not None:
                await self._inflight.run(self.store.objects.delete, keys=keys)
            else:
                await asyncio.to_thread(self.store.objects.delete, keys=keys)
        except Exception as e:  # best effort: a consumed request left behind is skipped and deleted later
            log.info("control requests %s of session %r not deleted: %s", names, self.session_id, e)
        for n in names:
            self._bodies.pop(n, None)


def consumed_names(records: Iterable[JournalRecord | JournalEntry]) -> set[str]:
    """Names of the control requests whose consumption ``records`` (journal records or entries) hold."""
    return {str(r.output.get("control")) for r in records if r.kind in CONTROL_KINDS and r.output.get("control")}

