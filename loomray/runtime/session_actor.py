"""The session actor: one Ray actor (one worker process) hosting one session's run.

``run()`` calls :func:`loomray.session.execute_request` and is idempotent: a second call joins the run in
flight, which is how a watcher re-attaches. Detached with ``max_restarts=0``: only the supervisor restarts
it (docs/design.md, "Supervisor (Ray)"). A fenced run's outcome is ``fenced``, never restarted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

import ray
from ray import cloudpickle

from loomray import control
from loomray.planning import cancelled_result
from loomray.runtime.actors import (
    NAMESPACE,
    AgentSpec,
    Outcome,
    RuntimeConfig,
    supervisor_name,
)
from loomray.runtime.loop_guard import guard_loop
from loomray.runtime.raylet_watch import node_lost, watch_raylet
from loomray.session import RunRequest, execute_request
from loomray.storage import Store
from loomray.storage.errors import LeaseLostError

log = logging.getLogger("loomray.runtime.session_actor")


def _portable(e: BaseException) -> BaseException | None:
    """``e`` if it can cross to another process (Ray pickles it), else None."""
    try:
        cloudpickle.loads(cloudpickle.dumps(e))
    except Exception:
        return None
    return e


class SessionActor:
    """Hosts one session's run. Created by the Supervisor, never restarted by Ray.

    The constructor does the cheap, failure-prone parts (store, agent, request), so a bad configuration
    fails actor creation with a clear error. With ``events_to`` (the supervisor's handle) every event is sent
    there in ordered batches, all flushed before ``run()`` returns.
    """

    def __init__(self, config: RuntimeConfig, agent: AgentSpec, request_json: str, events_to: Any = None,
                 store: Store | None = None) -> None:
        ctx = ray.get_runtime_context()
        self._node_id = ctx.get_node_id()
        self._owner = f"ray:{ctx.get_actor_id()}@{self._node_id[:12]}:{os.getpid()}"
        self._config = config
        self._agent_spec = agent
        self._agent, self._extra_tools = agent.load()
        self._request = RunRequest.model_validate_json(request_json)
        self._request_json = request_json
        # A dense host passes the store it shares among its sessions (loomray.runtime.hosts).
        self._store = config.open_store() if store is None else store
        self._task: asyncio.Task | None = None
        #: Where the run's task is: "queued" (its first step not taken), "body" (the run itself), "after"
        #: (its outcome decided; flushing). Only the body may be cancelled (see :meth:`cancel`).
        self._phase = "queued"
        self._cancel_on_entry = False
        self._started = time.time()
        self._events_to = events_to
        self._pending: list[str] = []
        self._flushing: asyncio.Task | None = None
        self._turn = 0
        self._checkpoint_turn: int | None = None
        self._epoch: int | None = None
        self._epoch_task: asyncio.Task | None = None
        self._events = 0
        #: The checkpoint the run restored (from its ``run_start`` event): the run reads it once, in
        #: ``execute_request`` after taking the lease; an unreadable one fails the run (outcome "failed", no restart).
        self._restored_turn: int | None = None
        self._restored_checkpoint_id: str | None = None

    async def run(self) -> Outcome:
        """Run (or join the run in flight) and return its outcome. Never raises for a run's failure."""
        if self._task is None:
            guard_loop(asyncio.get_running_loop())  # a loop that dies ends the process: the supervisor sees it
            # Stop and exit as soon as this node's raylet dies rather than run on for ~2 s as a zombie
            # (created first: it installs the executor the run's writes go through).
            self._watchdog = asyncio.get_running_loop().create_task(watch_raylet(self._run_tasks))
            self._task = asyncio.get_running_loop().create_task(self._execute())
        outcome = await asyncio.shield(self._task)
        if node_lost():  # stopped because this node is lost: never answer; the caller sees this actor die
            await asyncio.Event().wait()
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()  # the run is over: nothing left to stop
        return outcome

    def _run_tasks(self) -> list[asyncio.Task]:
        """The run's task, for :func:`watch_raylet` to cancel when this node is lost."""
        return [] if self._task is None else [self._task]

    async def _execute(self) -> Outcome:
        try:
            self._phase = "body"
            if self._cancel_on_entry:  # cancelled before the task's first step: its body never ran
                raise asyncio.CancelledError
            result = await execute_request(
                self._agent, self._request, self._store,
                max_checkpoints_per_session=self._config.max_checkpoints_per_session,
                extra_tools=self._extra_tools, owner=self._owner, emit=self._on_event,
                agent_ref=self._agent_spec.ref, node_id=self._node_id,
            )
            outcome = Outcome(status="completed", result_json=result.model_dump_json(), turn=result.turns,
                              stop_reason=result.stop_reason, node_id=self._node_id)
        except LeaseLostError as e:
            # A newer incarnation (or another runtime) owns the session: stop, write nothing more.
            log.warning("session %r fenced on node %s: %s", self._request.session_id, self._node_id, e)
            outcome = Outcome(status="fenced", error=str(e), error_type=type(e).__name__, exception=_portable(e),
                              node_id=self._node_id)
        except asyncio.CancelledError:
            # Only a cancel of this session stops the task here (a lost node's stop never answers): the run
            # ends as every cancelled run does, with a result saying so, not as a failure of the caller's wait.
            cancelled = cancelled_result(self._request.session_id, self._request.user_id, self._request.run_id)
            outcome = Outcome(status="completed", result_json=cancelled.model_dump_json(), stop_reason="cancelled",
                              node_id=self._node_id)
        except Exception as e:  # the run's own failure: reported, never retried (it would fail again)
            outcome = Outcome(status="failed", error=f"{type(e).__name__}: {e}", error_type=type(e).__name__,
                              exception=_portable(e), node_id=self._node_id)
        except BaseException as e:
            # SystemExit, KeyboardInterrupt, GeneratorExit from the run's own code (a model, a hook): raised on,
            # it would end this process's event loop and every run on it; it ends this run alone instead.
            outcome = Outcome(status="failed", error=f"{type(e).__name__}({e}) raised by the run",
                              error_type=type(e).__name__, node_id=self._node_id)
        self._phase = "after"
        if self._epoch_task is not None:
            await asyncio.wait([self._epoch_task], timeout=10)
        outcome.epoch = self._epoch
        if outcome.turn is None:
            outcome.turn = self._turn
        await self._flush_all()
        # Nobody may come to collect (a supervisor mid-restart): do not linger forever as a detached actor.
        self._schedule_linger()
        return outcome

    def _schedule_linger(self) -> None:
        """After the outcome: exit in ``linger_s`` unless collected first (a host overrides this)."""
        asyncio.get_running_loop().call_later(self._config.linger_s, _kill_self)

    # -- events ------------------------------------------------------------------
    async def _on_event(self, event: Any) -> None:
        self._events += 1
        self._turn = event.turn
        if event.type == "checkpoint" and event.ok:
            self._checkpoint_turn = event.turn
        if event.type == "run_start" and event.restored_checkpoint_id is not None:
            self._restored_turn, self._restored_checkpoint_id = event.turn, event.restored_checkpoint_id
        if event.type == "run_start" and self._epoch_task is None:
            # The lease was taken just before the run started; read its epoch off the loop's path.
            self._epoch_task = asyncio.get_running_loop().create_task(self._read_epoch())
        if self._events_to is not None:
            self._pending.append(event.model_dump_json())
            if self._flushing is None or self._flushing.done():
                self._flushing = asyncio.get_running_loop().create_task(self._flush())

    async def _read_epoch(self) -> None:
        try:
            self._epoch = await asyncio.to_thread(self._store.leases.current_epoch, self._request.session_id,
                                                  user_id=self._request.user_id)
        except Exception as e:  # only for status reports
            log.debug("could not read the epoch of %r: %s", self._request.session_id, e)

    async def _flush(self) -> None:
        """Send pending events in order, one batch at a time (the loop never waits for this)."""
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await self._events_to.push_events.remote(self._request.session_id, self._request.user_id, batch)
            except Exception as e:  # the driver's stream is best-effort; the run does not depend on it
                log.warning("dropped %d event(s) of %r: %s", len(batch), self._request.session_id, e)
                try:  # a supervisor re-created under its name gets the next batches
                    self._events_to = ray.get_actor(supervisor_name(self._config.store_url), namespace=NAMESPACE)
                except ValueError:
                    pass

    async def _flush_all(self) -> None:
        if self._events_to is None:
            return
        try:
            if self._flushing is not None:
                await asyncio.wait_for(asyncio.shield(self._flushing), timeout=10)
            await asyncio.wait_for(self._flush(), timeout=10)
        except asyncio.TimeoutError:
            log.warning("event stream of %r did not drain in 10 s", self._request.session_id)

    # -- queries -------------------------------------------------------------------
    async def progress(self) -> dict[str, Any]:
        """Cheap live status: passes completed, the turn of the latest checkpoint written, epoch, node."""
        return {"turn": self._turn, "checkpoint_turn": self._checkpoint_turn, "epoch": self._epoch,
                "restored_turn": self._restored_turn, "restored_checkpoint_id": self._restored_checkpoint_id,
                "node_id": self._node_id, "events": self._events,
                "finished": self._task is not None and self._task.done()}

    async def info(self) -> dict[str, Any]:
        """Where and what this incarnation is (for status and tests)."""
        return {"session_id": self._request.session_id, "user_id": self._request.user_id,
                "request_json": self._request_json,
                "node_id": self._node_id, "pid": os.getpid(), "owner": self._owner,
                "finished": self._task is not None and self._task.done(), "started": self._started}

    async def cancel(self) -> None:
        """Stop the run in flight now; the durable part of the cancel is written by whoever cancels
        (``Runtime.cancel``), this only spares the run its next look at the store."""
        if self._task is None:
            return
        handles = control.local_runs(self._store, self._request.session_id, self._request.user_id)
        for handle in handles:
            handle.request_cancel()
        if not handles:  # not registered yet (or already gone): nothing of the run may go on
            # Cancelling the task outside its body would end it with no outcome (the caller saw Ray's
            # TaskCancelledError, a "failed" run): before its first step it runs not a line of its body, and
            # after the body it is writing the outcome's last flush.
            if self._phase == "body":
                self._task.cancel()
            elif self._phase == "queued":
                self._cancel_on_entry = True

    def stop(self) -> None:
        """End this actor process once its outcome is collected.

        A forced kill, not ``exit_actor``: Ray's graceful exit keeps the process polling for seconds, taking
        CPU from a fan-out's forks still running.
        """
        close = getattr(self._store, "close", None)
        if close is not None:
            close()
        _kill_self()


def _kill_self() -> None:
    """End this actor for good (a detached actor nobody collects would live forever)."""
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


@functools.cache
def session_actor_class() -> Any:
    """``ray.remote(SessionActor)``, made once per process (each new ActorClass exports the class again)."""
    return ray.remote(SessionActor)
