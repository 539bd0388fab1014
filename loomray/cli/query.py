"""``loomray query``: the checkpoint index across sessions, filtered, or through SQL (DuckDB over Arrow)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import click
import pyarrow as pa
import pyarrow.compute as pc
from rich.text import Text

from loomray.cli.common import (
    STATUS_STYLE,
    TIME_HELP,
    CliError,
    check_id,
    console,
    first_line,
    guarded,
    json_option,
    open_store_or_fail,
    parse_time,
    sql_to_arrow,
    store_option,
)
from loomray.cli.explore_view import load_exploration, with_branch_columns
from loomray.cli.output import emit_json, money, plain_cell, time_cells
from loomray.cli.progress import Activity, progress_option
from loomray.cli.tables import Col, fit_columns, fit_table, print_records
from loomray.storage import ANY, Store
from loomray.storage.rows import SESSION_SCHEMA, session_rows_table
from loomray.storage.table import Staleness, staleness

#: What a checkpoint row's status can be; ``--status`` filters rows by it.
CHECKPOINT_STATUSES = ("active", "completed", "awaiting_approval", "paused")
#: Statuses only a session has; ``--status`` then selects the checkpoints of sessions in that status.
SESSION_ONLY_STATUSES = ("running", "failed", "cancelled", "budget_exceeded")

#: The default ``query`` view: (index column, header, drop rank); rank 0 columns always show.
_QUERY_VIEW = [("session_id", "session", 0), ("user_id", "user", 3), ("checkpoint_id", "checkpoint", 0),
               ("turn", "turn", 0), ("execution_status", "status", 0), ("created_at", "created", 1),
               ("cost_usd", "cost", 2), ("tokens", "tokens", 4), ("epoch", "epoch", 5), ("position", "after", 6),
               ("message_count", "messages", 7)]
_RIGHT = {"turn", "cost_usd", "tokens", "epoch", "message_count"}


def sessions_table(store: Store, user_id: str | None = None) -> pa.Table:
    """The latest status row of each session (of ``user_id``, or every user) as an Arrow table."""
    rows = store.sessions.list(user_id=ANY if user_id is None else user_id)
    return session_rows_table(rows) if rows else SESSION_SCHEMA.empty_table()


def _of_sessions_with_status(table: pa.Table, sessions: pa.Table, status: str) -> pa.Table:
    """The rows of ``table`` whose session's latest status row says ``status``."""
    chosen = sessions.filter(pc.equal(sessions["status"], status))
    keys = pc.binary_join_element_wise(pc.fill_null(table["user_id"], ""), table["session_id"], "/")
    wanted = pc.binary_join_element_wise(pc.fill_null(chosen["user_id"], ""), chosen["session_id"], "/")
    return table.filter(pc.is_in(keys, value_set=wanted))


def _run_sql(store: Store, table: pa.Table, sql: str, user_id: str | None, activity: Activity) -> pa.Table:
    """``sql`` over the filtered rows (table ``checkpoints``) and the sessions' status rows (``sessions``)."""
    try:
        import duckdb  # optional: the [query] extra
    except ImportError as e:
        raise CliError("SQL queries need DuckDB: pip install 'loomray[query]'") from e
    activity.step(f"running SQL over {table.num_rows} checkpoint rows")
    con = duckdb.connect()
    con.register("checkpoints", table)
    con.register("sessions", sessions_table(store, user_id))
    try:
        return sql_to_arrow(con, sql)
    except duckdb.Error as e:
        raise CliError(f"SQL error: {first_line(str(e))}") from e
    finally:
        con.close()


@click.command()
@click.argument("sql", required=False)
@store_option
@click.option("--user", "user_id", default=None, help="Only this user's sessions (default: every user).")
@click.option("--session", "session_id", default=None, help="Only this session's checkpoints.")
@click.option("--status", default=None, type=click.Choice([*CHECKPOINT_STATUSES, *SESSION_ONLY_STATUSES]),
              help="Checkpoints with this status (active, completed, awaiting_approval, paused), or the "
                   "checkpoints of sessions whose status is this (running, failed, cancelled, budget_exceeded).")
