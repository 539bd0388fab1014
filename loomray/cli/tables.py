"""Tables that fit the terminal: optional columns are dropped, ids, statuses and times are never cut.

``--json`` has everything a table leaves out; a table whose essential
columns still do not fit folds its cells onto more lines rather than cutting
them with "…" (an id is what people copy into the next command).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rich.console import JustifyMethod
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from loomray.cli.common import console


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
    justify: JustifyMethod = "left"
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
