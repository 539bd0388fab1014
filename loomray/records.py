"""The records that cross the durable boundary: pydantic v2 models, JSON only.

Persisted records are a contract. ``Checkpoint.schema_version`` names the
format; new fields default to ``None`` so older objects still load, and a
version this release cannot read raises :class:`CheckpointException`.
Nothing here is ever pickled into storage.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from loomray.errors import CheckpointException
from loomray.ids import new_id

SCHEMA_VERSION = "1.0"
#: Checkpoint schema versions this release can read: "1.0", a whole transcript per object, and "2.0",
#: incremental objects in chains (:mod:`loomray.checkpoint_format`), read back whole.
READABLE_SCHEMA_VERSIONS = frozenset({"1.0", "2.0"})

Role = Literal["system", "user", "assistant", "tool"]
Position = Literal["after_model", "after_tools"]
#: "awaiting_approval": the run stopped before tool calls that need a decision (the checkpoint holds the assistant
#: message with those calls, position "after_model"); "paused": the run stopped at a pass boundary on request.
ExecutionStatus = Literal["active", "completed", "awaiting_approval", "paused"]
#: Why a run returned. "completed": the model gave its final answer; "budget_exceeded": the next model
#: call would exceed ``Tuning.max_cost_usd``/``max_tokens`` (the run stays unfinished, ``resume`` continues
#: it); "awaiting_approval", "paused", "cancelled": the run was stopped from outside before its end.
#: Hitting ``Tuning.max_turns`` is not a stop reason: it raises :class:`~loomray.errors.MaxTurnsExceeded`.
StopReason = Literal["completed", "awaiting_approval", "paused", "cancelled", "budget_exceeded"]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


class ToolCall(BaseModel):
    """A tool invocation the model asked for."""

    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Message(BaseModel):
    """One transcript entry, provider-neutral."""

    model_config = ConfigDict(frozen=True)

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    #: For ``role == "tool"``: the id of the :class:`ToolCall` this answers.
    tool_call_id: str | None = None
    #: For ``role == "tool"``: the tool's name (providers such as OpenAI want it).
    name: str | None = None
    #: True when a tool message carries an error the tool raised.
    is_error: bool = False


class Usage(BaseModel):
    """Tokens, requests and cost. ``a + b`` adds field by field.

    ``cost_usd`` is ``None`` when any contributing call had an unknown price:
    an unknown cost is never guessed as zero. ``price_source`` names where the
    price came from (``"genai-prices 0.2.3"``, ``"override: prices.json"``);
    a sum of calls priced from different sources says ``"mixed"``.
    """

    model_config = ConfigDict(frozen=True)

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0
    #: The part of ``output_tokens`` the model spent reasoning (where the provider reports it).
    reasoning_tokens: int = 0
    requests: int = 0
    cost_usd: float | None = 0.0
    price_source: str | None = None

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        cost = None if self.cost_usd is None or other.cost_usd is None else self.cost_usd + other.cost_usd
        sources = {s for s in (self.price_source, other.price_source) if s}
        counts = {k: getattr(self, k) + getattr(other, k) for k, f in Usage.model_fields.items() if f.annotation is int}
        return Usage(**counts, cost_usd=cost,
                     price_source=sources.pop() if len(sources) == 1 else ("mixed" if sources else None))

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


class CheckpointMeta(BaseModel):
    """A checkpoint without its transcript: cheap to list."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    checkpoint_id: str
    turn: int
    created_at: datetime
    user_id: str | None = None
    execution_status: ExecutionStatus = "active"
    position: Position | None = None
    message_count: int | None = None
    epoch: int | None = None


