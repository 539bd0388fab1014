"""Models: the :class:`Model` protocol, :class:`ScriptedModel`, and name resolution.

A provider adapter (``claude-*``, ``gpt-*``) imports its SDK only when one of
its models is built by :func:`resolve_model`, so the SDKs stay optional.
"""

from loomray.models.base import Model, ModelRequest, ModelResponse
from loomray.models.resolve import resolve_model
from loomray.models.scripted import ScriptedModel

__all__ = ["Model", "ModelRequest", "ModelResponse", "ScriptedModel", "resolve_model"]