@click.option("--since", default=None, help=f"Checkpoints created at or after this time: {TIME_HELP}.")
@click.option("--until", default=None, help=f"Checkpoints created before this time: {TIME_HELP}.")
@click.option("--min-cost", type=float, default=None, metavar="USD",
              help="Checkpoints whose session had spent at least this many dollars.")
@click.option("--exploration", "exploration_id", default=None, metavar="ID",
              help="Only the branches of this exploration, with its columns: exploration_id, round, score, "
                   "branch_stop.")
@click.option("--min-score", type=float, default=None, help="With --exploration: branches scored at least this.")
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Print at most this many rows.")
@click.option("--columns", default=None, metavar="A,B,...",
              help="Index columns to show, comma-separated (default: the ones that matter that fit the terminal).")
@progress_option
@json_option
@guarded
def query(sql: str | None, store_url: str | None, user_id: str | None, session_id: str | None,
          status: str | None, since: str | None, until: str | None, min_cost: float | None,
          exploration_id: str | None, min_score: float | None, limit: int, columns: str | None,
          show_progress: bool, as_json: bool) -> None:
    """Query the checkpoint index across sessions.

    Without SQL, prints the live checkpoint rows matching the filters: by
    default session, checkpoint, turn, status, created time and cost, as many
    as fit the terminal (--columns picks others, --json has all). With SQL
    (DuckDB over Arrow), the filtered rows are the table "checkpoints" and the
    latest status row of each session is the table "sessions", e.g.

      loomray query "select session_id, max(turn) from checkpoints group by 1"

    With --exploration, only its branches' rows, with their round, score and
    stop reason as columns (e.g. "select session_id, max(score) ... group by 1").
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    check_id(exploration_id, "exploration id")
    if min_score is not None and exploration_id is None:
        raise CliError("--min-score needs --exploration ID")
    if sql and columns:
        raise CliError("--columns applies to the default view; with SQL, select the columns in the query")
    with Activity("query", show_progress) as activity:
        store = open_store_or_fail(store_url)
        activity.step("reading the checkpoint index")
        by_checkpoint = status if status in CHECKPOINT_STATUSES else None
        table = store.query(user_id=ANY if user_id is None else user_id, session_id=session_id,
                            status=by_checkpoint, since=parse_time(since), until=parse_time(until), min_cost=min_cost)
        if status in SESSION_ONLY_STATUSES:
            table = _of_sessions_with_status(table, sessions_table(store, user_id), status)
        stale = staleness(table)
        if exploration_id is not None:
            table = with_branch_columns(table, load_exploration(store, exploration_id, user_id), min_score)
        if sql:
            table = _run_sql(store, table, sql, user_id, activity)
        table = table.slice(0, limit)
        activity.step(f"formatting {table.num_rows} rows")
        rows = table.to_pylist()
    if as_json:
        emit_json(rows)
        return
    _print_query(table.column_names, rows, sql, columns, stale)


def _print_query(names: list[str], rows: list[dict[str, Any]], sql: str | None, columns: str | None,
                 stale: Staleness | None) -> None:
    title = f"{len(rows)} rows"
    if sql:
        _print_result(names, rows, title)
    elif columns:
        wanted = [c.strip() for c in columns.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in names]
        if unknown or not wanted:
            raise CliError(f"unknown column(s) {', '.join(unknown) or '(none given)'}; the index has: "
                           + ", ".join(names))
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


def _checkpoint_cells(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The default view's cells of index rows, by column key."""
    created = time_cells([r["created_at"] for r in rows])
    return [{"session_id": r["session_id"], "user_id": r["user_id"] or "-",
             "checkpoint_id": r["checkpoint_id"], "turn": str(r["turn"]),
             "execution_status": Text(r["execution_status"], style=STATUS_STYLE.get(r["execution_status"], "")),
             "created_at": t, "cost_usd": money(r["cost_usd"]),
             "tokens": str((r["input_tokens"] or 0) + (r["output_tokens"] or 0)), "epoch": str(r["epoch"]),
             "position": (r["position"] or "").removeprefix("after_"),
             "message_count": str(r["message_count"])} for r, t in zip(rows, created, strict=False)]


def _print_checkpoint_rows(rows: list[dict[str, Any]], title: str) -> None:
    """The default ``query`` view: the columns that matter, as many as fit; ids, statuses, times whole."""
    cells = _checkpoint_cells(rows)
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
