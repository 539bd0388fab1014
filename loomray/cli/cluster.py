"""Commands on a Ray cluster: ``submit`` (hand a run to the store's supervisor by agent reference and return),
``status`` (from the supervisor when a cluster answers, else the store's index) and ``supervise``.

Ray is imported only inside the commands that need it.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
from typing import Any

import click
from rich.text import Text

from loomray.cli.common import (
    STATUS_STYLE,
    CliError,
    address_option,
    check_id,
    console,
    err_console,
    first_line,
    guarded,
    json_option,
    open_store_or_fail,
    store_option,
    store_url_or_fail,
    user_option,
)
from loomray.cli.output import emit_json, parse_iso, time_cells
from loomray.cli.ray_access import join_cluster, leave_cluster, placement_option, ray_get, reachable, require_address
from loomray.cli.ray_options import actor_options_flags, actor_options_from
from loomray.cli.runs import load_agent
from loomray.cli.tables import Col, fit_table
from loomray.errors import LoomrayUserError
from loomray.ids import new_id
from loomray.runtime.connection import NAMESPACE, normalize_store_url
from loomray.storage import ANY, SessionRow, Store


@click.command()
@click.argument("agent_ref", metavar="MODULE:AGENT")
@click.argument("prompt")
@click.option("--session", "session_id", default=None, help="Session id (default: a new random id, printed).")
@user_option
@store_option
@address_option
@placement_option
@actor_options_flags
@click.option("--wait", "wait", is_flag=True,
              help="Stay until the run ends and exit 0 only if it completed (what a Ray Job's entrypoint wants: "
                   "`ray job submit -- loomray submit --wait ...`). Node loss meanwhile is recovered by the "
                   "supervisor, not by this process.")
@json_option
@guarded
def submit(agent_ref: str, prompt: str, session_id: str | None, user_id: str | None, store_url: str | None,
           address: str | None, placement: str, actor_options: str | None,
           resources: str | None, runtime_env: str | None, wait: bool, as_json: bool) -> None:
    """Start a run on the cluster and return at once; the supervisor owns it from here.

    MODULE:AGENT is an importable loomray.Agent (e.g. examples.demo_agent:agent);
    every node of the cluster must be able to import it. --actor-options,
    --resources and --runtime-env are stored with the session: every later
    incarnation of it (after node loss, or adopted by a new supervisor) runs
    with them.
    """
    session_id = check_id(session_id, "session_id") or new_id("sess")
    check_id(user_id, "user_id")
    url = normalize_store_url(store_url_or_fail(store_url))
    options = actor_options_from(actor_options, resources, runtime_env)
    open_store_or_fail(url, create=True).close()  # a bad URL is a one-line error here, not in an actor
    load_agent(agent_ref)  # an unknown reference fails here, before anything reaches the cluster
    address = require_address(address)
    started = time.monotonic()
    with err_console.status(f"handing the run to the supervisor at {address} ..."):
        join_cluster(address)
        from loomray.runtime.actors import session_actor_name  # imports Ray
        from loomray.runtime.ray_runtime import RayRuntime

        runtime = RayRuntime(url, address=address, placement=placement, actor_options=options)
        # By reference only: the row keeps the reference, so any supervisor can restart the session.
        # Returns once the actor is created, whether or not the cluster has its resources free now.
        runtime.submit_sync(agent_ref, prompt, session_id=session_id, user_id=user_id)
    info: dict[str, Any] = {
        "session_id": session_id, "user_id": user_id, "agent_ref": agent_ref, "store": url, "address": address,
        "placement": placement, "actor_options": options,
        "actor": session_actor_name(url, session_id, user_id) if placement == "actor" else None,
        "submitted_in_s": round(time.monotonic() - started, 3)}
    if wait:
        _wait_for(runtime, info, as_json)
        return
    if as_json:
        emit_json(info)
        return
    console.print(f"submitted session [bold]{session_id}[/] ({agent_ref}) to {address}; it runs without this process")
    console.print(f"  follow it:  loomray status --store {url}\n"
                  f"              loomray checkpoints {session_id} --store {url}", highlight=False)


def _wait_for(runtime: Any, info: dict[str, Any], as_json: bool) -> None:
    """``submit --wait``: report the run's end; exit 1 unless it completed."""
    import asyncio

    if not as_json:
        err_console.print(f"submitted session {info['session_id']}; waiting for it to end ...", highlight=False)
    try:
        result = asyncio.run(runtime.wait(info["session_id"], user_id=info["user_id"]))
    except Exception as e:  # the run failed (or was fenced, cancelled): its error, in one line
        info.update(status="failed", error=f"{type(e).__name__}: {first_line(str(e))}")
    else:
        info.update(status=result.stop_reason, error=None, turns=result.turns, output=result.output)
    if as_json:
        emit_json(info)
    elif info["error"]:
        err_console.print(f"session {info['session_id']} failed: {info['error']}", highlight=False)
    else:
        console.print(f"session [bold]{info['session_id']}[/] ended: {info['status']}")
    if info["status"] != "completed":
        raise SystemExit(1)


