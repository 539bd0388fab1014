"""Which provider serves a model name: ``"provider:model"``, or told by the name itself."""

from __future__ import annotations

import re

from loomray.errors import ModelConfigError

_OPENAI_NAME = re.compile(r"^(gpt-|o[1-9](-|$)|chatgpt-)")


def provider_for(name: str) -> tuple[str, str]:
    """Split a model name into ``(provider, model)``."""
    if not isinstance(name, str) or not name.strip():
        raise ModelConfigError(f"model name must be a non-empty string, got {name!r}")
    name = name.strip()
    if ":" in name:
        provider, _, model = name.partition(":")
        if not model.strip():
            raise ModelConfigError(f"model name {name!r} names provider {provider!r} but no model")
        return provider.strip().lower(), model.strip()
    if name.startswith("claude-"):
        return "anthropic", name
    if _OPENAI_NAME.match(name):
        return "openai", name
    raise ModelConfigError(f"cannot tell which provider serves model {name!r}; use 'anthropic:NAME', "
                           "'openai:NAME' or pass a Model instance")
