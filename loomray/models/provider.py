"""What the provider adapters share: settings, lazy clients, typed errors, cost.

The SDK client is built on first use, one per running event loop (an async HTTP pool belongs to the loop
that opened it), and dropped when the adapter is pickled: shipping an agent to a Ray actor never ships a
client or a key (docs/providers.md). Retries are the SDK's own; what is left becomes a typed error.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Mapping
from typing import Any

from loomray.errors import ModelAuthError, ModelBadRequestError, ModelConfigError, ModelError
from loomray.models.names import provider_for
from loomray.models.pricing import PriceTable, load_prices
from loomray.records import Usage

#: Statuses that mean "your credentials are wrong", and "your request is wrong".
_AUTH_STATUSES = frozenset({401, 403})
_BAD_REQUEST_STATUSES = frozenset({400, 404, 413, 422})


class ProviderModel:
    """Base of the SDK-backed adapters. Subclasses set the class attributes and ``_make_client``."""

    #: Provider id as used in ``"provider:model"`` names and in the price table.
    provider: str = ""
    #: The pip extra that installs the SDK.
    extra: str = ""
    #: Top-level module of the SDK.
    sdk_module: str = ""
    #: Environment variables any one of which supplies the credential.
    key_envs: tuple[str, ...] = ()

    def __init__(self, model: str, *, api_key: str | None = None, base_url: str | None = None, max_retries: int = 4,
                 timeout: float = 300.0, max_tokens: int | None = None, prices: Any = None,
                 extra_body: Mapping[str, Any] | None = None):
        if not isinstance(model, str) or not model.strip():
            raise ModelConfigError(f"{self.provider} model name must be a non-empty string, got {model!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ModelConfigError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ModelConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.model = model.strip()
        self.base_url = base_url
        self.max_retries = max_retries
        self.timeout = float(timeout) if timeout is not None else None
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.prices: PriceTable = load_prices(prices)
        self._api_key = api_key
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._sdk()  # a missing extra fails now, when the Agent is built
        self._credential()  # and so does a missing key

    # -- identity --------------------------------------------------------

    @property
    def name(self) -> str:
        """The string that resolves back to this adapter (what a checkpoint records)."""
        try:
            if provider_for(self.model) == (self.provider, self.model):
                return self.model
        except ModelConfigError:
            pass
        return f"{self.provider}:{self.model}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model!r}, base_url={self.base_url!r}, max_retries={self.max_retries})"

    # -- pickling: settings only -----------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_clients"] = {}
        state["_api_key"] = None  # never ship a key; the receiver reads its environment
        state["prices"] = self.prices.to_data()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        prices = state.pop("prices")
        self.__dict__.update(state)
        self.prices = PriceTable.from_data(prices, source=f"pickled {self.provider} adapter")

    # -- SDK and credentials ---------------------------------------------

    def _sdk(self) -> Any:
        try:
            return importlib.import_module(self.sdk_module)
        except ImportError as e:
            raise ModelConfigError(f"model {self.provider}:{self.model} needs the {self.sdk_module!r} SDK: "
                                   f"pip install 'loomray[{self.extra}]' ({e})") from e

    def _credential(self) -> tuple[str, str]:
        """``(env var or 'api_key', value)`` of the credential to use; ModelConfigError if none."""
        if self._api_key:
            return "api_key", self._api_key
        for var in self.key_envs:
            value = os.environ.get(var)
            if value:
                return var, value
        raise ModelConfigError(f"model {self.provider}:{self.model} needs credentials: set "
                               f"{' or '.join(self.key_envs)} (or pass api_key=...)")

    def _make_client(self, sdk: Any, credential: tuple[str, str]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def client(self) -> Any:
        """The SDK's async client for the running event loop, built on first use."""
        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is not None and entry[0] is loop:
            return entry[1]
        # Drop clients of loops that are gone; their pools cannot be reused.
        self._clients = {k: v for k, v in self._clients.items() if not v[0].is_closed()}
        client = self._make_client(self._sdk(), self._credential())
        self._clients[id(loop)] = (loop, client)
        return client

    # -- results ---------------------------------------------------------

    def priced(self, usage: Usage, *, served_by: str | None = None) -> Usage:
        """``usage`` with ``cost_usd`` priced now (None when unknown) and the ``price_source`` it came from."""
        cost, source = self.prices.quote(self.provider, self.model, usage)
        if cost is None and served_by and served_by != self.model:
            cost, source = self.prices.quote(self.provider, served_by, usage)
        return usage.model_copy(update={"cost_usd": cost, "price_source": source})

    def translate_error(self, sdk: Any, err: BaseException) -> BaseException:
        """Map an SDK exception to loomray's typed errors, naming provider and model."""
        where = f"{self.provider} model {self.model!r}"
        status = getattr(err, "status_code", None)
        detail = _error_detail(err)
        who: dict[str, Any] = {"provider": self.provider, "model": self.model}
        if isinstance(err, sdk.APIStatusError) and status is not None:
            if status in _AUTH_STATUSES:
                return ModelAuthError(f"{where}: authentication failed ({status}): {detail}; check "
                                      f"{' / '.join(self.key_envs)}", status=status, **who)
            if status in _BAD_REQUEST_STATUSES:
                return ModelBadRequestError(f"{where}: request rejected ({status}): {detail}", status=status, **who)
            return ModelError(f"{where}: call failed ({status}) after {self.max_retries} retries: {detail}",
                              status=status, **who)
        if isinstance(err, sdk.APITimeoutError):
            return ModelError(f"{where}: timed out after {self.timeout}s per attempt ({self.max_retries} retries)",
                              **who)
        if isinstance(err, sdk.APIConnectionError):
            return ModelError(f"{where}: cannot reach the API ({self.max_retries} retries): {detail}", **who)
        return ModelError(f"{where}: {type(err).__name__}: {detail}", **who)


def _error_detail(err: BaseException) -> str:
    """The provider's own error message when the body has one, else the exception text."""
    body = getattr(err, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    message = getattr(err, "message", None)
    return str(message or err or type(err).__name__)


def closed_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a JSON schema with ``additionalProperties: false`` on every object that lacks it.

    Both providers' structured-output modes want closed objects; pydantic's
    ``model_json_schema()`` leaves them open.
    """

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: walk(v) for k, v in node.items()}
            if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
                out["additionalProperties"] = False
            return out
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def all_required(schema: Any) -> bool:
    """True when every object in ``schema`` lists all its properties as required (OpenAI strict mode)."""
    if isinstance(schema, dict):
        props = schema.get("properties")
        if isinstance(props, dict) and set(props) - set(schema.get("required", [])):
            return False
        return all(all_required(v) for v in schema.values())
    if isinstance(schema, list):
        return all(all_required(v) for v in schema)
    return True
