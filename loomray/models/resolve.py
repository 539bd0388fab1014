"""Model name resolution: a string becomes a :class:`Model`, chosen explicitly by name.

- a :class:`Model` instance passes through;
- ``"provider:model"`` picks the provider explicitly (``anthropic:``, ``openai:``, ``demo:``);
- ``claude-*`` resolves to Anthropic, ``gpt-*`` / ``o1*`` / ``o3*`` / ``o4*`` to OpenAI;
- anything else is a :class:`~loomray.errors.ModelConfigError` raised when the Agent is built.

Provider SDKs are optional extras; a missing extra or credential is a clear
:class:`~loomray.errors.ModelConfigError` raised here, when the Agent is built,
not at the first model call. ``settings`` (``base_url``, ``max_retries``,
``timeout``, ``max_tokens``, ``prices``, ``api_key``...) go to the adapter.
"""

from __future__ import annotations

import re

from loomray.errors import ModelConfigError
from loomray.models.base import Model

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
    raise ModelConfigError(
        f"cannot tell which provider serves model {name!r}; use 'anthropic:NAME', 'openai:NAME' "
        "or pass a Model instance"
    )


def resolve_model(model: str | Model, **settings) -> Model:
    """Return a ready :class:`Model` for ``model`` (a name or an instance)."""
    if not isinstance(model, str):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a str or a Model, got {type(model).__name__}")
        return model
    provider, name = provider_for(model)
    if provider == "demo":
        from loomray.models.research import ResearchModel

        return ResearchModel(name=model, **settings)
    if provider == "anthropic":
        try:
            from loomray.models.anthropic import AnthropicModel
        except ImportError as e:
            raise ModelConfigError(
                f"model {model!r} needs the Anthropic adapter: pip install 'loomray[anthropic]' ({e})"
            ) from e
        return AnthropicModel(name, **settings)
    if provider == "openai":
        try:
            from loomray.models.openai import OpenAIModel
        except ImportError as e:
            raise ModelConfigError(
                f"model {model!r} needs the OpenAI adapter: pip install 'loomray[openai]' ({e})"
            ) from e
        return OpenAIModel(name, **settings)
    raise ModelConfigError(f"unknown model provider {provider!r} in {model!r}")
