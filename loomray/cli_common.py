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
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import date, datetime, timezone
from datetime import time as dtime
from decimal import Decimal
from typing import Any

import click
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

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


def iso_time(t: datetime | None) -> str | None:
    """ISO 8601 with the "T" and a zone (a naive time is UTC): what every ``--json`` time looks like."""
    if t is None:
        return None
    return (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)).isoformat()


def _json_default(o: Any) -> Any:
    if isinstance(o, datetime):
        return iso_time(o)
    if isinstance(o, (date, dtime)):
        return o.isoformat()
    if isinstance(o, Decimal):
        return float(o)
    if isinstance(o, (set, frozenset)):
        return sorted(o, key=str)
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    return str(o)


def is_money_key(key: str) -> bool:
    """A field that holds US dollars (``cost_usd``, ``own_spend_usd``, ``sum(cost_usd)``...)."""
    k = key.lower()
    return "cost" in k or "usd" in k or "spend" in k


#: Decimals a dollar amount keeps in ``--json`` (float noise such as 0.22175700000000004 goes).
MONEY_DECIMALS = 6


def _tidy(obj: Any, dollars: bool = False) -> Any:
    """``obj`` with dollar amounts rounded to :data:`MONEY_DECIMALS` (recursively)."""
    if isinstance(obj, dict):
        return {k: _tidy(v, isinstance(k, str) and is_money_key(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tidy(v, dollars) for v in obj]
    if dollars and isinstance(obj, float) and math.isfinite(obj):
        return round(obj, MONEY_DECIMALS)
    return obj


def emit_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON: times ISO 8601 (``2026-05-01T12:00:00+00:00``), dollars to 6 decimals."""
    click.echo(json.dumps(_tidy(obj), default=_json_default, indent=2))


def row_dict(row: Any) -> dict[str, Any]:
    """A pydantic model, dataclass or mapping as a plain dict."""
    if hasattr(row, "model_dump"):
        return row.model_dump(mode="json")
    if dataclasses.is_dataclass(row):
        return dataclasses.asdict(row)
    return dict(row)


def short_time(t: datetime | None) -> str:
    """``YYYY-mm-dd HH:MM:SS`` (UTC) or ``-``."""
    return "-" if t is None else _utc(t).strftime("%Y-%m-%d %H:%M:%S")


def _utc(t: datetime) -> datetime:
    return (t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


def time_cells(times: Sequence[datetime | None], now: datetime | None = None) -> list[str]:
    """One column's times (UTC), never cut: ``HH:MM:SS`` when all are from today, else ``YYYY-mm-dd HH:MM``."""
    now = _utc(now or datetime.now(timezone.utc))
    known = [_utc(t) for t in times if t is not None]
    today = all(t.date() == now.date() for t in known)
    fmt = "%H:%M:%S" if today else "%Y-%m-%d %H:%M"
    return ["-" if t is None else _utc(t).strftime(fmt) for t in times]


def money(value: float | None) -> str:
    """Dollars for people: ``$0.2218``; ``-`` when unknown; ``<$0.0001`` for a tiny positive amount."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if 0 < abs(value) < 0.00005:
        return "<$0.0001" if value > 0 else "-<$0.0001"
    return f"-${-value:.4f}" if value < 0 else f"${value:.4f}"


def plain_cell(value: Any, column: str = "") -> str:
    """A query result value as table text: times UTC to the second, dollars as money, floats without noise."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return short_time(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if is_money_key(column):
            return money(value)
        return f"{value:.6g}"
    return str(value)


# --------------------------------------------------------------------- tables that fit the terminal


@dataclasses.dataclass
class Col:
    """A table column for :func:`fit_table`.

    ``drop``: 0 means always shown; otherwise the column goes when the table
    does not fit, highest ``drop`` first. ``wrap``: free text (prompts,
    outputs, causes) that may wrap onto more lines; every other column keeps
    its cells on one line, whole (ids are copied into the next command).
    """

    key: str
    header: str | None = None
    drop: int = 0
    wrap: bool = False
    justify: str = "left"
    min_wrap: int = 16

    @property
    def title(self) -> str:
        return self.key if self.header is None else self.header


def _cell(value: Any) -> Text:
    """A cell as rich Text, never parsed as markup (ids may hold "[")."""
    if isinstance(value, Text):
        return value
    return Text("-" if value is None else str(value))


def _lines_width(text: Text) -> int:
    """The width of a cell's widest line."""
    return max((line.cell_len for line in text.split("\n")), default=0)


def _table(cols: Sequence[Col], rows: Sequence[dict[str, Any]], *, measuring: bool, title: str | None,
           **table_kw: Any) -> Table:
    table = Table(title=title, **table_kw)
    for col in cols:
        if col.wrap:
            cap = max(col.min_wrap, len(col.title)) if measuring else None
            table.add_column(col.title, justify=col.justify, overflow="fold", max_width=cap)
        else:
            natural = max([len(col.title), *(_lines_width(_cell(r.get(col.key))) for r in rows)])
            table.add_column(col.title, justify=col.justify, no_wrap=True, min_width=natural)
    for r in rows:
        table.add_row(*(_cell(r.get(c.key)) for c in cols))
    return table


def table_width(cols: Sequence[Col], rows: Sequence[dict[str, Any]], **table_kw: Any) -> int:
    """Columns the table needs with its one-line cells whole and its wrapping columns at their minimum."""
    table = _table(cols, rows, measuring=True, title=None, **table_kw)
    return Measurement.get(console, console.options.update_width(100_000), table).maximum


def fit_columns(cols: Sequence[Col], rows: Sequence[dict[str, Any]], width: int | None = None,
                **table_kw: Any) -> tuple[list[Col], bool]:
    """The columns that fit ``width`` (the terminal's): optional ones dropped, highest ``drop`` first.

    Returns ``(columns, fits)``; ``fits`` is False when even the columns that
    are always shown do not fit.
    """
    width = console.width if width is None else width
    kept = list(cols)
    while table_width(kept, rows, **table_kw) > width:
        optional = [c for c in kept if c.drop > 0]
        if not optional:
            return kept, False
        worst = max(optional, key=lambda c: (c.drop, kept.index(c)))
        kept.remove(worst)
    return kept, True


def fit_table(cols: Sequence[Col], rows: Sequence[dict[str, Any]], *, title: str | None = None,
              width: int | None = None, **table_kw: Any) -> Table:
    """A rich Table of ``rows`` (dicts by column key) that fits the terminal without cutting a one-line cell.

    Optional columns are dropped as needed (``--json`` has everything); if
    the essential ones still do not fit, their cells fold onto more lines
    rather than being cut with "…".
    """
    kept, fits = fit_columns(cols, rows, width, **table_kw)
    table = _table(kept, rows, measuring=False, title=title, **table_kw)
    if not fits:
        for column in table.columns:
            column.no_wrap, column.overflow, column.min_width = False, "fold", None
    return table


def print_records(rows: Sequence[dict[str, Any]], *, title: str | None = None) -> None:
    """Rows too wide for a table, one block per row of ``key  value`` lines (long values wrap, never cut)."""
    if title:
        console.print(title, highlight=False, soft_wrap=True)
    for i, row in enumerate(rows, 1):
        head = f"-[ row {i} ]"
        console.print(head + "-" * max(0, min(console.width, 40) - len(head)), highlight=False)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column(overflow="fold")
        for k, v in row.items():
            grid.add_row(Text(str(k)), _cell(v))
        console.print(grid)


# --------------------------------------------------------------------- progress and confirmation


progress_option = click.option(
    "--progress", "show_progress", is_flag=True,
    help="Report progress on stderr even when it is not a terminal (on a terminal it always is).")


def stderr_is_tty() -> bool:
    """Whether stderr is a terminal (a live progress display makes sense there)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def stdin_is_tty() -> bool:
    """Whether stdin is a terminal (someone can answer a question)."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False


class Activity:
    """Progress of one long command on stderr, never on stdout (``--json`` stays parseable).

    On a terminal: a live spinner with the current step and the elapsed time,
    gone when the work ends. With ``--progress`` elsewhere (a log, CI): one
    plain line per step, with the seconds elapsed. Otherwise nothing.
    """

    def __init__(self, what: str, force: bool = False) -> None:
        self.what = what
        self.live = stderr_is_tty()
        self.enabled = self.live or force
        self._started = time.monotonic()
        self._progress: Any = None
        self._task: Any = None

    def __enter__(self) -> Activity:
        self._started = time.monotonic()
        if self.live:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=err_console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.what, total=None)
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def step(self, text: str) -> None:
        """Report the step now under way."""
        if self._progress is not None:
            self._progress.update(self._task, description=f"{self.what}: {text}")
        elif self.enabled:
            err_console.print(f"{self.what}: {text} ({self.elapsed():.1f} s)", highlight=False, soft_wrap=True)

    def pause(self) -> None:
        """Stop the live display (before a question on the terminal)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.pause()
        if self.enabled and not self.live:
            state = "done" if exc_type is None else "stopped"
            err_console.print(f"{self.what}: {state} in {self.elapsed():.1f} s", highlight=False, soft_wrap=True)


def iter_progress(activity: Activity, items: Sequence[Any], label: str) -> Iterator[Any]:
    """``items`` while reporting ``label i/n`` on ``activity`` (plain lines at most ~20 times)."""
    n = len(items)
    every = 1 if activity.live else max(1, n // 20)
    for i, item in enumerate(items, 1):
        if i == 1 or i == n or i % every == 0:
            activity.step(f"{label} {i}/{n}")
        yield item


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
