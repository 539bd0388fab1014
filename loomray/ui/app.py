"""The session browser's ASGI app: pages, actions and live streams over one store.

Routes::

    GET  /                              the sessions list (filters and page in the query string)
    GET  /session/{id}?user=U           a session: transcript, events, incarnations, spend, fork tree, actions
    GET  /session/{id}/events?user=U    its live stream (server-sent events)
    GET  /session/{id}/cancel?user=U    the confirmation before a cancel
    POST /session/{id}/{action}?user=U  approve, deny, signal, pause, resume, cancel (see :mod:`loomray.ui.actions`)

Pages are rendered on the server by Jinja2 with autoescaping on, so every
string from the store (model and tool output are untrusted) reaches the
browser as text; the only script is ``/static/app.js``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from loomray.ui import actions, charts, live
from loomray.ui.listing import STATUSES, ListQuery, list_sessions
from loomray.ui.security import GuardMiddleware
from loomray.ui.session_view import read_session
from loomray.ui.state import UiState, session_of

_HERE = Path(__file__).parent
PAGE_SIZE = 50


def templates() -> Environment:
    """The page templates, every ``{{ value }}`` HTML-escaped."""
    env = Environment(loader=FileSystemLoader(_HERE / "templates"), autoescape=select_autoescape(default=True))
    env.filters["money"] = lambda v: "-" if v is None else f"${v:,.4f}"
    env.filters["when"] = lambda t: "-" if t is None else (
        t.strftime("%Y-%m-%d %H:%M:%S") if isinstance(t, datetime) else str(t))
    for name in env.list_templates(extensions=["html"]):
        env.get_template(name)  # compiled as the server starts, not in its first request
    return env


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render template ``name`` with the server's state and CSRF token."""
    state: UiState = request.app.state.ui
    body = request.app.state.templates.get_template(name).render(
        csrf=state.guard.csrf, only_user=state.only_user, store=state.store.describe(), request=request, **context)
    return HTMLResponse(body, status_code=status_code)


def _time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError as e:
        raise HTTPException(400, f"not a date or time: {value!r}") from e
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _number(value: str | None, kind: type, what: str) -> Any:
    try:
        return kind(value) if value not in (None, "") else None
    except ValueError as e:
        raise HTTPException(400, f"{what} must be a number, got {value!r}") from e


def list_query(state: UiState, params: Any) -> ListQuery:
    """The list's filters and page from the query string."""
    status = params.get("status") or None
    if status is not None and status not in STATUSES:
        raise HTTPException(400, f"unknown status {status!r}")
    page = max(1, _number(params.get("page"), int, "page") or 1)
    return ListQuery(user=state.list_user(params.get("user")), status=status, since=_time(params.get("since")),
                     until=_time(params.get("until")), min_spend=_number(params.get("min_spend"), float, "min_spend"),
                     search=params.get("q") or None, exploration=params.get("exploration") or None,
                     offset=(page - 1) * PAGE_SIZE, limit=PAGE_SIZE)


async def sessions_page(request: Request) -> Response:
    state: UiState = request.app.state.ui
    start = time.perf_counter()
    q = list_query(state, request.query_params)
    page = await asyncio.to_thread(list_sessions, state.store, q, state.tables)
    number = q.offset // PAGE_SIZE + 1
    res = render(request, "list.html", page=page, number=number, pages=max(1, -(-page.total // PAGE_SIZE)),
                 params=dict(request.query_params), statuses=STATUSES)
    # The list's own cost, for a browser's network panel and bench/ui_bench.py (no figure of the store's data).
    res.headers["server-timing"] = f"list;dur={(time.perf_counter() - start) * 1000:.1f}"
    return res


async def session_page(request: Request) -> Response:
    state, sid, user = session_of(request)
    view = await asyncio.to_thread(read_session, state.store, sid, user)
    if view is None:
        raise HTTPException(404, f"no session {sid!r}" + (f" of user {user!r}" if user else ""))
    decisions = await asyncio.to_thread(actions.decisions, state.store, sid, user)
    return render(request, "session.html", v=view, decisions=decisions, chart=charts.spend_chart(view.spend),
                  resuming=state.resumes.running(sid, user), resume_error=state.resumes.errors.get((user, sid)),
                  message=request.query_params.get("done"), error=request.query_params.get("error"))


async def session_events(request: Request) -> Response:
    state, sid, user = session_of(request)
    last = request.headers.get("last-event-id") or request.query_params.get("after") or None
    return StreamingResponse(live.stream(state, sid, user, last), media_type="text/event-stream",
                             headers={"x-accel-buffering": "no"})


async def cancel_confirm(request: Request) -> Response:
    state, sid, user = session_of(request)
    return render(request, "confirm.html", session_id=sid, user_id=user)


async def not_found(request: Request, exc: Exception) -> Response:
    code = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "error"
    return render(request, "error.html", status_code=code, code=code, detail=detail)


def create_app(state: UiState) -> Starlette:
    """The app serving ``state``'s store (wrap nothing around it: its guard is part of it)."""
    routes = [
        Route("/", sessions_page),
        Route("/session/{session_id}", session_page),
        Route("/session/{session_id}/events", session_events),
        Route("/session/{session_id}/cancel", cancel_confirm, methods=["GET"]),
        Route("/session/{session_id}/{action}", actions.act, methods=["POST"]),
        Mount("/static", StaticFiles(directory=_HERE / "static"), name="static"),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await state.resumes.close()

    app = Starlette(routes=routes, middleware=[Middleware(GuardMiddleware, guard=state.guard)],
                    exception_handlers={HTTPException: not_found}, lifespan=lifespan)
    app.state.ui = state
    app.state.templates = templates()
    return app
