"""How values look in ``loomray`` output: JSON for scripts, times and dollars for people.

``--json`` times are ISO 8601 with the "T" and a zone (a naive time is UTC)
and dollars are rounded to :data:`MONEY_DECIMALS`; table cells show times in
UTC, whole, and dollars as ``$0.2218``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from datetime import date, datetime, timezone
from datetime import time as dtime
from decimal import Decimal
from typing import Any

import click

from loomray.cli.common import console

#: Decimals a dollar amount keeps in ``--json`` (float noise such as 0.22175700000000004 goes).
MONEY_DECIMALS = 6


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


def _tidy(obj: Any, dollars: bool = False) -> Any:
    """``obj`` with dollar amounts rounded to :data:`MONEY_DECIMALS` (recursively)."""
    if isinstance(obj, dict):
        return {k: _tidy(v, isinstance(k, str) and is_money_key(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tidy(v, dollars) for v in obj]
    if dollars and isinstance(obj, float) and math.isfinite(obj):
        return round(obj, MONEY_DECIMALS)
    return obj


def emit_json(obj: object) -> None:
    """Print ``obj`` as indented JSON: times ISO 8601 (``2026-05-01T12:00:00+00:00``), dollars to 6 decimals."""
    click.echo(json.dumps(_tidy(obj), default=_json_default, indent=2))


def tell(as_json: bool, data: dict[str, Any], text: str) -> None:
    """What a command that did one thing prints: ``data`` as JSON for scripts, else ``text``, one line for people."""
    if as_json:
        emit_json(data)
    else:
        console.print(text, highlight=False, soft_wrap=True)


def row_dict(row: Any) -> dict[str, Any]:
    """A pydantic model, dataclass or mapping as a plain dict."""
    if hasattr(row, "model_dump"):
        return row.model_dump(mode="json")
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
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


def parse_iso(value: object) -> datetime | None:
    """A datetime (a naive one is UTC) from a datetime or an ISO string; None for anything else or bad text."""
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    return None


def money(value: float | None) -> str:
    """Dollars for people: ``$0.2218``; ``-`` when unknown; ``<$0.0001`` for a tiny positive amount."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if 0 < abs(value) < 0.00005:
        return "<$0.0001" if value > 0 else "-<$0.0001"
    return f"-${-value:.4f}" if value < 0 else f"${value:.4f}"


def count(n: int, what: str, plural: str | None = None) -> str:
    """``1 checkpoint``, ``2 checkpoints``, ``3 journal entries``."""
    return f"{n} {what if n == 1 else plural or what + 's'}"


def excerpt(text: object, n: int) -> str:
    """``text`` on one line, at most ``n`` characters (cut with "...")."""
    text = " ".join(str(text or "").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def plain_cell(value: object, column: str = "") -> str:
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
