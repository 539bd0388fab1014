"""What every ``loomray`` command shares: consoles, options, errors, opening the store.

Exit codes: a user mistake raises :class:`CliError` (one red line on stderr,
exit 2); a failed run, or a failure of the store or cluster that retries did
not cure, exits 1; an interrupt (Ctrl-C) exits 130; none prints a traceback
unless ``LOOMRAY_DEBUG=1``.
Nothing here imports Ray, so ``loomray --help`` and the store-side commands
stay fast.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, ParamSpec, TypeVar
from urllib.parse import unquote, urlparse

import click
import pyarrow as pa
from rich.console import Console

from loomray.errors import LoomrayRunError, LoomrayUserError
from loomray.storage import Store, open_store
from loomray.storage.errors import InvalidIdError, ObjectNotFound, StorageConfigError
from loomray.storage.ids import validate_id

console = Console()
err_console = Console(stderr=True)

EXIT_USER = 2
EXIT_RUN = 1
EXIT_INTERRUPTED = 130

#: Rich styles of session and checkpoint statuses in every table.
STATUS_STYLE = {"running": "cyan", "completed": "green", "failed": "red", "pending": "yellow", "active": "cyan",
                "awaiting_approval": "magenta", "paused": "yellow", "cancelled": "red"}

#: What a user's mistake looks like when it surfaces as an exception: reported as one line, exit 2.
#: A store configured wrong (credentials, permissions) is one; a storage failure (an outage after retries, a
#: corrupt object) is not: it exits 1 like a failed run.
USER_ERRORS: tuple[type[BaseException], ...] = (LoomrayUserError, ValueError, KeyError, FileNotFoundError,
                                                InvalidIdError, ObjectNotFound, StorageConfigError)

P = ParamSpec("P")
R = TypeVar("R")


class CliError(click.ClickException):
    """A user mistake: one line, exit code 2."""

    exit_code = EXIT_USER

    def show(self, file: Any = None) -> None:  # one clear line, no "Usage:" noise
        err_console.print(f"[bold red]error:[/] {self.format_message()}", highlight=False, soft_wrap=True)


def guarded(fn: Callable[P, R]) -> Callable[P, R | None]:
    """Turn expected failures into one line and an exit code instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt:
            err_console.print("interrupted")
            sys.exit(EXIT_INTERRUPTED)
        except Exception as raised:  # noqa: BLE001 - classify, then report the unexpected in one line too
            if os.environ.get("LOOMRAY_DEBUG"):
                raise
            report(actor_error(raised))
            return None

    return wrapper


def actor_error(e: BaseException) -> BaseException:
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
    if isinstance(e, USER_ERRORS):
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
        return unquote(urlparse(url).path)
    return None if "://" in url else url


def store_url_or_fail(store_url: str | None) -> str:
    """The store URL, or a clear error when none was given."""
    if not store_url:
        raise CliError("no store given: pass --store URL or set LOOMRAY_STORE "
                       "(a directory, file:///path or s3://bucket/prefix)")
    return store_url


def open_store_or_fail(store_url: str | None, *, create: bool = False) -> Store:
    """Open the store; a local directory that does not exist is a mistake unless ``create``."""
    url = store_url_or_fail(store_url)
    path = _local_path(url)
    if path is not None and not create and not os.path.isdir(path):
        raise CliError(f"no store at {path!r} (the directory does not exist); check --store / LOOMRAY_STORE")
    return open_store(url)


def open_session_store(store_url: str | None, session_id: str, user_id: str | None) -> Store:
    """Check a command's session and user ids, then open its store (the start of every per-session command)."""
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    return open_store_or_fail(store_url)


def session_exists(store: Store, session_id: str, user_id: str | None) -> bool:
    """True when the store knows the session at all (a status row or a journal)."""
    return store.sessions.get(session_id, user_id=user_id) is not None or bool(
        store.journal.runs(session_id, user_id=user_id))


def unknown_session(store: Store, session_id: str, user_id: str | None) -> CliError:
    """The error for a session the store does not know."""
    return CliError(f"unknown session {who(session_id, user_id)} in {store.describe()}")


def who(session_id: str, user_id: str | None) -> str:
    """A session as messages name it: ``'s1'``, or ``'s1' of user 'alice'``."""
    return f"{session_id!r}" + (f" of user {user_id!r}" if user_id else "")


#: A time given as a span before now: ``90s``, ``30m``, ``12h``, ``7d``, ``2w``.
_AGO = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_AGO_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}

#: The help text of every option that takes a time.
TIME_HELP = "an ISO-8601 time (naive means UTC) or a span before now: 30m, 12h, 7d, 2w"


def parse_time(value: str | None, *, now: datetime | None = None) -> datetime | None:
    """An ISO-8601 time (naive means UTC) or a span before ``now`` (``7d``), or a clear error."""
    if value is None:
        return None
    ago = _AGO.match(value)
    if ago:
        span = timedelta(**{_AGO_UNITS[ago.group(2)]: int(ago.group(1))})
        return (now or datetime.now(timezone.utc)) - span
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as e:
        raise CliError(f"not a time: {value!r} (expected {TIME_HELP})") from e
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def check_id(value: str | None, what: str) -> str | None:
    """Validate a session/user/checkpoint id the way the store does, as a one-line error."""
    if value is None:
        return None
    try:
        return validate_id(value, what)
    except ValueError as e:
        raise CliError(first_line(str(e))) from e


def sql_to_arrow(con: Any, sql: str) -> pa.Table:
    """Run ``sql`` on a DuckDB connection and return a pyarrow Table (method names differ across DuckDB 1/2)."""
    relation = con.sql(sql)
    if relation is None:  # a statement without a result (e.g. SET)
        return pa.table({})
    for name in ("to_arrow_table", "fetch_arrow_table", "arrow"):
        method = getattr(relation, name, None)
        if method is not None:
            table = method()
            return table.read_all() if hasattr(table, "read_all") else table
    raise RuntimeError("this DuckDB version cannot return Arrow tables")


def inherit_from_group(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """An option given after the subcommand wins; otherwise the same option given before it (``loomray --store X status``)."""
    if param.name is None or ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE:
        return value
    root = ctx.find_root()
    given = root.params.get(param.name) if root is not ctx else None
    return value if given is None else given


STORE_HELP = "Store URL: a directory, file://..., s3://bucket/prefix (env LOOMRAY_STORE)."
ADDRESS_HELP = "Ray cluster address host:port (env RAY_ADDRESS)."
store_option = click.option(
    "--store", "store_url", envvar="LOOMRAY_STORE", metavar="URL", callback=inherit_from_group, help=STORE_HELP,
)
address_option = click.option(
    "--address", envvar="RAY_ADDRESS", default=None, metavar="ADDR", callback=inherit_from_group, help=ADDRESS_HELP,
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
user_option = click.option("--user", "user_id", default=None, help="The user the session belongs to.")
