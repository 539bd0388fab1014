"""The ``loomray`` command line.

Every command takes ``--store URL`` (or ``LOOMRAY_STORE``) and, where a
cluster is involved, ``--address`` (or ``RAY_ADDRESS``). ``--json`` prints
machine-readable output. A user mistake prints one line on stderr and exits 2;
a failed run exits 1; neither prints a traceback (``LOOMRAY_DEBUG=1`` does).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from typing import Any, Callable

import click
from rich.console import Console
from rich.table import Table

from loomray.errors import LoomrayRunError, LoomrayUserError

console = Console()
err_console = Console(stderr=True)

EXIT_USER = 2
EXIT_RUN = 1


class CliError(click.ClickException):
    """A user mistake: one line, exit code 2."""

    exit_code = EXIT_USER

    def show(self, file=None) -> None:  # one clear line, no "Usage:" noise
        err_console.print(f"[bold red]error:[/] {self.format_message()}", highlight=False)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from storage import errors as serr

    return (LoomrayUserError, ValueError, KeyError, FileNotFoundError, serr.StorageError)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn expected failures into one line and an exit code instead of a traceback."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except LoomrayRunError as e:
            if os.environ.get("LOOMRAY_DEBUG"):
                raise
            err_console.print(f"[bold red]run failed:[/] {e}", highlight=False)
            sys.exit(EXIT_RUN)
        except Exception as e:  # noqa: BLE001 - classify, then re-raise the unexpected
            if os.environ.get("LOOMRAY_DEBUG"):
                raise
            if isinstance(e, _user_error_types()):
                raise CliError(str(e) or type(e).__name__) from e
            err_console.print(f"[bold red]error:[/] {type(e).__name__}: {e}", highlight=False)
            sys.exit(EXIT_RUN)

    return wrapper


def _open(store_url: str | None):
    if not store_url:
        raise CliError("no store given: pass --store URL or set LOOMRAY_STORE (a directory, file://..., s3://bucket/prefix)")
    from storage import open_store

    return open_store(store_url)


def _parse_time(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise CliError(f"not an ISO-8601 time: {value!r}") from e
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, default=str, indent=2))


def _row_dict(row: Any) -> dict[str, Any]:
    if hasattr(row, "model_dump"):
        return row.model_dump(mode="json")
    if hasattr(row, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(row)
    return dict(row)


store_option = click.option(
    "--store", "store_url", envvar="LOOMRAY_STORE", metavar="URL",
    help="Store URL: a directory, file://..., s3://bucket/prefix (env LOOMRAY_STORE).",
)
address_option = click.option(
    "--address", envvar="RAY_ADDRESS", default=None, metavar="ADDR",
    help="Ray cluster address (env RAY_ADDRESS); default: start or join a local cluster.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
user_option = click.option("--user", "user_id", default=None, help="The user the session belongs to.")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="loomray")
def main() -> None:
    """loomray: durable long-running LLM agent sessions on Ray."""


# --------------------------------------------------------------------- store-only commands


@main.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000))
@json_option
@_guarded
def checkpoints(session_id: str, store_url: str | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """List a session's checkpoints, newest first."""
    rows = _open(store_url).list_checkpoints(session_id, user_id=user_id, limit=limit)
    if as_json:
        _emit_json([_row_dict(r) for r in rows])
        return
    if not rows:
        err_console.print(f"no checkpoints for session {session_id!r}" + (f" of user {user_id!r}" if user_id else ""))
        return
    table = Table(title=f"checkpoints of {session_id}")
    for col in ("checkpoint", "turn", "position", "status", "messages", "tokens", "cost $", "epoch", "created"):
        table.add_column(col)
    for r in rows:
        cost = "-" if r.cost_usd is None else f"{r.cost_usd:.4f}"
        table.add_row(
            r.checkpoint_id, str(r.turn), r.position, r.execution_status, str(r.message_count),
            str(r.input_tokens + r.output_tokens), cost, str(r.epoch), r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    console.print(table)


@main.command()
@click.argument("session_id")
@click.argument("checkpoint_id", default="latest")
@store_option
@user_option
@click.option("--messages/--no-messages", default=True, help="Print the transcript.")
@json_option
@_guarded
def show(session_id: str, checkpoint_id: str, store_url: str | None, user_id: str | None,
         messages: bool, as_json: bool) -> None:
    """Show one checkpoint (default: the latest) with its transcript."""
    from loomray.records import Checkpoint

    raw = _open(store_url).get_checkpoint(session_id, checkpoint_id, user_id=user_id)
    if raw is None:
        raise CliError(f"no checkpoint {checkpoint_id!r} for session {session_id!r}"
                       + (f" of user {user_id!r}" if user_id else ""))
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
@_guarded
def query(sql: str | None, store_url: str | None, user_id: str | None, session_id: str | None,
          status: str | None, since: str | None, until: str | None, min_cost: float | None,
          limit: int, as_json: bool) -> None:
    """Query the checkpoint index across sessions.

    With SQL, the filtered rows are the table ``checkpoints`` (DuckDB), e.g.
    ``loomray query "select session_id, max(turn) from checkpoints group by 1"``.
    """
    store = _open(store_url)
    kwargs: dict[str, Any] = dict(session_id=session_id, status=status, since=_parse_time(since),
                                  until=_parse_time(until), min_cost=min_cost)
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
        try:
            table = con.execute(sql).fetch_arrow_table()
        except duckdb.Error as e:
            raise CliError(f"SQL error: {str(e).splitlines()[0]}") from e
    table = table.slice(0, limit)
    if as_json:
        _emit_json(table.to_pylist())
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
@_guarded
def prune(store_url: str | None, before: str | None, session_id: str | None, user_id: str | None,
          yes: bool, as_json: bool) -> None:
    """Delete checkpoints and journal entries matching every given filter, and nothing else."""
    if before is None and session_id is None and user_id is None and not yes:
        raise CliError("prune with no filter deletes every session's history; give --before/--session/--user or --yes")
    report = _open(store_url).prune(before=_parse_time(before), session_id=session_id, user_id=user_id)
    if as_json:
        _emit_json(_row_dict(report))
    else:
        console.print(f"pruned {report.checkpoints} checkpoints and {report.journal_entries} journal entries")


@main.command()
@store_option
@json_option
@_guarded
def compact(store_url: str | None, as_json: bool) -> None:
    """Merge small Parquet index files and drop tombstoned rows."""
    report = _open(store_url).compact()
    if as_json:
        _emit_json(_row_dict(report))
    else:
        console.print(
            f"index files {report.files_before} -> {report.files_after}, {report.rows} rows kept, "
            f"{report.tombstones_dropped} tombstoned rows dropped"
        )


if __name__ == "__main__":  # pragma: no cover
    main()
