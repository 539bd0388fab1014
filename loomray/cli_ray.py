"""Cluster-side commands: ``submit``, ``status``, ``resume``, ``fork``, ``supervise``.

- ``submit`` hands a run to the cluster's supervisor by importable agent
  reference (``module:attr``) and returns as soon as the session actor is
  created; the detached supervisor owns the run, so it goes on after this
  process exits, and the session row keeps the reference, so even a
  supervisor that dies with the actor can restart it.
- ``resume`` and ``fork`` run on the cluster given by ``--address`` /
  ``RAY_ADDRESS``; without one they run in this process against the store
  (same journal, same checkpoints, same results), which needs no cluster at all.
- ``status`` asks the supervisor when a cluster is reachable and falls back to
  the store's session index otherwise.

Ray is imported only inside the commands that need it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import click
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from loomray.cli_common import (
    CliError,
    Col,
    address_option,
    check_id,
    console,
    emit_json,
    err_console,
    first_line,
    fit_table,
    guarded,
    json_option,
    open_store_or_fail,
    store_option,
    store_url_or_fail,
    time_cells,
    user_option,
)

# --------------------------------------------------------------------- helpers


def normalize_store_url(url: str) -> str:
    """The store URL as the supervisor sees it: plain paths made absolute (actors have another cwd)."""
    return url if "://" in url else os.path.abspath(url)


def load_agent(ref: str) -> Any:
    """Import the agent at ``module:attr`` (the current directory is importable, as with uvicorn/celery)."""
    from loomray.agent import Agent
    from loomray.errors import LoomrayUserError
    from loomray.runtime.actors import resolve_ref

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = resolve_ref(ref)
    except LoomrayUserError as e:  # not importable, malformed, or not an Agent: the message names the reference
        raise CliError(first_line(str(e))) from e
    except Exception as e:  # the module raised while importing (e.g. a missing API key)
        raise CliError(f"agent reference {ref!r} failed to load: {type(e).__name__}: {first_line(str(e))}") from e
    if not isinstance(obj, Agent):
        raise CliError(f"agent reference {ref!r} names a {type(obj).__name__}, not a loomray Agent")
    return obj


def _reachable(address: str, timeout: float = 3.0) -> bool:
    """Whether something listens at ``host:port`` (so ``ray.init`` will not hang on a dead address)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return True  # "auto", "ray://..." and friends: let Ray decide
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def require_address(address: str | None) -> str:
    """The cluster address, or one clear line saying how to get one."""
    if not address:
        raise CliError("no Ray cluster given: pass --address HOST:PORT or set RAY_ADDRESS "
                       "(cluster/local.sh start prints one)")
    if not _reachable(address):
        raise CliError(f"no Ray cluster answers at {address!r}")
    return address


def connect(address: str) -> None:
    """Join the cluster quietly (Ray's INFO lines would drown the command's output)."""
    import ray

    from loomray.runtime.actors import NAMESPACE

    if not ray.is_initialized():
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


def ray_get(ref: Any, timeout: float | None = None) -> Any:
    """``ray.get`` that re-raises an actor method's own exception (not Ray's multi-line wrapper)."""
    import ray

    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


class RefLocalRuntime:
    """Factory for an in-process runtime that records the agent reference in the session rows.

    ``LocalRuntime`` writes ``agent_ref=None``; a session resumed from the CLI
    should stay resumable by reference, so this runtime passes it on.
    """

    @staticmethod
    def create(store_url: str) -> Any:
        from loomray.runtime.local import LocalRuntime
        from loomray.session import execute_request

        class _Runtime(LocalRuntime):
            async def execute(self, agent, request, *, emit=None, extra_tools=(), output_type=None):
                return await execute_request(agent, request, self.store, max_checkpoints_per_session=self.keep,
                                             emit=emit, extra_tools=extra_tools, output_type=output_type,
                                             agent_ref=getattr(agent, "loomray_ref", None))

        return _Runtime(store_url)


#: ``--placement``: how the cluster hosts the sessions a command starts (see RayRuntime).
placement_option = click.option(
    "--placement", type=click.Choice(["actor", "dense"]), default="actor", show_default=True,
    envvar="LOOMRAY_PLACEMENT",
    help="actor: one Ray actor (process) per session; dense: many sessions per host actor. Env: LOOMRAY_PLACEMENT.")