class Checkpoint(BaseModel):
    """A frozen snapshot of a session after a loop boundary.

    Field order is the serialization order: the small identifying fields come
    first and ``messages`` last, so the head of the JSON object is readable on
    its own.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    schema_version: str = SCHEMA_VERSION
    session_id: str
    checkpoint_id: str = Field(default_factory=lambda: new_id("ckpt"))
    user_id: str | None = None
    agent_id: str | None = None
    turn: int = Field(ge=0)
    position: Position = "after_tools"
    execution_status: ExecutionStatus = "active"
    created_at: datetime = Field(default_factory=utcnow)
    cursor: str | None = None
    parent_checkpoint_id: str | None = None
    forked_from: str | None = None
    epoch: int | None = None
    message_count: int | None = None
    cumulative_usage: Usage = Field(default_factory=Usage)
    #: With ``execution_status == "awaiting_approval"``: the ids of the tool calls that wait for a decision.
    pending_approvals: list[str] | None = None
    messages: list[Message] = Field(default_factory=list)
    #: How the store holds it (a ``loomray.checkpoint_format.ChainState``, set when it was read from a store):
    #: a run that restores it builds its next checkpoint on that chain. Not part of the record.
    _chain: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        """Equal when every field is: ``_chain`` (how a store holds it) is not part of the record, so a
        checkpoint read from a store equals its own JSON round trip."""
        if not isinstance(other, Checkpoint):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def checked(self) -> Checkpoint:
        """This checkpoint, once it is known usable; :class:`CheckpointException` if it is not.

        Named apart from pydantic's ``validate``: this checks what field validation cannot
        (a readable schema version, a transcript as long as ``message_count`` says, an aware timestamp).
        """
        if self.schema_version not in READABLE_SCHEMA_VERSIONS:
            raise CheckpointException(
                f"checkpoint {self.checkpoint_id!r} of session {self.session_id!r} has schema_version "
                f"{self.schema_version!r}; this release reads {sorted(READABLE_SCHEMA_VERSIONS)}"
            )
        if self.message_count is not None and self.message_count != len(self.messages):
            raise CheckpointException(
                f"checkpoint {self.checkpoint_id!r} of session {self.session_id!r} says message_count="
                f"{self.message_count} but holds {len(self.messages)} messages"
            )
        if self.created_at.tzinfo is None:
            raise CheckpointException(f"checkpoint {self.checkpoint_id!r}: created_at must be timezone-aware UTC")
        return self

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict."""
        return self.model_dump(mode="json")

    def to_json_bytes(self) -> bytes:
        """Serialize once, straight to bytes (no intermediate str or dict)."""
        return self.__pydantic_serializer__.to_json(self)

    @classmethod
    def from_dict(cls, data: object) -> Checkpoint:
        """Reconstruct and validate; raise :class:`CheckpointException` on bad data."""
        if not isinstance(data, dict):
            raise CheckpointException(f"checkpoint data must be a JSON object, got {type(data).__name__}")
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise CheckpointException(
                f"unknown checkpoint schema_version {version!r}; this release reads {sorted(READABLE_SCHEMA_VERSIONS)}"
            )
        try:
            ckpt = cls.model_validate(data)
        except ValidationError as e:
            raise CheckpointException(f"invalid checkpoint data: {e}") from e
        return ckpt.checked()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Checkpoint:
        """Parse JSON bytes; raise :class:`CheckpointException` on corrupt or invalid data."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointException(f"checkpoint is not valid JSON (corrupt or truncated): {e}") from e
        return cls.from_dict(data)


class RunResult(BaseModel):
    """What ``Agent.run`` / ``resume`` / ``fork`` return."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    output: str
    structured: Any = None
    messages: list[Message] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    session_id: str
    user_id: str | None = None
    run_id: str | None = None
    turns: int = 0
    checkpoint_id: str | None = None
    resumed_from_checkpoint: bool = False
    resume_position: Position | None = None
    forked_from: str | None = None
    #: Model invocations made by this call; replayed and restored turns are not counted.
    model_calls: int = 0
    #: Steps answered from the journal instead of being executed again.
    replayed_steps: int = 0
    #: See :data:`StopReason`. Anything but "completed" leaves the run unfinished (no final answer in ``output``).
    stop_reason: StopReason = "completed"
    #: With ``stop_reason == "awaiting_approval"``: the tool calls that wait for a decision
    #: (``resume(None, session_id=..., approvals={call.id: True | False | "reason"})``).
    pending_approvals: list[ToolCall] = Field(default_factory=list)
