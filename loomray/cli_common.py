"""What every ``loomray`` command shares: consoles, options, errors, opening the store.

A user mistake raises :class:`CliError` (one red line on stderr, exit 2); a
failed run exits 1; neither prints a traceback unless ``LOOMRAY_DEBUG=1``.
Nothing here imports Ray, so ``loomray --help`` and the store-side commands
stay fast.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from datetime import datetime, timezone
from typing import Any, Callable

import click
from rich.console import Console

from loomray.errors import LoomrayRunError, LoomrayUserError

console = Console()
err_console = Console(stderr=True)

EXIT_USER = 2
EXIT_RUN = 1


class CliError(click.ClickException):
    """A user mistake: one line, exit code 2."""

    exit_code = EXIT_USER

    def show(self, file: Any = None) -> None:  # one clear line, no "Usage:" noise
        err_console.print(f"[bold red]error:[/] {self.format_message()}", highlight=False, soft_wrap=True)


def _user_error_types() -> tuple[type[BaseException], ...]:
    from storage import errors as serr

    return (LoomrayUserError, ValueError, KeyError, FileNotFoundError, serr.StorageError)


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn expected failures into one line and an exit code instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted")
            sys.exit(130)
        except Exception as raised:  # noqa: BLE001 - classify, then report the unexpected in one line too
            if os.environ.get("LOOMRAY_DEBUG"):
                raise
            report(_unwrap(raised))

    return wrapper


def _unwrap(e: BaseException) -> BaseException:
    """The error an actor method raised, not Ray's wrapper (whose text is a remote traceback)."""
    cause = getattr(e, "cause", None)
    if type(e).__name__.startswith("RayTaskError") and isinstance(cause, Exception):
        return cause
    return e


def report(e: BaseException) -> None:
    """Print ``e`` as one line and exit: 2 for a user's mistake, 1 for a failed run or anything else."""
    if isinstance(e, LoomrayRunError):
        err_console.print(f"[bold red]run failed:[/] {first_line(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_RUN)
    if isinstance(e, _user_error_types()):
        raise CliError(first_line(str(e)) or type(e).__name__) from e
    err_console.print(f"[bold red]error:[/] {type(e).__name__}: {first_line(str(e))}", highlight=False,
                      soft_wrap=True)
    sys.exit(EXIT_RUN)


def first_line(text: str) -> str:
    """The first non-empty line of ``text`` (Ray and DuckDB errors are multi-line)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def _local_path(url: str) -> str | None:
    """The directory a local store URL names, or None for other backends."""
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(url).path)
    return None if "://" in url else url


def store_url_or_fail(store_url: str | None) -> str:
    """The store URL, or a clear error when none was given."""
    if not store_url:
        raise CliError("no store given: pass --store URL or set LOOMRAY_STORE "
                       "(a directory, file:///path or s3://bucket/prefix)")
    return store_url


def open_store_or_fail(store_url: str | None, *, create: bool = False) -> Any:
    """Open the store; a local directory that does not exist is a mistake unless ``create``."""
    url = store_url_or_fail(store_url)
    path = _local_path(url)
    if path is not None and not create and not os.path.isdir(path):
        raise CliError(f"no store at {path!r} (the directory does not exist); check --store / LOOMRAY_STORE")
    from storage import open_store

    return open_store(url)


def parse_time(value: str | None) -> datetime | None:
    """An ISO-8601 time (naive means UTC), or a clear error."""
    if value is None:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise CliError(f"not an ISO-8601 time: {value!r}") from e
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def check_id(value: str | None, what: str) -> str | None:
    """Validate a session/user/checkpoint id the way the store does, as a one-line error."""
    if value is None:
        return None
    from storage.ids import validate_id

    try:
        return validate_id(value, what)
    except ValueError as e:
        raise CliError(first_line(str(e))) from e


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON (datetimes as ISO strings)."""
    click.echo(json.dumps(obj, default=str, indent=2))


def row_dict(row: Any) -> dict[str, Any]:
    """A pydantic model, dataclass or mapping as a plain dict."""
    if hasattr(row, "model_dump"):
        return row.model_dump(mode="json")
    if dataclasses.is_dataclass(row):
        return dataclasses.asdict(row)
    return dict(row)


def short_time(t: datetime | None) -> str:
    """``YYYY-mm-dd HH:MM:SS`` (UTC) or ``-``."""
    return "-" if t is None else t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


store_option = click.option(
    "--store", "store_url", envvar="LOOMRAY_STORE", metavar="URL",
    help="Store URL: a directory, file://..., s3://bucket/prefix (env LOOMRAY_STORE).",
)
address_option = click.option(
    "--address", envvar="RAY_ADDRESS", default=None, metavar="ADDR",
    help="Ray cluster address host:port (env RAY_ADDRESS).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
user_option = click.option("--user", "user_id", default=None, help="The user the session belongs to.")


def sql_to_arrow(con: Any, sql: str) -> Any:
    """Run ``sql`` on a DuckDB connection and return a pyarrow Table (method names differ across DuckDB 1/2)."""
    relation = con.sql(sql)
    if relation is None:  # a statement without a result (e.g. SET)
        import pyarrow as pa

        return pa.table({})
    for name in ("to_arrow_table", "fetch_arrow_table", "arrow"):
        method = getattr(relation, name, None)
        if method is not None:
            table = method()
            return table.read_all() if hasattr(table, "read_all") else table
    raise RuntimeError("this DuckDB version cannot return Arrow tables")