def _supervisors() -> list[dict[str, Any]]:
    """Every loomray supervisor on the joined cluster (one per store): name, store, sessions watched, restarts."""
    import ray  # heavy: only when a cluster answers

    from loomray.runtime.actors import SUPERVISOR_PREFIX

    out: list[dict[str, Any]] = []
    for a in sorted(ray.util.list_named_actors(all_namespaces=True), key=lambda a: str(a.get("name"))):
        name = str(a.get("name", ""))
        if a.get("namespace") != NAMESPACE or not name.startswith(SUPERVISOR_PREFIX):
            continue
        try:
            info = ray_get(ray.get_actor(name, namespace=NAMESPACE).ready.remote(), timeout=60)
        except Exception as e:  # dying or restarting: listed, with why it did not answer
            out.append({"name": name, "store": None, "sessions": None, "restarts": None,
                        "error": first_line(str(e)) or type(e).__name__})
            continue
        out.append({"name": name, "store": info["store"], "sessions": info["sessions"],
                    "restarts": info["restarts"], "error": None})
    return out


def _live_status(address: str, store_url: str) -> tuple[list[dict[str, Any]] | None, str, list[dict[str, Any]]]:
    """The store's supervisor's view (or None and why not), and every supervisor on the cluster."""
    if not reachable(address):
        return None, f"no Ray cluster answers at {address}", []
    join_cluster(address)
    import ray  # heavy: only when a cluster answers

    from loomray.runtime.actors import supervisor_name

    supervisors = _supervisors()
    try:
        handle = ray.get_actor(supervisor_name(store_url), namespace=NAMESPACE)
    except ValueError:
        return None, f"no loomray supervisor for this store on {address} yet", supervisors
    return ray_get(handle.status.remote(), timeout=60), f"supervisor on {address}", supervisors


def _print_supervisors(supervisors: list[dict[str, Any]], store_url: str) -> None:
    """The cluster's supervisors, one line each; this store's marked."""
    cols = [Col("store"), Col("sessions", justify="right"), Col("restarts", drop=2, justify="right"),
            Col("actor", drop=1)]
    rows = [{"store": ("* " if s["store"] == store_url else "  ") + (s["store"] or f"(no answer: {s['error']})"),
             "sessions": "-" if s["sessions"] is None else str(s["sessions"]),
             "restarts": "-" if s["restarts"] is None else str(s["restarts"]), "actor": s["name"]}
            for s in supervisors]
    console.print(fit_table(cols, rows, title="supervisors on the cluster (* this store)", title_justify="left"))


def _turns(store: Store, user_id: str | None) -> dict[tuple[str | None, str], int]:
    """Latest checkpoint turn per (user, session), from one index scan."""
    table = store.query(user_id=ANY if user_id is None else user_id, columns=["user_id", "session_id", "turn"])
    out: dict[tuple[str | None, str], int] = {}
    for row in table.to_pylist():
        key = (row["user_id"], row["session_id"])
        out[key] = max(out.get(key, -1), row["turn"])
    return out


def _merged_sessions(rows: list[SessionRow], live: list[dict[str, Any]] | None, turns: dict[tuple[str | None, str], int],
                     user_id: str | None) -> list[dict[str, Any]]:
    """The index's session rows, updated with what the supervisor knows of each; newest first."""
    merged: dict[tuple[str | None, str], dict[str, Any]] = {}
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
        d.update(incarnation=s.get("incarnation"), supervised=True, live_state=s.get("status"))
        for k in ("node_id", "host", "placement", "epoch", "turn", "error"):
            if s.get(k) is not None:
                d[k] = s[k]
        if d["live_state"] == "running" or d["status"] is None:
            d["status"] = d["live_state"]
    return sorted(merged.values(), key=lambda d: str(d["updated_at"] or ""), reverse=True)


def _short_host(host: str | None) -> str:
    """A dense host as ``host/{id}``; a session actor (its own host) as ``actor``."""
    if not host:
        return "-"
    return "host/" + host.rsplit("/", 1)[-1] if host.startswith("loomray/host/") else "actor"


def _print_sessions(out: list[dict[str, Any]], supervised: bool) -> None:
    """The sessions table: only the columns that say something here, and of those as many as fit the terminal.

    Optional ones go first (``--json`` has everything); the session id, its
    status and the time are never cut.
    """
    cols = [Col("session")] + ([Col("user", drop=2)] if any(d["user_id"] for d in out) else [])
    cols += [Col("status"), Col("turn", drop=3, justify="right"), Col("epoch", drop=5, justify="right")]
    cols += [Col("restarts", drop=4, justify="right")] if supervised else []
    cols += [Col("node", drop=7)] + ([Col("host", drop=6)] if any(d.get("host") for d in out) else [])
    cols += [Col("updated"), Col("agent", drop=8)]
    updated = time_cells([parse_iso(d["updated_at"]) for d in out])
    rows = []
    for d, when in zip(out, updated, strict=False):
        st = d["status"] or "-"
        rows.append({"session": d["session_id"], "user": d["user_id"] or "-",
                     "status": Text(st, style=STATUS_STYLE.get(st, "")),
                     "turn": "-" if d["turn"] is None else str(d["turn"]),
                     "epoch": "-" if d["epoch"] is None else str(d["epoch"]),
                     "restarts": "-" if d.get("incarnation") is None else str(max(0, d["incarnation"] - 1)),
                     "node": (d["node_id"] or "-")[:8], "host": _short_host(d.get("host")),
                     "updated": when, "agent": d["agent_ref"] or "-"})
    console.print(fit_table(cols, rows, title="sessions (times UTC)", title_justify="left"))
    for d in out:
        if d["status"] == "failed" and d["error"]:
            err_console.print(f"  {d['session_id']}: {first_line(d['error'])}", highlight=False)


