"""The ``loomray`` command line.

Store-side commands (``checkpoints`` [``quarantine``], ``show``, ``query``,
``prune``, ``compact``, ``lease repair``, ``tree``, ``timeline``, and the
steering commands ``approve``, ``deny``, ``signal``, ``pause``, ``cancel``,
``logs``, which write or read control objects and the journal in the store,
so they need no cluster) live here
(the tree and timeline views in :mod:`loomray.cli_views`); cluster commands (``submit``, ``status``, ``resume``,
``fork``, ``supervise``) in :mod:`loomray.cli_ray`; ``demo`` in
:mod:`loomray.demo`. Every command takes ``--store URL`` (or
``LOOMRAY_STORE``) and, where a cluster is involved, ``--address`` (or
``RAY_ADDRESS``). ``--json`` prints machine-readable output. A user mistake
prints one line on stderr and exits 2; a failed run exits 1; neither prints a
traceback (``LOOMRAY_DEBUG=1`` does).

Output: tables fit the terminal's width (optional columns are dropped, ids,
statuses and times are never cut); ``--json`` times are ISO 8601 with the
"T" and a zone, dollars are rounded to 6 decimals. Long commands (``query``,
``prune``, ``compact``) report progress on stderr when it is a terminal, or
with ``--progress``.
"""

from __future__ import annotations

import os

# Ray reads this once, when first imported: bind to 127.0.0.1 for a user who runs `loomray demo` directly.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import json  # noqa: E402
import sys  # noqa: E402
from datetime import datetime  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402
from rich.text import Text  # noqa: E402

from loomray.cli_common import (  # noqa: E402
    Activity,
    CliError,
    Col,
    check_id,
    console,
    emit_json,
    err_console,
    first_line,
    fit_columns,
    fit_table,
    guarded,
    iso_time,
    iter_progress,
    json_option,
    money,
    open_store_or_fail,
    parse_time,
    plain_cell,
    print_records,
    progress_option,
    row_dict,
    short_time,
    sql_to_arrow,
    stdin_is_tty,
    store_option,
    time_cells,
    user_option,
)
from storage.table import staleness  # noqa: E402

_STATUS_STYLE = {"running": "cyan", "completed": "green", "failed": "red", "pending": "yellow", "active": "cyan",
                 "awaiting_approval": "magenta", "paused": "yellow", "cancelled": "red"}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loomray")
def main() -> None:
    """loomray: durable long-running LLM agent sessions on Ray."""


# --------------------------------------------------------------------- store-only commands


class _ListByDefault(click.Group):
    """A group whose first argument, unless it names a subcommand, goes to its ``list`` subcommand.

    So ``loomray checkpoints SESSION`` keeps listing, and ``loomray checkpoints
    quarantine SESSION CKPT`` runs the subcommand (``loomray checkpoints list
    quarantine`` lists a session named "quarantine").
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_ListByDefault)
def checkpoints() -> None:
    """A session's checkpoints: list (the default) or quarantine.

    ``loomray checkpoints SESSION`` lists them, newest first;
    ``loomray checkpoints quarantine SESSION CKPT`` moves a bad one aside.
    """


@checkpoints.command("list")
@click.argument("session_id")
@store_option
@user_option
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@json_option
@guarded
def checkpoints_list(session_id: str, store_url: str | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """List a session's checkpoints, newest first."""
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    rows = store.list_checkpoints(session_id, user_id=user_id, limit=limit)
    if not rows and not session_exists(store, session_id, user_id):
        raise CliError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                       + f" in {store.describe()}")
    if as_json:
        emit_json([row_dict(r) for r in rows])
        return
    if not rows:
        err_console.print(f"session {session_id!r} has no checkpoints (it ran without checkpointing)")
        return
    # Optional columns go first when the terminal is narrow (--json has everything); ids, statuses and
    # times are never cut: the id is what people copy into the next command.
    cols = [Col("checkpoint"), Col("turn", justify="right"), Col("status"), Col("created", drop=2),
            Col("cost", drop=3, justify="right"), Col("tokens", drop=4, justify="right"),
            Col("epoch", drop=5, justify="right"), Col("after", drop=6), Col("messages", drop=7, justify="right")]
    created = time_cells([r.created_at for r in rows])
    cells = [{"checkpoint": r.checkpoint_id, "turn": str(r.turn), "after": r.position.removeprefix("after_"),
              "status": Text(r.execution_status, style=_STATUS_STYLE.get(r.execution_status, "")),
              "messages": str(r.message_count), "tokens": str(r.input_tokens + r.output_tokens),
              "cost": money(r.cost_usd), "epoch": str(r.epoch), "created": t} for r, t in zip(rows, created, strict=False)]
    console.print(fit_table(cols, cells, title=f"checkpoints of {session_id} (times UTC)"))


