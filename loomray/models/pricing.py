"""Token prices as data, and the cost of one model call.

The table ships as ``prices.json`` beside this module (USD per million tokens,
keyed by provider and model id). Users override it without touching code:

- ``LOOMRAY_PRICES=/path/to/prices.json`` in the environment, and/or
- ``prices=`` given to an adapter (or to ``resolve_model``): a path, a mapping
  in the same format, or a :class:`PriceTable`.

Later sources win per model: built-in < ``LOOMRAY_PRICES`` < ``prices=``.

Token accounting convention (the same for every provider): ``Usage.input_tokens``
counts *every* prompt token, cached or not; ``cache_read_tokens`` and
``cache_write_tokens`` are the parts of it read from / written to the prompt
cache. The cost is therefore::

    (input - cache_read - cache_write) * input_price
    + cache_read * cache_read_price + cache_write * cache_write_price
    + output * output_price

A model the table does not know costs ``None``, and so does a call that used a
token category whose price the table leaves empty: an unknown cost is never a
guess. A dated id (``claude-haiku-4-5-20251001``, ``gpt-4o-2024-08-06``) uses its
undated entry, because providers price snapshots like their alias; no other
fuzzy matching is done (``gpt-4o-mini`` never falls back to ``gpt-4o``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loomray.errors import ModelConfigError
from loomray.records import Usage

#: Environment variable naming a JSON price file that overrides the built-in table.
PRICES_ENV = "LOOMRAY_PRICES"

_DATE_SUFFIX = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2})$")


class Price(BaseModel):
    """One model's prices, USD per million tokens. A missing cache price is unknown, not zero."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: float = Field(ge=0)
    output: float = Field(ge=0)
    cache_read: float | None = Field(default=None, ge=0)
    cache_write: float | None = Field(default=None, ge=0)

    def cost(self, usage: Usage) -> float | None:
        """USD for ``usage`` at these prices, or None when a used category has no price."""
        if usage.cache_read_tokens and self.cache_read is None:
            return None
        if usage.cache_write_tokens and self.cache_write is None:
            return None
        plain_input = max(usage.input_tokens - usage.cache_read_tokens - usage.cache_write_tokens, 0)
        micro = (
            plain_input * self.input
            + usage.output_tokens * self.output
            + usage.cache_read_tokens * (self.cache_read or 0.0)
            + usage.cache_write_tokens * (self.cache_write or 0.0)
        )
        return micro / 1_000_000


class PriceTable:
    """Prices by ``(provider, model)``: plain data, cheap to pickle with an adapter."""

    def __init__(self, prices: Mapping[str, Mapping[str, Price]] | None = None):
        self._prices: dict[str, dict[str, Price]] = {p: dict(models) for p, models in (prices or {}).items()}

    @classmethod
    def from_data(cls, data: Any, *, source: str) -> PriceTable:
        """Parse the ``prices.json`` format; a malformed table is a :class:`ModelConfigError` naming ``source``."""
        if not isinstance(data, Mapping):
            raise ModelConfigError(f"price table {source}: expected a JSON object, got {type(data).__name__}")
        table = data.get("prices")
        if not isinstance(table, Mapping):
            raise ModelConfigError(
                f'price table {source}: expected a "prices" object mapping provider -> model -> prices'
            )
        parsed: dict[str, dict[str, Price]] = {}
        for provider, models in table.items():
            if not isinstance(models, Mapping):
                raise ModelConfigError(f"price table {source}: prices.{provider} must be an object of models")
            for model, entry in models.items():
                try:
                    price = entry if isinstance(entry, Price) else Price.model_validate(entry)
                except ValidationError as e:
                    raise ModelConfigError(f"price table {source}: bad entry prices.{provider}.{model}: {e}") from e
                parsed.setdefault(str(provider).lower(), {})[str(model)] = price
        return cls(parsed)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> PriceTable:
        """Load a JSON price file; a missing or unreadable file is a :class:`ModelConfigError`."""
        try:
            raw = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ModelConfigError(f"cannot read price table {os.fspath(path)!r}: {e}") from e
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ModelConfigError(f"price table {os.fspath(path)!r} is not valid JSON: {e}") from e
        return cls.from_data(data, source=repr(os.fspath(path)))

    @classmethod
    def builtin(cls) -> PriceTable:
        """The table shipped with loomray (``loomray/models/prices.json``)."""
        raw = resources.files("loomray.models").joinpath("prices.json").read_text(encoding="utf-8")
        return cls.from_data(json.loads(raw), source="loomray/models/prices.json")

    def merged(self, other: PriceTable) -> PriceTable:
        """A new table: ``other``'s entries replace this one's, model by model."""
        out = {p: dict(m) for p, m in self._prices.items()}
        for provider, models in other._prices.items():
            out.setdefault(provider, {}).update(models)
        return PriceTable(out)

    def lookup(self, provider: str, model: str) -> Price | None:
        """The price of ``model`` at ``provider``, trying an undated id for a dated snapshot."""
        models = self._prices.get(provider.lower(), {})
        if model in models:
            return models[model]
        undated = _DATE_SUFFIX.sub("", model)
        return models.get(undated)

    def cost(self, provider: str, model: str, usage: Usage) -> float | None:
        """USD for ``usage`` on ``model``, or None when the model or a used category is unpriced."""
        price = self.lookup(provider, model)
        return None if price is None else price.cost(usage)

    def to_data(self) -> dict[str, Any]:
        """The table in ``prices.json`` format."""
        return {"prices": {p: {m: v.model_dump() for m, v in ms.items()} for p, ms in self._prices.items()}}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PriceTable) and other._prices == self._prices

    def __repr__(self) -> str:
        return f"PriceTable({sum(len(m) for m in self._prices.values())} models)"


def load_prices(prices: PriceTable | Mapping[str, Any] | str | os.PathLike | None = None) -> PriceTable:
    """Built-in prices, overridden by ``$LOOMRAY_PRICES`` and then by ``prices``.

    ``prices`` may be a :class:`PriceTable`, a mapping in ``prices.json`` format,
    or a path to such a file. Errors are :class:`ModelConfigError` naming the source.
    """
    table = PriceTable.builtin()
    env_path = os.environ.get(PRICES_ENV)
    if env_path:
        table = table.merged(PriceTable.from_file(env_path))
    if prices is None:
        return table
    if isinstance(prices, PriceTable):
        return table.merged(prices)
    if isinstance(prices, (str, os.PathLike)):
        return table.merged(PriceTable.from_file(prices))
    if isinstance(prices, Mapping):
        return table.merged(PriceTable.from_data(prices, source="prices= argument"))
    raise ModelConfigError(
        f"prices must be a path, a mapping in prices.json format or a PriceTable, got {type(prices).__name__}"
    )