def _runtime_for(store_url: str, address: str | None, placement: str = "actor") -> Any:
    if address:
        require_address(address)
        connect(address)
        from loomray.runtime import RayRuntime

        return RayRuntime(normalize_store_url(store_url), address=address, placement=placement)
    return RefLocalRuntime.create(store_url)


def _agent_for(session_id: str, user_id: str | None, store: Any, agent_ref: str | None) -> tuple[Any, str]:
    """The agent that continues ``session_id``: ``--agent``, else the reference stored with the session."""
    row = store.get_session(session_id, user_id=user_id)
    if agent_ref is None:
        if row is None and not store.list_checkpoints(session_id, user_id=user_id, limit=1):
            raise CliError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                           + f" in {store.describe()}")
        agent_ref = row.agent_ref if row is not None else None
        if not agent_ref:
            raise CliError(f"session {session_id!r} has no stored agent reference (it was run in-process); "
                           "pass --agent module:attr")
    return load_agent(agent_ref), agent_ref


def _bind(agent: Any, ref: str, runtime: Any) -> Any:
    """A copy of ``agent`` on ``runtime`` that remembers its reference (restartable by the supervisor)."""
    from loomray.runtime.actors import set_agent_ref

    mine = copy.copy(agent)
    mine.runtime = runtime
    return set_agent_ref(mine, ref)


def _progress() -> Progress:
    # Progress goes to stderr so --json output on stdout stays parseable.
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console, transient=False)


async def _latest_turn(store: Any, session_id: str, user_id: str | None) -> int | None:
    rows = await asyncio.to_thread(store.list_checkpoints, session_id, user_id=user_id, limit=1)
    return rows[0].turn if rows else None


def _result_dict(r: Any) -> dict[str, Any]:
    cost = r.usage.cost_usd
    return {"session_id": r.session_id, "turns": r.turns, "model_calls": r.model_calls,
            "checkpoint_id": r.checkpoint_id, "resumed_from_checkpoint": r.resumed_from_checkpoint,
            "input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens, "cost_usd": cost,
            "output": r.output}