@checkpoints.command("quarantine")
@click.argument("session_id")
@click.argument("checkpoint_id")
@store_option
@user_option
@json_option
@guarded
def checkpoints_quarantine(session_id: str, checkpoint_id: str, store_url: str | None, user_id: str | None,
                           as_json: bool) -> None:
    """Move a bad checkpoint aside (to the session's quarantine/) and retire its index row.

    "latest" and listings no longer see it; the bytes stay for inspection.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    check_id(checkpoint_id, "checkpoint_id")
    store = open_store_or_fail(store_url)
    moved = store.quarantine_checkpoint(session_id, checkpoint_id, user_id=user_id)
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "checkpoint_id": checkpoint_id,
                   "quarantine_key": moved})
        return
    where = f"bytes moved to {store.describe(moved)}" if moved else "its object was already gone"
    console.print(f"checkpoint {checkpoint_id} of session {session_id} quarantined: {where}; "
                  "its index row is retired", highlight=False, soft_wrap=True)


@main.command()
@click.argument("session_id")
@click.argument("checkpoint_id", default="latest")
@store_option
@user_option
@click.option("--messages/--no-messages", default=True, help="Print the transcript.")
@json_option
@guarded
def show(session_id: str, checkpoint_id: str, store_url: str | None, user_id: str | None,
         messages: bool, as_json: bool) -> None:
    """Show one checkpoint (default: the latest) with its transcript."""
    from loomray.errors import CheckpointException
    from loomray.records import Checkpoint
    from storage.errors import InvalidIdError, StorageError

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    if checkpoint_id != "latest":
        check_id(checkpoint_id, "checkpoint_id")
    store = open_store_or_fail(store_url)
    try:
        raw = store.get_checkpoint(session_id, checkpoint_id, user_id=user_id)
    except InvalidIdError:
        raise
    except StorageError as e:  # what the API raises for any failed load, with the storage error as its cause
        raise CheckpointException(f"checkpoint {checkpoint_id!r} of session {session_id!r} could not be loaded: "
                                  f"{type(e).__name__}: {e}") from e
    if raw is None:
        what = "unknown session" if not session_exists(store, session_id, user_id) else f"no checkpoint {checkpoint_id!r} for session"
        raise CliError(f"{what} {session_id!r}" + (f" of user {user_id!r}" if user_id else ""))
    ckpt = Checkpoint.from_json(raw)
    if as_json:
        click.echo(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        return
    u = ckpt.cumulative_usage
    cost = "cost unknown" if u.cost_usd is None else money(u.cost_usd)
    console.print(
        f"[bold]{ckpt.session_id}[/] {ckpt.checkpoint_id}  turn {ckpt.turn}  {ckpt.position}  "
        f"{ckpt.execution_status}  {len(ckpt.messages)} messages  "
        f"{u.input_tokens}+{u.output_tokens} tokens  {cost}"
        + (f"  forked from {ckpt.forked_from}" if ckpt.forked_from else "")
    )
    if messages:
        for m in ckpt.messages:
            text = m.content if len(m.content) <= 400 else m.content[:400] + " ..."
            calls = "".join(f"\n    -> {c.name}({json.dumps(c.arguments)[:120]})" for c in m.tool_calls)
            console.print(f"[cyan]{m.role}[/]: {text}{calls}", highlight=False)


#: The default ``query`` view: (index column, header, drop rank); rank 0 columns always show.
_QUERY_VIEW = [("session_id", "session", 0), ("user_id", "user", 3), ("checkpoint_id", "checkpoint", 0),
               ("turn", "turn", 0), ("execution_status", "status", 0), ("created_at", "created", 1),
               ("cost_usd", "cost", 2), ("tokens", "tokens", 4), ("epoch", "epoch", 5), ("position", "after", 6),
               ("message_count", "messages", 7)]
_RIGHT = {"turn", "cost_usd", "tokens", "epoch", "message_count"}


@main.command()
@click.argument("sql", required=False)
@store_option
@click.option("--user", "user_id", default=None)
@click.option("--session", "session_id", default=None)
@click.option("--status", default=None, type=click.Choice(["active", "completed", "awaiting_approval", "paused"]))
@click.option("--since", default=None, help="ISO-8601 time.")
@click.option("--until", default=None, help="ISO-8601 time.")
@click.option("--min-cost", type=float, default=None)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--columns", default=None, metavar="A,B,...",
              help="Index columns to show, comma-separated (default: the ones that matter that fit the terminal).")
@progress_option
@json_option
@guarded
def query(sql: str | None, store_url: str | None, user_id: str | None, session_id: str | None,
          status: str | None, since: str | None, until: str | None, min_cost: float | None,
          limit: int, columns: str | None, show_progress: bool, as_json: bool) -> None:
    """Query the checkpoint index across sessions.

    Without SQL, prints the live checkpoint rows matching the filters: by
    default session, checkpoint, turn, status, created time and cost, as many
    as fit the terminal (``--columns`` picks others, ``--json`` has all). With
    SQL (DuckDB over Arrow), the filtered rows are the table ``checkpoints``
    and the latest status row of each session is the table ``sessions``, e.g.
    ``loomray query "select session_id, max(turn) from checkpoints group by 1"``.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    if sql and columns:
        raise CliError("--columns applies to the default view; with SQL, select the columns in the query")
    kwargs: dict[str, Any] = dict(session_id=session_id, status=status, since=parse_time(since),
                                  until=parse_time(until), min_cost=min_cost)
    if user_id is not None:
        kwargs["user_id"] = user_id
    with Activity("query", show_progress) as activity:
        store = open_store_or_fail(store_url)
        activity.step("reading the checkpoint index")
        table = store.query(**kwargs)
        stale = staleness(table)
        if sql:
            try:
                import duckdb
            except ImportError as e:
                raise CliError("SQL queries need DuckDB: pip install 'loomray[query]'") from e
            activity.step(f"running SQL over {table.num_rows} checkpoint rows")
            con = duckdb.connect()
            con.register("checkpoints", table)
            con.register("sessions", sessions_table(store, user_id))
            try:
                table = sql_to_arrow(con, sql)
            except duckdb.Error as e:
                raise CliError(f"SQL error: {first_line(str(e))}") from e
            finally:
                con.close()
        table = table.slice(0, limit)
        activity.step(f"formatting {table.num_rows} rows")
        rows = table.to_pylist()
    if as_json:
        emit_json(rows)
        return
    title = f"{len(rows)} rows"
    if sql:
        _print_result(table.column_names, rows, title)
    elif columns:
        wanted = [c.strip() for c in columns.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in table.column_names]
        if unknown or not wanted:
            raise CliError(f"unknown column(s) {', '.join(unknown) or '(none given)'}; the index has: "
                           + ", ".join(table.column_names))
        _print_result(wanted, rows, title)
    else:
        _print_checkpoint_rows(rows, title)
    if stale is not None:
        console.print(f"[dim]{stale.describe()}[/dim]")


