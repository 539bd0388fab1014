"""The model protocol: one async ``complete`` call, provider-neutral records.

The loop depends only on this. Durability (the journal) wraps a model from the
outside; providers adapt their SDKs to it in their own modules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from loomray.records import Message, Usage

#: A callback the loop passes so a streaming model can report text deltas as they arrive.
DeltaCallback = Callable[[str], Awaitable[None] | None]


class ModelRequest(BaseModel):
    """Everything a model needs for one call. Plain data: hashable into the journal."""

    model_config = ConfigDict(frozen=True)

    messages: list[Message]
    #: Tool JSON schemas: ``{"name", "description", "parameters"}`` each.
    tools: list[dict[str, Any]] = Field(default_factory=list)
    #: JSON schema the final answer must satisfy, or None.
    output_schema: dict[str, Any] | None = None
    #: Reasoning effort hint ("low" | "medium" | "high") or None.
    effort: str | None = None


class ModelResponse(BaseModel):
    """One model answer: an assistant message plus what it cost."""

    model_config = ConfigDict(frozen=True)

    message: Message
    usage: Usage = Field(default_factory=Usage)
    #: Provider-specific stop reason, informational.
    stop_reason: str | None = None
    #: The provider's model id that answered, informational.
    model: str | None = None
    #: The provider's id of this answer (a message or completion id), informational.
    id: str | None = None


@runtime_checkable
class Model(Protocol):
    """What the loop calls. ``name`` is what a checkpoint records, never the client."""

    @property
    def name(self) -> str:
        """The model's name as :func:`loomray.models.resolve_model` takes it back (an attribute will do)."""
        ...

    async def complete(self, request: ModelRequest) -> ModelResponse: ...


async def complete_with_stream(model: Model, request: ModelRequest, on_delta: DeltaCallback | None) -> ModelResponse:
    """Call ``model``, streaming text deltas to ``on_delta`` when the model supports it.

    A model may offer ``async def stream(request, on_delta) -> ModelResponse``;
    others are called with ``complete`` and report nothing until they finish.
    """
    stream = getattr(model, "stream", None)
    if on_delta is not None and stream is not None:
        return await stream(request, on_delta)
    return await model.complete(request)
