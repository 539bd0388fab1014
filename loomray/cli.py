"""The ``loomray`` command line.

Store-side commands (``checkpoints`` [``quarantine``], ``show``, ``query``,
``prune``, ``compact``, ``lease repair``) live here; cluster commands (``submit``, ``status``, ``resume``,
``fork``, ``supervise``) in :mod:`loomray.cli_ray`; ``demo`` in
:mod:`loomray.demo`. Every command takes ``--store URL`` (or
``LOOMRAY_STORE``) and, where a cluster is involved, ``--address`` (or
``RAY_ADDRESS``). ``--json`` prints machine-readable output. A user mistake
prints one line on stderr and exits 2; a failed run exits 1; neither prints a
traceback (``LOOMRAY_DEBUG=1`` does).
"""

from __future__ import annotations

import os

# Ray reads this once, when first imported: bind to 127.0.0.1 for a user who runs `loomray demo` directly.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import json  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402
from rich.table import Table  # noqa: E402

from loomray.cli_common import (  # noqa: E402
    CliError, check_id, console, emit_json, err_console, first_line, guarded, json_option,
    open_store_or_fail, parse_time, row_dict, short_time, sql_to_arrow, store_option, user_option,
)


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
    table = Table(title=f"checkpoints of {session_id}")
    # A narrow terminal gets the columns that matter most (--json has everything).
    wide = console.width >= 110
    cols = ["checkpoint", "turn"] + (["after"] if wide else []) + ["status"] + (["messages"] if wide else [])
    cols += ["tokens", "cost $", "epoch"] + (["created"] if wide else [])
    for col in cols:
        # The id is what people copy into the next command: never cut it.
        table.add_column(col, no_wrap=col == "checkpoint",
                         min_width=max(len(r.checkpoint_id) for r in rows) if col == "checkpoint" else None)
    for r in rows:
        cells = {"checkpoint": r.checkpoint_id, "turn": str(r.turn), "after": r.position.removeprefix("after_"),
                 "status": r.execution_status, "messages": str(r.message_count),
                 "tokens": str(r.input_tokens + r.output_tokens),
                 "cost $": "-" if r.cost_usd is None else f"{r.cost_usd:.4f}", "epoch": str(r.epoch),
                 "created": short_time(r.created_at)}
        table.add_row(*(cells[c] for c in cols))
    console.print(table)


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
    cost = "unknown" if u.cost_usd is None else f"${u.cost_usd:.4f}"
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


@main.command()
@click.argument("sql", required=False)
@store_option
@click.option("--user", "user_id", default=None)
@click.option("--session", "session_id", default=None)
@click.option("--status", default=None, type=click.Choice(["active", "completed"]))
@click.option("--since", default=None, help="ISO-8601 time.")
@click.option("--until", default=None, help="ISO-8601 time.")
@click.option("--min-cost", type=float, default=None)
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 1_000_000))
@json_option
@guarded
def query(sql: str | None, store_url: str | None, user_id: str | None, session_id: str | None,
          status: str | None, since: str | None, until: str | None, min_cost: float | None,
          limit: int, as_json: bool) -> None:
    """Query the checkpoint index across sessions.

    Without SQL, prints the live checkpoint rows matching the filters. With
    SQL (DuckDB over Arrow), the filtered rows are the table ``checkpoints``
    and the latest status row of each session is the table ``sessions``, e.g.
    ``loomray query "select session_id, max(turn) from checkpoints group by 1"``.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    store = open_store_or_fail(store_url)
    kwargs: dict[str, Any] = dict(session_id=session_id, status=status, since=parse_time(since),
                                  until=parse_time(until), min_cost=min_cost)
    if user_id is not None:
        kwargs["user_id"] = user_id
    table = store.query(**kwargs)
    if sql:
        try:
            import duckdb
        except ImportError as e:
            raise CliError("SQL queries need DuckDB: pip install 'loomray[query]'") from e
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
    if as_json:
        emit_json(table.to_pylist())
        return
    out = Table(title=f"{table.num_rows} rows")
    for name in table.column_names:
        out.add_column(name)
    for row in table.to_pylist():
        out.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(out)


@main.command()
@store_option
@click.option("--before", default=None, help="Only what was created before this ISO-8601 time.")
@click.option("--session", "session_id", default=None)
@click.option("--user", "user_id", default=None)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@json_option
@guarded
def prune(store_url: str | None, before: str | None, session_id: str | None, user_id: str | None,
          yes: bool, as_json: bool) -> None:
    """Delete checkpoints and journal entries matching every given filter, and nothing else."""
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    if before is None and session_id is None and user_id is None and not yes:
        raise CliError("prune with no filter deletes every session's history; give --before/--session/--user or --yes")
    report = open_store_or_fail(store_url).prune(before=parse_time(before), session_id=session_id, user_id=user_id)
    if as_json:
        emit_json(row_dict(report))
    else:
        console.print(f"pruned {report.checkpoints} checkpoints and {report.journal_entries} journal entries")


@main.command()
@store_option
@json_option
@guarded
def compact(store_url: str | None, as_json: bool) -> None:
    """Merge small Parquet index files and drop tombstoned rows."""
    report = open_store_or_fail(store_url).compact()
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
