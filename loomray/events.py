"""Typed events the loop emits as they happen.

Every event is a frozen pydantic model with a ``type`` tag, so a consumer can
``match event.type`` or ``isinstance`` and can serialize any event as JSON
(``event.model_dump_json()``) to stream it across a process or actor boundary.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from loomray.records import Message, ToolCall, Usage, utcnow


class Event(BaseModel):
    """Fields every event carries."""

    model_config = ConfigDict(frozen=True)

    type: str
    session_id: str
    run_id: str | None = None
    #: Passes completed when the event happened (the pass in flight is ``turn``, 0-based).
    turn: int = 0
    at: datetime = Field(default_factory=utcnow)


class RunStart(Event):
    """A run began (fresh, restored from a checkpoint, or replaying its journal)."""

    type: Literal["run_start"] = "run_start"
    prompt: str | None = None
    kind: str = "run"
    restored_checkpoint_id: str | None = None
    replaying: bool = False
    user_id: str | None = None
    #: The session this one was forked from (None: not a fork).
    forked_from: str | None = None
    #: The W3C ``traceparent`` the run was requested under (see :mod:`loomray.telemetry.context`).
    trace_parent: str | None = None


class ModelCall(Event):
    """The loop is about to ask the model (or the journal) for pass ``turn``'s answer."""

    type: Literal["model_call"] = "model_call"
    message_count: int
    step_key: str


class TextDelta(Event):
    """A piece of the model's answer as it streams in (live calls only; a replayed turn is not streamed)."""

    type: Literal["text_delta"] = "text_delta"
    step_key: str
    text: str


class ModelResponseEvent(Event):
    """The model answered; ``replayed`` when the answer came from the journal."""

    type: Literal["model_response"] = "model_response"
    message: Message
    usage: Usage
    replayed: bool = False
    #: The journal step of the call this answers (the matching ``model_call``'s ``step_key``).
    step_key: str | None = None
    #: What the provider said of its answer: the model that served it, the answer's id, why it stopped.
    response_model: str | None = None
    response_id: str | None = None
    finish_reason: str | None = None


class ToolCallEvent(Event):
    """A tool call is about to run (or replay)."""

    type: Literal["tool_call"] = "tool_call"
    tool_call: ToolCall


class ToolResultEvent(Event):
    """A tool call's result (``is_error`` when the tool failed)."""

    type: Literal["tool_result"] = "tool_result"
    tool_call_id: str
    name: str
    content: str
    is_error: bool = False
    replayed: bool = False


class CheckpointEvent(Event):
    """A checkpoint write finished (``ok=False``: it failed and the run went on)."""

    type: Literal["checkpoint"] = "checkpoint"
    checkpoint_id: str
    position: str
    execution_status: str
    size: int
    #: False when the write failed (the run goes on; a warning was logged).
    ok: bool = True
    error: str | None = None


class ReplayedStep(Event):
    """A step was answered from the journal instead of being executed."""

    type: Literal["replayed_step"] = "replayed_step"
    step_key: str
    kind: str


class DeterminismViolation(Event):
    """A journaled step's inputs changed: it re-executes instead of replaying."""

    type: Literal["determinism_violation"] = "determinism_violation"
    step_key: str
    kind: str
    journaled_hash: str
    actual_hash: str


class CondenseEvent(Event):
    """The transcript was condensed to stay under ``Tuning.condense_after_tokens`` (see :mod:`loomray.condense`)."""

    type: Literal["condense"] = "condense"
    tokens_before: int
    tokens_after: int
    messages_before: int
    messages_after: int


class CompactionEvent(CondenseEvent):
    """Deprecated (removed in the next release): the old name of :class:`CondenseEvent`, kind ``"compaction"``.

    The loop emits :class:`CondenseEvent` (kind ``"condense"``); this class reads events of the old kind back
    (:func:`event_from_dict`), and warns whenever one is built.
    """

    type: Literal["compaction"] = "compaction"  # type: ignore[assignment]

    def __init__(self, **data: Any) -> None:
        warnings.warn("CompactionEvent (event kind 'compaction') is deprecated: the loop emits CondenseEvent "
                      "(kind 'condense')", DeprecationWarning, stacklevel=2)
        super().__init__(**data)


class ControlEvent(Event):
    """A control request took effect at this point of the run (see :mod:`loomray.control`).

    ``kind`` is "signal" (``text`` joined the transcript as a user message),
    "pause" (the run stops here), "approval" (``approved``/``reason`` decided
    tool call ``tool_call_id``) or "cancel". ``replayed`` when it was applied
    again from the journal (recovery), not consumed now.
    """

    type: Literal["control"] = "control"
    kind: str
    control: str | None = None
    text: str | None = None
    tool_call_id: str | None = None
    approved: bool | None = None
    reason: str | None = None
    replayed: bool = False


class RunEnd(Event):
    """The run returned: completed, or stopped with ``stop_reason`` (awaiting approval, paused, ...)."""

    type: Literal["run_end"] = "run_end"
    output: str
    usage: Usage
    model_calls: int
    stop_reason: str


class RunError(Event):
    """The run stopped with an exception (re-raised to the caller)."""

    type: Literal["run_error"] = "run_error"
    error_type: str
    error: str


#: Every event class, told apart by ``type`` (a discriminated union: only the class of the event's kind is tried).
AnyEvent = Annotated[Union[  # noqa: UP007 - a runtime alias for pydantic, not an annotation
    RunStart, ModelCall, TextDelta, ModelResponseEvent, ToolCallEvent, ToolResultEvent, CheckpointEvent,
    ReplayedStep, DeterminismViolation, CondenseEvent, CompactionEvent, ControlEvent, RunEnd, RunError,
], Field(discriminator="type")]

#: A user callback: sync or async, called with each event in order.
EmitFn = Callable[[Event], Awaitable[None] | None]


async def deliver(emit: EmitFn | None, event: Event) -> None:
    """Call ``emit`` with ``event``, awaiting it when it is a coroutine function's result."""
    if emit is None:
        return
    result = emit(event)
    if inspect.isawaitable(result):
        await result


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild a typed event from its JSON dict (e.g. after crossing an actor boundary)."""
    return TypeAdapter(AnyEvent).validate_python(data)
