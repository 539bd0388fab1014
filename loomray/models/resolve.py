"""Model name resolution: a string becomes a :class:`Model`, chosen explicitly by name (the rules:
docs/providers.md, "Which provider serves a name").

A missing SDK extra or credential is a :class:`~loomray.errors.ModelConfigError` raised here, when the
Agent is built, not at the first model call; ``settings`` go to the adapter.
"""

from __future__ import annotations

from typing import Any

from loomray.errors import ModelConfigError
from loomray.models.anthropic import AnthropicModel
from loomray.models.base import Model
from loomray.models.names import provider_for
from loomray.models.openai import OpenAIModel
from loomray.models.research import ResearchModel


def resolve_model(model: str | Model, **settings: Any) -> Model:
    """Return a ready :class:`Model` for ``model`` (a name or an instance)."""
    if not isinstance(model, str):
        if not isinstance(model, Model):
            raise TypeError(f"model must be a str or a Model, got {type(model).__name__}")
        return model
    provider, name = provider_for(model)
    if provider == "demo":
        return ResearchModel(name=model, **settings)
    if provider == "anthropic":
        return AnthropicModel(name, **settings)
    if provider == "openai":
        return OpenAIModel(name, **settings)
    raise ModelConfigError(f"unknown model provider {provider!r} in {model!r}")
