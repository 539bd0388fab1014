"""Models: the :class:`Model` protocol, :class:`ScriptedModel`, and name resolution.

Provider adapters (``claude-*``, ``gpt-*``) are loaded by :func:`resolve_model`
only when asked for, so their SDKs stay optional.
"""

from loomray.models.base import Model, ModelRequest, ModelResponse
from loomray.models.resolve import resolve_model
from loomray.models.scripted import ScriptedModel

__all__ = ["Model", "ModelRequest", "ModelResponse", "ScriptedModel", "resolve_model"]