def _print_result(names: list[str], rows: list[dict[str, Any]], title: str) -> None:
    """Query results as a table when they fit the terminal, else one block per row (never cut with "…")."""
    cols = [Col(n, justify="right" if rows and isinstance(rows[0].get(n), (int, float)) else "left") for n in names]
    times = {n: time_cells([r.get(n) for r in rows]) for n in names
             if rows and all(isinstance(r.get(n), datetime) or r.get(n) is None for r in rows)
             and any(r.get(n) is not None for r in rows)}
    cells = [{n: times[n][i] if n in times else plain_cell(r.get(n), n) for n in names} for i, r in enumerate(rows)]
    _, fits = fit_columns(cols, cells)
    if fits or not rows:
        console.print(fit_table(cols, cells, title=title))
    else:
        print_records([{n: plain_cell(r.get(n), n) for n in names} for r in rows], title=title)


def _print_checkpoint_rows(rows: list[dict[str, Any]], title: str) -> None:
    """The default ``query`` view: the columns that matter, as many as fit; ids, statuses, times whole."""
    created = time_cells([r["created_at"] for r in rows])
    cells = []
    for r, t in zip(rows, created, strict=False):
        cells.append({"session_id": r["session_id"], "user_id": r["user_id"] or "-",
                      "checkpoint_id": r["checkpoint_id"], "turn": str(r["turn"]),
                      "execution_status": Text(r["execution_status"],
                                               style=_STATUS_STYLE.get(r["execution_status"], "")),
                      "created_at": t, "cost_usd": money(r["cost_usd"]),
                      "tokens": str((r["input_tokens"] or 0) + (r["output_tokens"] or 0)), "epoch": str(r["epoch"]),
                      "position": (r["position"] or "").removeprefix("after_"),
                      "message_count": str(r["message_count"])})
    cols = [Col(k, h, drop=d, justify="right" if k in _RIGHT else "left") for k, h, d in _QUERY_VIEW]
    owners = {(r["user_id"], r["session_id"]) for r in rows}
    if len(owners) == 1:  # one session: say it once, in the title
        (uid, sid), = owners
        title += f" of session {sid}" + (f" (user {uid})" if uid else "")
        cols = [c for c in cols if c.key not in ("session_id", "user_id")]
    elif not any(r["user_id"] for r in rows):
        cols = [c for c in cols if c.key != "user_id"]
    title += " (times UTC)"
    _, fits = fit_columns(cols, cells)
    if not fits and any(c.key == "session_id" for c in cols):
        # Two long ids side by side do not fit: stack them in one column, each whole on its own line.
        for cell in cells:
            cell["ids"] = Text(f"{cell['session_id']}\n{cell['checkpoint_id']}")
        cols = [Col("ids", "session / checkpoint")] + [c for c in cols if c.key not in ("session_id", "checkpoint_id")]
        _, fits = fit_columns(cols, cells)
    if fits or not rows:
        console.print(fit_table(cols, cells, title=title))
    else:
        print_records([{c.title: (cell[c.key].plain if isinstance(cell[c.key], Text) else cell[c.key])
                        for c in cols} for cell in cells], title=title)


