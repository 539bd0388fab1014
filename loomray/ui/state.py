"""The server's state: its store, whom it shows, its guard, and the resumes it started."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request

from loomray.cli.common import CliError
from loomray.cli.runs import agent_for, bind, runtime_for
from loomray.errors import LoomrayUserError
from loomray.storage import Store
from loomray.storage.ids import validate_id
from loomray.storage.sessions import ANY, UserFilter
from loomray.ui.listing import TableCache
from loomray.ui.security import Guard

log = logging.getLogger("loomray.ui")


class Resumes:
    """Resumes started from the page, run as tasks of the server's event loop (the page watches them live).

    A resume goes the way ``loomray resume`` goes: the agent the session
    stored a reference to, on the cluster when the server was given one,
    else in this process against the store. What a failed one raised is kept
    for the session's page.
    """

    def __init__(self) -> None:
        self.tasks: dict[tuple[str | None, str], asyncio.Task[Any]] = {}
        self.errors: dict[tuple[str | None, str], str] = {}

    def running(self, session_id: str, user_id: str | None) -> bool:
        """A resume started here still runs for this session."""
        task = self.tasks.get((user_id, session_id))
        return task is not None and not task.done()

    def start(self, state: UiState, session_id: str, user_id: str | None) -> None:
        """Load the session's agent (a mistake raises here, for the page to show), then resume in the background."""
        key = (user_id, session_id)
        if self.running(session_id, user_id):
            raise LoomrayUserError(f"session {session_id!r} is being resumed already")
        try:
            agent, ref = agent_for(session_id, user_id, state.store, None)
            bound = bind(agent, ref, runtime_for(state.store_url, state.address))
        except CliError as e:
            raise LoomrayUserError(e.format_message()) from e
        self.errors.pop(key, None)
        task = asyncio.ensure_future(bound.resume(None, session_id=session_id, user_id=user_id))
        self.tasks[key] = task
        task.add_done_callback(lambda t: self._done(key, t))

    def _done(self, key: tuple[str | None, str], task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.errors[key] = f"{type(exc).__name__}: {exc}"
            log.warning("resume of session %s failed: %s", key[1], self.errors[key])

    async def close(self) -> None:
        """Wait for the resumes still running (a server stopping lets them finish their pass: no half writes)."""
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=30)


@dataclass
class UiState:
    """What every request of one server shares."""

    store: Store
    store_url: str
    guard: Guard
    address: str | None = None
    #: The one user everything is scoped to (``--user``); None: every user.
    only_user: str | None = None
    #: How long one live stream stays open before the browser reconnects (with ``Last-Event-ID``).
    stream_s: float = 300.0
    #: Seconds between two looks at the store while streaming.
    poll_s: float = 0.5
    resumes: Resumes = field(default_factory=Resumes)
    #: The session-status table files the sessions list parsed (see :class:`TableCache`).
    tables: TableCache = field(default_factory=TableCache)

    def user_of(self, given: str | None) -> str | None:
        """The user a request may look at: the scoped one (any other is not found), else the one it names."""
        given = given or None
        if self.only_user is not None:
            if given not in (None, self.only_user):
                raise HTTPException(404, "no such session")
            return self.only_user
        if given is not None:
            try:
                validate_id(given, "user_id")
            except ValueError as e:
                raise HTTPException(400, str(e)) from e
        return given

    def list_user(self, given: str | None) -> UserFilter:
        """The user filter of the list: the scoped user, the one named, else every user."""
        if self.only_user is not None:
            return self.only_user
        return self.user_of(given) if given else ANY

    def session_id(self, given: str) -> str:
        """A session id from a URL, validated as the store validates it."""
        try:
            return validate_id(given, "session_id")
        except ValueError as e:
            raise HTTPException(400, str(e)) from e


def session_of(request: Request) -> tuple[UiState, str, str | None]:
    """The server's state, and the session and user a request names, checked as the store checks them."""
    state: UiState = request.app.state.ui
    return state, state.session_id(request.path_params["session_id"]), state.user_of(request.query_params.get("user"))