def _excerpt(text: str, n: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# --------------------------------------------------------------------- submit


@click.command()
@click.argument("agent_ref", metavar="MODULE:AGENT")
@click.argument("prompt")
@click.option("--session", "session_id", default=None, help="Session id (default: a new sess... id).")
@user_option
@store_option
@address_option
@placement_option
@json_option
@guarded
def submit(agent_ref: str, prompt: str, session_id: str | None, user_id: str | None, store_url: str | None,
           address: str | None, placement: str, as_json: bool) -> None:
    """Start a run on the cluster and return at once; the supervisor owns it from here.

    MODULE:AGENT is an importable loomray.Agent (e.g. examples.demo_agent:agent);
    every node of the cluster must be able to import it.
    """
    from loomray.ids import new_id
    from loomray.runtime.actors import session_actor_name

    session_id = check_id(session_id, "session_id") or new_id("sess")
    check_id(user_id, "user_id")
    url = normalize_store_url(store_url_or_fail(store_url))
    open_store_or_fail(url, create=True).close()  # a bad URL is a one-line error here, not in an actor
    load_agent(agent_ref)  # an unknown reference fails here, before anything reaches the cluster
    address = require_address(address)
    started = time.monotonic()
    with err_console.status(f"handing the run to the supervisor at {address} ..."):
        connect(address)
        from loomray.runtime import RayRuntime

        runtime = RayRuntime(url, address=address, placement=placement)
        # By reference only: the row keeps the reference, so any supervisor can restart the session.
        # Returns once the actor is constructed (an agent the workers cannot import fails here).
        runtime.submit_sync(agent_ref, prompt, session_id=session_id, user_id=user_id)
    info = {"session_id": session_id, "user_id": user_id, "agent_ref": agent_ref, "store": url,
            "address": address, "placement": placement,
            "actor": session_actor_name(session_id, user_id) if placement == "actor" else None,
            "submitted_in_s": round(time.monotonic() - started, 3)}
    if as_json:
        emit_json(info)
        return
    console.print(f"submitted session [bold]{session_id}[/] ({agent_ref}) to {address}; it runs without this process")
    console.print(f"  follow it:  loomray status --store {url}\n"
                  f"              loomray checkpoints {session_id} --store {url}", highlight=False)


# --------------------------------------------------------------------- status


def _live_status(address: str, store_url: str) -> tuple[list[dict[str, Any]] | None, str]:
    """The supervisor's view, or None and why not."""
    if not _reachable(address):
        return None, f"no Ray cluster answers at {address}"
    connect(address)
    import ray

    from loomray.runtime.actors import NAMESPACE, SUPERVISOR_NAME

    try:
        handle = ray.get_actor(SUPERVISOR_NAME, namespace=NAMESPACE)
    except ValueError:
        return None, f"no loomray supervisor on {address} yet"
    info = ray_get(handle.ready.remote(), timeout=60)
    if info["store"] != store_url:
        return None, f"the supervisor on {address} serves store {info['store']!r}"
    return ray_get(handle.status.remote(), timeout=60), f"supervisor on {address}"


@click.command()
@store_option
@address_option
@click.option("--user", "user_id", default=None, help="Only this user's sessions.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000))
@json_option
@guarded
def status(store_url: str | None, address: str | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """Sessions and their state: from the supervisor when a cluster is reachable, else the store's index."""
    from storage import ANY

    check_id(user_id, "user_id")
    url = normalize_store_url(store_url_or_fail(store_url))
    store = open_store_or_fail(url)
    rows = store.list_sessions(user_id=ANY if user_id is None else user_id)
    live, source = (None, "no cluster given (--address / RAY_ADDRESS)")
    if address:
        live, source = _live_status(address, url)
    turns = _turns(store, user_id)
    merged: dict[tuple[Any, str], dict[str, Any]] = {}
    for r in rows:
        merged[(r.user_id, r.session_id)] = {
            "session_id": r.session_id, "user_id": r.user_id, "status": r.status, "updated_at": r.updated_at,
            "epoch": r.epoch, "node_id": r.node_id, "agent_ref": r.agent_ref, "error": r.error,
            "turn": turns.get((r.user_id, r.session_id)), "incarnation": None, "supervised": False,
            "host": None, "placement": None}
    for s in live or []:
        if user_id is not None and s["user_id"] != user_id:
            continue
        d = merged.setdefault((s["user_id"], s["session_id"]), {
            "session_id": s["session_id"], "user_id": s["user_id"], "status": None, "updated_at": None,
            "epoch": None, "node_id": None, "agent_ref": None, "error": None, "turn": None})
        d.update(incarnation=s.get("incarnation"), supervised=True, live_state=s.get("status", s.get("state")))
        for k in ("node_id", "host", "placement", "epoch", "turn", "error"):
            if s.get(k) is not None:
                d[k] = s[k]
        if d["live_state"] == "running" or d["status"] is None:
            d["status"] = d["live_state"]
    out = sorted(merged.values(), key=lambda d: str(d["updated_at"] or ""), reverse=True)[:limit]
    if as_json:
        emit_json({"source": "supervisor+index" if live is not None else "index", "note": source, "sessions": out})
        return
    err_console.print(f"sessions from {'the ' + source + ' and ' if live is not None else ''}"
                      f"the session index of {store.describe()}"
                      + ("" if live is not None else f" ({source})"), highlight=False)
    if not out:
        console.print("no sessions")
        return
    # Only the columns that say something here, and of those as many as fit the terminal (optional ones go
    # first, --json has everything); the session id, its status and the time are never cut.
    cols = [Col("session")] + ([Col("user", drop=2)] if any(d["user_id"] for d in out) else [])
    cols += [Col("status"), Col("turn", drop=3, justify="right"), Col("epoch", drop=5, justify="right")]
    cols += [Col("restarts", drop=4, justify="right")] if live is not None else []
    cols += [Col("node", drop=7)] + ([Col("host", drop=6)] if any(d.get("host") for d in out) else [])
    cols += [Col("updated"), Col("agent", drop=8)]
    colors = {"running": "cyan", "completed": "green", "failed": "red", "pending": "yellow"}
    updated = time_cells([_as_time(d["updated_at"]) for d in out])
    rows = []
    for d, when in zip(out, updated, strict=False):
        st = d["status"] or "-"
        rows.append({"session": d["session_id"], "user": d["user_id"] or "-",
                     "status": Text(st, style=colors.get(st, "")),
                     "turn": "-" if d["turn"] is None else str(d["turn"]),
                     "epoch": "-" if d["epoch"] is None else str(d["epoch"]),
                     "restarts": "-" if d.get("incarnation") is None else str(max(0, d["incarnation"] - 1)),
                     "node": (d["node_id"] or "-")[:8], "host": _short_host(d.get("host")),
                     "updated": when, "agent": d["agent_ref"] or "-"})
    console.print(fit_table(cols, rows, title="sessions (times UTC)", title_justify="left"))
    for d in out:
        if d["status"] == "failed" and d["error"]:
            err_console.print(f"  {d['session_id']}: {first_line(d['error'])}", highlight=False)


def _as_time(value: Any) -> Any:
    """A datetime, or None (the supervisor may report times as ISO strings)."""
    if isinstance(value, str):
        from datetime import datetime

        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return value


def _short_host(host: str | None) -> str:
    """A dense host as ``host/{id}``; a session actor (its own host) as ``actor``."""
    if not host:
        return "-"
    return host.removeprefix("loomray/") if host.startswith("loomray/host/") else "actor"


def _turns(store: Any, user_id: str | None) -> dict[tuple[Any, str], int]:
    """Latest checkpoint turn per (user, session), from one index scan."""
    from storage import ANY

    table = store.query(user_id=ANY if user_id is None else user_id, columns=["user_id", "session_id", "turn"])
    out: dict[tuple[Any, str], int] = {}
    for row in table.to_pylist():
        key = (row["user_id"], row["session_id"])
        out[key] = max(out.get(key, -1), row["turn"])
    return out


# --------------------------------------------------------------------- resume and fork


async def _with_progress(work: Any, store: Any, sessions: Sequence[tuple[str, str]], user_id: str | None,
                         base_turn: int | None) -> Any:
    """Await ``work`` while showing, per session, how many passes it has checkpointed so far."""
    task = asyncio.ensure_future(work)
    with _progress() as progress:
        bars = {sid: progress.add_task(label, total=None, info="starting") for sid, label in sessions}
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            for sid, bar in bars.items():
                turn = await _latest_turn(store, sid, user_id)
                if turn is not None:
                    done = turn - (base_turn or 0)
                    progress.update(bar, info=f"turn {turn} (+{max(done, 0)})")
        for bar in bars.values():
            progress.update(bar, total=1, completed=1)
    return task.result()


@click.command()
@click.argument("session_id")
@click.argument("prompt", required=False)
@click.option("--from", "from_checkpoint", default="latest", show_default=True,
              help="Checkpoint to continue from; an older one forks into a new session.")
@click.option("--agent", "agent_ref", default=None, metavar="MODULE:AGENT",
              help="Agent to continue with (default: the one stored with the session).")
@user_option
@store_option
@address_option
@json_option
@guarded
def resume(session_id: str, prompt: str | None, from_checkpoint: str, agent_ref: str | None, user_id: str | None,
           store_url: str | None, address: str | None, as_json: bool) -> None:
    """Continue a session (on the cluster with --address, else in this process) and print the result."""
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    if from_checkpoint != "latest":
        check_id(from_checkpoint, "checkpoint_id")
    store = open_store_or_fail(store_url)
    agent, ref = _agent_for(session_id, user_id, store, agent_ref)
    runtime = _runtime_for(store_url_or_fail(store_url), address)
    bound = _bind(agent, ref, runtime)
    base = store.list_checkpoints(session_id, user_id=user_id, limit=1)
    work = bound.resume(prompt, session_id=session_id, from_checkpoint=from_checkpoint, user_id=user_id)
    result = asyncio.run(_with_progress(work, store, [(session_id, f"resume {session_id}")], user_id,
                                        base[0].turn if base else None))
    if as_json:
        emit_json(_result_dict(result))
        return
    where = "in place" if result.session_id == session_id else f"as new session {result.session_id} (a fork)"
    console.print(f"resumed {session_id} {where}: {result.turns} turns, {result.model_calls} model calls, "
                  f"checkpoint {result.checkpoint_id}", highlight=False)
    console.print(_excerpt(result.output, 600), highlight=False)


@click.command()
@click.argument("session_id")
@click.option("--from", "from_checkpoint", default="latest", show_default=True, help="Checkpoint to fork from.")
@click.option("--prompt", "prompts", multiple=True, required=True, help="One fork per --prompt.")
@click.option("--agent", "agent_ref", default=None, metavar="MODULE:AGENT",
              help="Agent to run the forks (default: the one stored with the session).")
@user_option
@store_option
@address_option
@placement_option
@json_option
@guarded
def fork(session_id: str, from_checkpoint: str, prompts: tuple[str, ...], agent_ref: str | None,
         user_id: str | None, store_url: str | None, address: str | None, placement: str, as_json: bool) -> None:
    """Fan out: one new session per --prompt, all from one checkpoint, running at once."""
    from loomray.ids import new_id
    from loomray.session import RunRequest

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    agent, ref = _agent_for(session_id, user_id, store, agent_ref)
    if from_checkpoint == "latest":
        rows = store.list_checkpoints(session_id, user_id=user_id, limit=1)
        if not rows:
            raise CliError(f"session {session_id!r} has no checkpoint to fork from")
        from_checkpoint, base_turn = rows[0].checkpoint_id, rows[0].turn
    else:
        check_id(from_checkpoint, "checkpoint_id")
        from loomray.records import load_checkpoint

        base = load_checkpoint(store, session_id, from_checkpoint, user_id=user_id)
        if base is None:
            raise CliError(f"session {session_id!r} has no checkpoint {from_checkpoint!r}")
        base_turn = base.turn
    runtime = _runtime_for(store_url_or_fail(store_url), address, placement)
    bound = _bind(agent, ref, runtime)
    # Built here (as Agent.fork does) so the new session ids are known and their progress can be shown.
    requests = [RunRequest(kind="resume", prompt=p, session_id=new_id("sess"), user_id=user_id,
                           from_checkpoint=from_checkpoint, fork_of=session_id) for p in prompts]
    labels = [(r.session_id, f"fork {i + 1}: {_excerpt(r.prompt or '', 32)}") for i, r in enumerate(requests)]
    results = asyncio.run(_with_progress(runtime.execute_many(bound, requests), store, labels, user_id, base_turn))
    if as_json:
        emit_json([{**_result_dict(r), "prompt": q.prompt, "forked_from": session_id,
                    "from_checkpoint": from_checkpoint} for r, q in zip(results, requests, strict=False)])
        return
    # The new session ids are what the next command needs: printed whole, whatever the terminal's width.
    cols = [Col("session"), Col("turns", justify="right"), Col("calls", "model calls", drop=2, justify="right"),
            Col("prompt", wrap=True, min_wrap=12), Col("output", wrap=True, drop=1)]
    rows = [{"session": r.session_id, "prompt": q.prompt or "", "turns": str(r.turns), "calls": str(r.model_calls),
             "output": _excerpt(r.output, 80)} for r, q in zip(results, requests, strict=False)]
    console.print(fit_table(cols, rows, title=f"{len(results)} forks of {session_id} from {from_checkpoint} "
                                              f"(turn {base_turn})"))


# --------------------------------------------------------------------- supervise


@click.command("supervise")
@store_option
@address_option
@click.option("--interval", default=5.0, show_default=True, type=click.FloatRange(0.1, 3600),
              help="Seconds between liveness checks of the supervisor actor.")
@click.option("--allow-agent", "allowed_agents", multiple=True, metavar="MODULE:AGENT",
              envvar="LOOMRAY_ALLOW_AGENTS",
              help="An agent reference (glob wildcards allowed, e.g. 'examples.*:agent') that sessions read from "
                   "the store may run; repeatable. Sessions with any other stored reference are refused "
                   "(marked failed). Env: LOOMRAY_ALLOW_AGENTS, space-separated.")
@guarded
def supervise_cmd(store_url: str | None, address: str | None, interval: float,
                  allowed_agents: tuple[str, ...]) -> None:
    """Keep the cluster's supervisor alive (re-create it if it dies) until Ctrl-C; run it on the head.

    Only agent references given with --allow-agent, or submitted to this
    supervisor, are imported for sessions it adopts from the store.
    """
    from loomray.errors import LoomrayUserError
    from loomray.runtime.actors import check_pattern

    for pattern in allowed_agents:
        try:
            check_pattern(pattern)
        except LoomrayUserError as e:
            raise CliError(str(e)) from e
    url = normalize_store_url(store_url_or_fail(store_url))
    open_store_or_fail(url, create=True).close()
    address = require_address(address)
    connect(address)
    from loomray.runtime.ray_runtime import supervise

    stop = threading.Event()

    def report(line: str) -> None:
        err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {line}", highlight=False)

    try:
        supervise(url, address=address, interval_s=interval, stop=stop, report=report,
                  allowed_agents=tuple(allowed_agents))
    except KeyboardInterrupt:
        stop.set()
        report("stopped; the supervisor actor keeps running on the cluster")
