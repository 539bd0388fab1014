"""The cost of one model call: maintained prices, with local overrides.

Prices come from ``genai-prices`` (priced at the call's date, with
long-context tiers); ``LOOMRAY_PRICES=/path/to/prices.json`` and ``prices=``
override them model by model, later winning. An unknown model costs
``None``, never a guess, and every priced usage names its price's source
(``Usage.price_source``). The override format and the token accounting
convention are in docs/providers.md ("Usage and cost").
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import genai_prices
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loomray.errors import ModelConfigError
from loomray.records import Usage

#: Environment variable naming a JSON price file that overrides genai-prices.
PRICES_ENV = "LOOMRAY_PRICES"

#: What ``Usage.price_source`` says for a price that came from genai-prices.
MAINTAINED_SOURCE = f"genai-prices {genai_prices.__version__}"

_DATE_SUFFIX = re.compile(r"-(\d{8}|\d{4}-\d{2}-\d{2})$")


class Price(BaseModel):
    """One model's override prices, USD per million tokens. A missing cache price is unknown, not zero."""

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
        micro = (plain_input * self.input + usage.output_tokens * self.output
                 + usage.cache_read_tokens * (self.cache_read or 0.0)
                 + usage.cache_write_tokens * (self.cache_write or 0.0))
        return micro / 1_000_000


def maintained_cost(provider: str, model: str, usage: Usage, at: datetime | None = None) -> float | None:
    """USD for ``usage`` from genai-prices at the date ``at`` (now when None); None for a model it does not know."""
    counts = genai_prices.Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                                cache_read_tokens=usage.cache_read_tokens, cache_write_tokens=usage.cache_write_tokens)
    try:
        calc = genai_prices.calc_price(counts, model, provider_id=provider.lower(),
                                       genai_request_timestamp=at or datetime.now(timezone.utc))
    except LookupError:
        return None
    return float(calc.total_price)


class PriceTable:
    """Override prices by ``(provider, model)``, each with the source it came from: plain data, cheap to pickle."""

    def __init__(self, prices: Mapping[str, Mapping[str, Price]] | None = None, *, source: str = "prices= argument"):
        self._prices: dict[str, dict[str, tuple[Price, str]]] = {
            p.lower(): {m: (price, source) for m, price in models.items()} for p, models in (prices or {}).items()}

    @classmethod
    def from_data(cls, data: object, *, source: str) -> PriceTable:
        """Parse the override format; a malformed table is a :class:`ModelConfigError` naming ``source``."""
        if not isinstance(data, Mapping):
            raise ModelConfigError(f"price table {source}: expected a JSON object, got {type(data).__name__}")
        table = data.get("prices")
        if not isinstance(table, Mapping):
            raise ModelConfigError(f'price table {source}: expected a "prices" object mapping provider -> model '
                                   '-> prices')
        found = data.get("sources")
        sources: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        out = cls()
        for provider, models in table.items():
            if not isinstance(models, Mapping):
                raise ModelConfigError(f"price table {source}: prices.{provider} must be an object of models")
            for model, entry in models.items():
                try:
                    price = entry if isinstance(entry, Price) else Price.model_validate(entry)
                except ValidationError as e:
                    raise ModelConfigError(f"price table {source}: bad entry prices.{provider}.{model}: {e}") from e
                named = sources.get(provider)
                origin = str(named.get(model, source)) if isinstance(named, Mapping) else source
                out._prices.setdefault(str(provider).lower(), {})[str(model)] = (price, origin)
        return out

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
        return cls.from_data(data, source=os.fspath(path))

    def merged(self, other: PriceTable) -> PriceTable:
        """A new table: ``other``'s entries replace this one's, model by model."""
        out = PriceTable()
        out._prices = {p: dict(m) for p, m in self._prices.items()}
        for provider, models in other._prices.items():
            out._prices.setdefault(provider, {}).update(models)
        return out

    def _entry(self, provider: str, model: str) -> tuple[Price, str] | None:
        """The override of ``model`` at ``provider`` and its source, trying an undated id for a dated snapshot."""
        models = self._prices.get(provider.lower(), {})
        return models.get(model) or models.get(_DATE_SUFFIX.sub("", model))

    def quote(self, provider: str, model: str, usage: Usage, *,
              at: datetime | None = None) -> tuple[float | None, str | None]:
        """``(USD, source)`` for ``usage``: an override if one names the model, else genai-prices at ``at``."""
        entry = self._entry(provider, model)
        if entry is not None:
            return entry[0].cost(usage), f"override: {entry[1]}"
        cost = maintained_cost(provider, model, usage, at)
        return cost, (MAINTAINED_SOURCE if cost is not None else None)

    def to_data(self) -> dict[str, Any]:
        """The overrides in the file format, with each entry's source."""
        return {"prices": {p: {m: v[0].model_dump() for m, v in ms.items()} for p, ms in self._prices.items()},
                "sources": {p: {m: v[1] for m, v in ms.items()} for p, ms in self._prices.items()}}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PriceTable) and other._prices == self._prices

    def __repr__(self) -> str:
        return f"PriceTable({sum(len(m) for m in self._prices.values())} overrides over {MAINTAINED_SOURCE})"


def load_prices(prices: PriceTable | Mapping[str, Any] | str | os.PathLike | None = None) -> PriceTable:
    """Overrides from ``$LOOMRAY_PRICES``, then from ``prices``; every other model is priced by genai-prices.

    ``prices`` may be a :class:`PriceTable`, a mapping in the override format,
    or a path to such a file. Errors are :class:`ModelConfigError` naming the source.
    """
    table = PriceTable()
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
    raise ModelConfigError(f"prices must be a path, a mapping in the override format or a PriceTable, "
                           f"got {type(prices).__name__}")