@main.command()
@store_option
@click.option("--before", default=None, help="Only what was created before this ISO-8601 time.")
@click.option("--session", "session_id", default=None)
@click.option("--user", "user_id", default=None)
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--yes", is_flag=True,
              help="Delete without asking. Without it prune asks on a terminal and refuses when stdin is not one.")
@progress_option
@json_option
@guarded
def prune(store_url: str | None, before: str | None, session_id: str | None, user_id: str | None,
          dry_run: bool, yes: bool, show_progress: bool, as_json: bool) -> None:
    """Delete checkpoints, journal entries and run records matching every given filter, and nothing else.

    With --before, what recovering an unfinished run needs stays. --dry-run
    lists what would go. Without --yes, prune shows what it would delete and
    asks for confirmation on a terminal; when stdin is not a terminal (a
    script, cron) it refuses unless --yes is given.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    cutoff = parse_time(before)
    everything = before is None and session_id is None and user_id is None
    store = open_store_or_fail(store_url)
    if dry_run:
        with Activity("prune --dry-run", show_progress) as activity:
            plan = prune_plan(store, cutoff, session_id, user_id, activity)
        _print_plan(plan, as_json)
        return
    if not yes:
        what = ("prune with no filter deletes every session's history" if everything
                else "prune deletes what matches its filters")
        if not stdin_is_tty():
            raise CliError(f"{what} and asks first, but stdin is not a terminal: pass --yes to delete without "
                           "asking (or --dry-run to list what would be deleted)")
        with Activity("prune: looking for what matches", show_progress) as activity:
            plan = prune_plan(store, cutoff, session_id, user_id, activity)
        if not (plan["checkpoints"] or plan["journal_entries"] or plan["run_records"]):
            err_console.print("nothing matches: nothing to delete", highlight=False)
            if as_json:
                emit_json({"checkpoints": 0, "journal_entries": 0, "run_records": 0})
            return
        err_console.print(f"prune would delete {_plan_summary(plan)} in {store.describe()}"
                          + (" (every session's history)" if everything else ""), highlight=False)
        if not click.confirm("Delete them?", default=False, err=True):
            err_console.print("nothing deleted", highlight=False)
            sys.exit(1)
    with Activity("prune", show_progress) as activity:
        activity.step("deleting checkpoints, journal entries and run records")
        report = store.prune(before=cutoff, session_id=session_id, user_id=user_id)
    if as_json:
        emit_json(row_dict(report))
    else:
        console.print(f"pruned {_count(report.checkpoints, 'checkpoint')}, "
                      f"{_count(report.journal_entries, 'journal entry', 'journal entries')} and "
                      f"{_count(report.run_records, 'run record')}", highlight=False)


def _count(n: int, what: str, plural: str | None = None) -> str:
    return f"{n} {what if n == 1 else plural or what + 's'}"


def _plan_summary(plan: dict[str, Any]) -> str:
    n = len([s for s in plan["sessions"] if s["checkpoints"] or s["journal_entries"] or s["run_records"]])
    return (f"{_count(plan['checkpoints'], 'checkpoint')}, "
            f"{_count(plan['journal_entries'], 'journal entry', 'journal entries')} and "
            f"{_count(plan['run_records'], 'run record')} of {_count(n, 'session')}")


#: Checkpoint ids a dry run lists in the terminal (``--json`` lists them all).
_DRY_RUN_LISTED = 50


def _print_plan(plan: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit_json(plan)
        return
    sessions = [s for s in plan["sessions"] if s["checkpoints"] or s["journal_entries"] or s["run_records"]]
    if not sessions:
        console.print("dry run: nothing matches; prune would delete nothing")
        return
    multi_user = any(s["user_id"] for s in sessions)
    rows = [{"session": s["session_id"], "user": s["user_id"] or "-", "checkpoints": str(s["checkpoints"]),
             "journal": str(s["journal_entries"]), "runs": str(s["run_records"]),
             "kept": str(len(s["kept_for_recovery"]))} for s in sessions]
    cols = [Col("session")] + ([Col("user", drop=2)] if multi_user else [])
    cols += [Col("checkpoints", justify="right"), Col("journal", "journal entries", justify="right"),
             Col("runs", "run records", justify="right"), Col("kept", "kept for recovery", drop=1, justify="right")]
    console.print(fit_table(cols, rows, title="dry run: prune would delete"))
    listed = [(s, c) for s in sessions for c in s["checkpoint_ids"]]
    if listed:
        console.print("checkpoints it would delete (session, checkpoint):", highlight=False)
        for s, cid in listed[:_DRY_RUN_LISTED]:
            console.print(f"  {s['session_id']} {cid}", highlight=False, soft_wrap=True)
        if len(listed) > _DRY_RUN_LISTED:
            console.print(f"  ... and {len(listed) - _DRY_RUN_LISTED} more (--json lists them all)", highlight=False)
    console.print(f"dry run: nothing deleted; prune would delete {_plan_summary(plan)}", highlight=False)


def prune_plan(store: Any, cutoff: datetime | None, session_id: str | None, user_id: str | None,
               activity: Activity) -> dict[str, Any]:
    """What ``Store.prune`` with these filters would delete, read without deleting anything.

    Mirrors :func:`storage.maintenance.prune` with public calls: the same
    sessions in scope, the same checkpoints, journal entries and run records
    (sparing, with a cutoff, what recovering an unfinished last run needs).
    A run that starts meanwhile can only make prune delete less.
    """
    from storage import layout
    from storage.ids import user_from_segment, user_segment
    from storage.journal import RUN_END, last_run_window, unfinished_last_run
    from storage.rows import RunRecord

    activity.step("listing sessions")
    users = [user_segment(user_id)] if user_id is not None else store.objects.list_dirs(prefix="sessions/")
    scope: list[tuple[str | None, str]] = []
    for seg in users:
        if session_id is not None:
            scope.append((user_from_segment(seg), session_id))
        else:
            scope.extend((user_from_segment(seg), s) for s in store.objects.list_dirs(prefix=f"sessions/{seg}/"))
    kept_runs: dict[tuple[str | None, str], set[str]] = {}
    kept_ckpts: set[tuple[str | None, str, str]] = set()
    if cutoff is not None:
        for uid, sid in iter_progress(activity, scope, "recovery needs of session"):
            needs = unfinished_last_run(store, sid, uid)
            if needs is None:
                continue
            kept_runs[(uid, sid)] = {r for r in (needs.run_id, needs.replay_from) if r}
            if needs.base_checkpoint_id and needs.base_session_id:
                kept_ckpts.add((uid, needs.base_session_id, needs.base_checkpoint_id))
    out: list[dict[str, Any]] = []
    for uid, sid in iter_progress(activity, scope, "session"):
        live: dict[str, dict[str, Any]] = {}
        for r in store.query(user_id=uid, session_id=sid,
                             columns=["checkpoint_id", "turn", "created_at", "epoch", "key"]).to_pylist():
            live[r["checkpoint_id"]] = r
        rows = list(live.values())
        spared = {cid for u, s, cid in kept_ckpts if (u, s) == (uid, sid)}
        if (uid, sid) in kept_runs and rows:
            spared.add(max(rows, key=lambda r: (r["epoch"], r["checkpoint_id"]))["checkpoint_id"])
        doomed = sorted((r for r in rows if (cutoff is None or r["created_at"] < cutoff)
                         and r["checkpoint_id"] not in spared), key=lambda r: (r["turn"], r["checkpoint_id"]))
        n_ckpt = len(doomed)
        if cutoff is None:  # objects without an index row go too
            objects = {o.key for o in store.objects.list(prefix=layout.session_prefix(sid, uid) + "checkpoints/")}
            n_ckpt = len(objects | {r["key"] for r in doomed})
        kept = tuple(layout.journal_prefix(sid, uid, r) for r in kept_runs.get((uid, sid), ()))
        keys = [o.key for o in store.objects.list(prefix=layout.journal_prefix(sid, uid)) if not o.key.startswith(kept)]
        older: list[tuple[int, str]] = []
        if cutoff is not None:
            last, older, _ = last_run_window(store, sid, uid)
            if last is not None:
                last_id = last.run_id
            else:
                runs = store.journal_runs(sid, user_id=uid)
                last_id = runs[-1] if runs else None
            entries: dict[str, Any] = {}
            base = layout.journal_prefix(sid, uid)
            for run_id in sorted({k[len(base):].split("/", 1)[0] for k in keys}):
                entries.update(store.journal_read(sid, run_id, user_id=uid).by_key)
            # The last run's run_end stays (without it a finished run would read as unfinished).
            keys = [k for k in keys if k in entries and entries[k].created_at < cutoff
                    and not (entries[k].kind == RUN_END and entries[k].run_id == last_id)]
        if cutoff is None:
            records = [o.key for o in store.objects.list(prefix=layout.run_prefix(sid, uid))]
        else:
            records = []
            for _, key in older:
                obj = store.objects.get(key=key)
                try:
                    rec = RunRecord.model_validate_json(obj.data) if obj is not None else None
                except ValueError:
                    rec = None
                if rec is not None and rec.run_id not in kept_runs.get((uid, sid), set()) and rec.created_at < cutoff:
                    records.append(key)
        out.append({"session_id": sid, "user_id": uid, "checkpoints": n_ckpt, "journal_entries": len(keys),
                    "run_records": len(records), "checkpoint_ids": [r["checkpoint_id"] for r in doomed],
                    "kept_for_recovery": sorted(spared & set(live))})
    return {"dry_run": True, "before": cutoff, "session_id": session_id, "user_id": user_id,
            "checkpoints": sum(s["checkpoints"] for s in out), "journal_entries": sum(s["journal_entries"] for s in out),
            "run_records": sum(s["run_records"] for s in out), "sessions": out}


@main.command()
@store_option
@progress_option
@json_option
@guarded
def compact(store_url: str | None, show_progress: bool, as_json: bool) -> None:
    """Merge small Parquet index files and drop tombstoned rows."""
    with Activity("compact", show_progress) as activity:
        store = open_store_or_fail(store_url)
        if activity.enabled:
            activity.step("listing index files")
            n = len(store.index_files("checkpoints")) + len(store.index_files("sessions"))
            activity.step(f"merging {n} index files, partition by partition")
        report = store.compact()
    if as_json:
        emit_json(row_dict(report))
    else:
        console.print(
            f"index files {report.files_before} -> {report.files_after}, {report.rows} rows kept, "
            f"{report.tombstones_dropped} tombstoned rows dropped"
        )


@main.group()
def lease() -> None:
    """Repair a session's lease (lease.json)."""