@click.command()
@store_option
@address_option
@click.option("--user", "user_id", default=None, help="Only this user's sessions.")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(1, 100_000),
              help="Show at most this many sessions, newest first.")
@json_option
@guarded
def status(store_url: str | None, address: str | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """Sessions and their state: from the supervisor when a cluster is reachable, else the store's index."""
    check_id(user_id, "user_id")
    url = normalize_store_url(store_url_or_fail(store_url))
    store = open_store_or_fail(url)
    rows = store.sessions.list(user_id=ANY if user_id is None else user_id)
    live: list[dict[str, Any]] | None = None
    source = "no cluster given (--address / RAY_ADDRESS)"
    supervisors: list[dict[str, Any]] = []
    if address:
        live, source, supervisors = _live_status(address, url)
    out = _merged_sessions(rows, live, _turns(store, user_id), user_id)[:limit]
    if as_json:
        emit_json({"source": "supervisor+index" if live is not None else "index", "note": source,
                   "supervisors": supervisors, "sessions": out})
        return
    if supervisors:
        _print_supervisors(supervisors, url)
    err_console.print(f"sessions from {'the ' + source + ' and ' if live is not None else ''}"
                      f"the session index of {store.describe()}"
                      + ("" if live is not None else f" ({source})"), highlight=False)
    if not out:
        console.print("no sessions")
        return
    _print_sessions(out, live is not None)


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
@click.option("--max-restarts-per-session", "max_restarts", default=20, show_default=True,
              type=click.IntRange(1, None),
              help="Starts of one session's run charged to it before it is marked failed (a shared host's "
                   "crash is not charged to the sessions it held).")
@actor_options_flags
@guarded
def supervise_cmd(store_url: str | None, address: str | None, interval: float,
                  allowed_agents: tuple[str, ...], max_restarts: int,
                  actor_options: str | None, resources: str | None, runtime_env: str | None) -> None:
    """Keep the store's supervisor alive (re-create it if it dies) until Ctrl-C; run it on the head.

    Each store has its own supervisor; any number share a cluster. Only agent
    references given with --allow-agent, or submitted to this supervisor, are
    imported for sessions it adopts from the store. --actor-options,
    --resources and --runtime-env apply to adopted sessions that did not
    store their own (a session submitted with them keeps its own).
    """
    from loomray.runtime.actors import check_pattern  # imports Ray
    from loomray.runtime.ray_runtime import supervise

    for pattern in allowed_agents:
        try:
            check_pattern(pattern)
        except LoomrayUserError as e:
            raise CliError(str(e)) from e
    url = normalize_store_url(store_url_or_fail(store_url))
    options = actor_options_from(actor_options, resources, runtime_env)
    open_store_or_fail(url, create=True).close()
    address = require_address(address)
    join_cluster(address)
    stop = threading.Event()

    def report(line: str) -> None:
        err_console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {line}", highlight=False)

    failure: list[BaseException] = []

    def keep_alive() -> None:
        try:
            supervise(url, address=address, interval_s=interval, stop=stop, report=report,
                      allowed_agents=tuple(allowed_agents), actor_options=options,
                      max_restarts_per_session=max_restarts)
        except BaseException as e:  # handed to the main thread, which reports it
            failure.append(e)

    loop = threading.Thread(target=keep_alive, name="loomray-supervise", daemon=True)
    if wait_for_stop_signal(loop):
        stop.set()
        report("stopped; the supervisor actor keeps running on the cluster")
        sys.stderr.flush()
        leave_cluster()
        return
    if failure:
        raise failure[0]


def wait_for_stop_signal(loop: threading.Thread) -> bool:
    """Start ``loop`` and wait in the main thread until it ends (False) or Ctrl-C / SIGTERM arrive (True).

    The loop runs beside the main thread, which only waits: a stop signal is seen at once wherever the loop
    is blocked inside Ray. The handlers are set here rather than relying on Python's KeyboardInterrupt,
    which a parent that ignores SIGINT (a shell's background job, some supervisors) turns off, and which
    could be raised inside whatever the main thread runs. They only append to a list: a handler that took a
    lock could find it held by the code it interrupted. SIGUSR1 prints every thread's stack, for an
    operator asking what the command is doing.
    """
    requested: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: requested.append(signum))
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    loop.start()
    while loop.is_alive() and not requested:
        loop.join(0.2)
    return bool(requested)


CLUSTER_COMMANDS: tuple[click.Command, ...] = (submit, status, supervise_cmd)
