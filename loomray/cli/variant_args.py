"""Variants on the command line: ``--variant JSON`` or ``--variant @FILE``, in the form a fork stores them.

The JSON is :meth:`loomray.Variant.to_json`'s: ``prompt``, ``model`` (a
name), ``instructions``, ``tools`` (names of the agent's tools), ``tuning``
(``Tuning`` fields) and ``edits`` (``{"op": "replace"|"drop"|"insert",
"index": i, "message": {...}}``). Anything else is one clear line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from loomray.cli.common import CliError
from loomray.variants import Variant


def parse_variants(values: tuple[str, ...] | list[str]) -> list[Variant]:
    """Every variant of repeated ``--variant`` values, each a JSON object or a list of them (or ``@path``)."""
    return [v for text in values for v in _parse(text)]


def _parse(text: str) -> list[Variant]:
    source = "--variant"
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text(encoding="utf-8")
        except OSError as e:
            raise CliError(f"cannot read variant file {source!r}: {e.strerror or e}") from e
    try:
        data = json.loads(text)
    except ValueError as e:
        raise CliError(f"{source}: not JSON ({e})") from e
    items = data if isinstance(data, list) else [data]
    # A VariantError (a user error) names what is wrong; a null field is as good as an absent one.
    return [Variant.from_json({k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item)
            for item in items]