@lease.command("repair")
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def lease_repair(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Rewrite an unreadable or missing lease.json above every epoch the session used.

    The new epoch fences every holder: a running writer stops at its next lease
    check, and the session's next incarnation takes the epoch after it. A
    healthy lease is left alone.
    """
    from storage.errors import LeaseCorruptError
    from storage.layout import lease_key

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    key = lease_key(session_id, user_id)
    try:
        epoch, state, problem = store.current_epoch(session_id, user_id=user_id), "ok", None
        if store.objects.get(key=key) is None:
            state = "missing"
    except LeaseCorruptError as e:
        epoch, state, problem = None, "corrupt", first_line(str(e))
    if state == "missing" and not epoch and not session_exists(store, session_id, user_id):
        raise CliError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                       + f" in {store.describe()}")
    repaired = state != "ok"
    if repaired:
        epoch = store.repair_lease(session_id, user_id=user_id, owner="loomray lease repair").epoch
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "state": state, "repaired": repaired,
                   "epoch": epoch, "problem": problem})
    elif not repaired:
        console.print(f"the lease of session {session_id} is healthy (epoch {epoch}): nothing to repair",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"{store.describe(key)} was {state}" + (f" ({problem})" if problem else "")
                      + f"; rewritten at epoch {epoch}, above every epoch the session used", highlight=False,
                      soft_wrap=True)


@main.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("--html", "html_path", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write the tree as a self-contained HTML page to FILE.")
@json_option
@guarded
def tree(session_id: str, store_url: str | None, user_id: str | None, html_path: str | None, as_json: bool) -> None:
    """The fork tree of a session: its forks, their forks, and so on.

    Per session: the parent checkpoint it was forked from, its turns, its
    status and its own spend (its cost minus what its parent checkpoint had
    already cost).
    """
    from loomray.cli_views import fork_tree, tree_html, tree_json, tree_table

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    root = fork_tree(store, session_id, user_id)
    if html_path:
        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(tree_html(root, store_desc=store.describe()))
        except OSError as e:
            raise CliError(f"cannot write {html_path!r}: {e.strerror or e}") from e
    if as_json:
        emit_json(tree_json(root) | ({"html": html_path} if html_path else {}))
        return
    table, summary = tree_table(root)
    console.print(table)
    console.print(summary, highlight=False)
    if html_path:
        err_console.print(f"wrote {html_path}", highlight=False, soft_wrap=True)


@main.command()
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def timeline(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """A session's incarnations, by lease epoch: owner and node, start, end, and why it started and ended.

    Read from the epoch markers, lease.json, the status rows, the run records,
    the journal and the checkpoints the store still holds.
    """
    from loomray.cli_views import session_timeline, timeline_table

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    data = session_timeline(store, session_id, user_id)
    if as_json:
        emit_json(data)
        return
    console.print(timeline_table(data))
    if data["current_epoch"] is not None:
        console.print(f"lease: epoch {data['current_epoch']}, owner {data['lease_owner'] or '-'}", highlight=False,
                      soft_wrap=True)


# --------------------------------------------------------------------- steering (loomray.control)


def _resume_hint(session_id: str, user_id: str | None) -> str:
    return f"loomray resume {session_id}" + (f" --user {user_id}" if user_id else "")


def _decide(session_id: str, call_id: str, decision: Any, store_url: str | None, user_id: str | None,
            as_json: bool) -> None:
    from loomray import control

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    written = control.record_decision(store, session_id, user_id, call_id, decision, source="cli")
    approved, reason = control.normalize_decision(decision)
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "call_id": call_id, "approved": approved,
                   "reason": reason, "recorded": written})
        return
    what = "approved" if approved else "denied" + (f" ({reason})" if reason else "")
    again = "" if written else " (already recorded)"
    console.print(f"tool call {call_id} of session {session_id} {what}{again}; `{_resume_hint(session_id, user_id)}` "
                  "continues the session", highlight=False, soft_wrap=True)


@main.command()
@click.argument("session_id")
@click.argument("call_id")
@store_option
@user_option
@json_option
@guarded
def approve(session_id: str, call_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Approve a tool call a session waits on (stop reason awaiting_approval).

    The decision is stored (create-only: the first decision on a call wins);
    ``loomray resume SESSION`` then runs the call once and continues.
    """
    _decide(session_id, call_id, True, store_url, user_id, as_json)


@main.command()
@click.argument("session_id")
@click.argument("call_id")
@click.option("--reason", default=None, help="Why; the model gets it as the call's error result.")
@store_option
@user_option
@json_option
@guarded
def deny(session_id: str, call_id: str, reason: str | None, store_url: str | None, user_id: str | None,
         as_json: bool) -> None:
    """Deny a tool call a session waits on; the model gets the denial (and --reason) as the call's error result."""
    _decide(session_id, call_id, reason if reason else False, store_url, user_id, as_json)


@main.command("signal")
@click.argument("session_id")
@click.argument("text")
@store_option
@user_option
@json_option
@guarded
def signal_cmd(session_id: str, text: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Send TEXT to a session as a user message, delivered once at its next pass boundary."""
    from loomray import control

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    name = control.send_signal(store, session_id, user_id, text, source="cli")
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "signal": name})
        return
    console.print(f"signal {name} stored for session {session_id}: delivered at its next pass boundary",
                  highlight=False, soft_wrap=True)


@main.command()
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def pause(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Ask a session to stop at its next pass boundary (with a checkpoint); ``loomray resume`` continues it."""
    from loomray import control

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    name = control.request_pause(store, session_id, user_id, source="cli")
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "pause": name})
        return
    if name is None:
        console.print(f"session {session_id} is paused already; `{_resume_hint(session_id, user_id)}` continues it",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"pause {name} stored for session {session_id}: it stops at its next pass boundary",
                      highlight=False, soft_wrap=True)


@main.command()
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def cancel(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Cancel a session: its step in flight is abandoned and nothing it does afterwards is made durable.

    Stores the cancel, then takes the session's lease and seals its last run,
    so a writer anywhere is fenced before this command returns. Final: every
    later run of the session stops at once as "cancelled" (fork a checkpoint
    to go on from it).
    """
    from loomray import control

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    epoch = control.cancel_session(store, session_id, user_id, source="cli")
    if as_json:
        emit_json({"session_id": session_id, "user_id": user_id, "cancelled": True, "epoch": epoch})
        return
    console.print(f"session {session_id} cancelled; writers fenced at epoch {epoch}", highlight=False,
                  soft_wrap=True)


def _excerpt(text: Any, n: int = 120) -> str:
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def entry_summary(entry: Any) -> str:
    """One line about a journal entry for ``loomray logs``."""
    out = entry.output or {}
    kind = entry.kind
    if kind == "run_start":
        base = out.get("base_checkpoint_id")
        return f"prompt: {_excerpt(out.get('prompt'))}" + (f" (from checkpoint {base})" if base else "")
    if kind == "model":
        msg = (out.get("response") or {}).get("message") or {}
        calls = msg.get("tool_calls") or []
        if calls:
            return "calls " + ", ".join(f"{c.get('name')}({_excerpt(json.dumps(c.get('arguments', {})), 60)}) "
                                        f"[{c.get('id')}]" for c in calls)
        return f"answer: {_excerpt(msg.get('content'))}"
    if kind == "tool":
        msg = out.get("message") or {}
        head = f"{out.get('tool') or msg.get('name')} [{msg.get('tool_call_id')}] "
        return head + ("error: " if msg.get("is_error") else "-> ") + _excerpt(msg.get("content"))
    if kind == "signal":
        return f"signal {out.get('control')}: {_excerpt(out.get('text'))}"
    if kind == "pause":
        return f"pause {out.get('control')}: the run stopped here"
    if kind == "approval":
        what = "approved" if out.get("approved") else "denied" + (f": {out.get('reason')}" if out.get("reason") else "")
        return f"{out.get('tool')} [{out.get('call_id')}] {what}"
    if kind == "run_end":
        return f"run finished: {out.get('turns')} turns, {out.get('model_calls')} model calls"
    if kind == "seal":
        return f"older writers fenced (epoch {entry.epoch}, {out.get('owner') or '-'})"
    return _excerpt(json.dumps(out, default=str))


class LogReader:
    """A session's journal entries across its runs (oldest run first), each entry returned once."""

    def __init__(self, store: Any, session_id: str, user_id: str | None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self._runs: dict[str, Any] = {}
        self._seen: set[str] = set()
        self._order: list[str] = []
        self._done: set[str] = set()

    def _run_ids(self) -> list[str]:
        records = self.store.list_runs(self.session_id, user_id=self.user_id)
        ids = [r.run_id for r in records]
        for run_id in self.store.journal_runs(self.session_id, user_id=self.user_id):  # runs without records
            if run_id not in ids:
                ids.append(run_id)
        return ids

    def new_entries(self) -> list[Any]:
        from storage.journal import entry_name, read_run

        self._order = self._run_ids()
        out = []
        for run_id in self._order:
            if run_id in self._done and run_id != self._order[-1]:
                continue  # an older run that had finished when read: nothing new comes
            run = read_run(self.store, self.session_id, run_id, self.user_id, self._runs.get(run_id))
            self._runs[run_id] = run
            entries = run.entries
            if any(e.kind == "run_end" for e in entries):
                self._done.add(run_id)
            for e in entries:
                key = f"{run_id}/{entry_name(e)}"
                if key not in self._seen:
                    self._seen.add(key)
                    out.append(e)
        return out

    def ended(self) -> bool:
        """The last run finished, or the session stopped (its status is not an active one)."""
        if self._order and self._order[-1] in self._done:
            return True
        row = self.store.get_session(self.session_id, user_id=self.user_id)
        return row is not None and row.status not in ("running", "pending")


@main.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("-f", "--follow", is_flag=True, help="Keep printing new entries until the run ends (or Ctrl-C).")
@click.option("--interval", default=1.0, show_default=True, type=click.FloatRange(0.01, 3600),
              help="Seconds between two looks with --follow.")
@json_option
@guarded
def logs(session_id: str, store_url: str | None, user_id: str | None, follow: bool, interval: float,
         as_json: bool) -> None:
    """A session's events from the store: its journal entries across runs, oldest first.

    Model answers, tool results, signals, pauses, approvals and run starts and
    ends, one line each (``--json``: one JSON object per line). With
    ``-f`` it polls for new entries until the run ends or stops (awaiting
    approval, paused, cancelled, ...).
    """
    import time

    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    if not session_exists(store, session_id, user_id):
        raise CliError(f"unknown session {session_id!r}" + (f" of user {user_id!r}" if user_id else "")
                       + f" in {store.describe()}")
    reader = LogReader(store, session_id, user_id)
    try:
        while True:
            for e in reader.new_entries():
                if as_json:
                    click.echo(json.dumps({"session_id": session_id, "user_id": user_id, "run_id": e.run_id,
                                           "seq": e.seq, "kind": e.kind, "step_key": e.step_key,
                                           "epoch": e.epoch, "created_at": iso_time(e.created_at),
                                           "summary": entry_summary(e), "output": e.output}, default=str))
                else:
                    click.echo(f"{short_time(e.created_at)}  {e.run_id}  {e.seq:>5}  {e.kind:<9} "
                               f"{entry_summary(e)}")
            if not follow or reader.ended():
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        pass
    if not as_json:
        row = store.get_session(session_id, user_id=user_id)
        if row is not None:
            err_console.print(f"session {session_id}: {row.status}", highlight=False, soft_wrap=True)


def session_exists(store: Any, session_id: str, user_id: str | None) -> bool:
    """True when the store knows the session at all (a status row or a journal)."""
    return store.get_session(session_id, user_id=user_id) is not None or bool(
        store.journal_runs(session_id, user_id=user_id))


def sessions_table(store: Any, user_id: str | None = None) -> Any:
    """The latest status row of each session (of ``user_id``, or every user) as an Arrow table."""
    from storage import ANY
    from storage.rows import SESSION_SCHEMA, session_rows_table

    rows = store.list_sessions(user_id=ANY if user_id is None else user_id)
    return session_rows_table(rows) if rows else SESSION_SCHEMA.empty_table()


def _register() -> None:
    """Attach the cluster commands and the demo (their modules import Ray only when a command runs)."""
    from loomray import cli_ray, demo

    for command in (cli_ray.submit, cli_ray.status, cli_ray.resume, cli_ray.fork, cli_ray.supervise_cmd,
                    demo.demo):
        main.add_command(command)


_register()


if __name__ == "__main__":  # pragma: no cover
    main()
