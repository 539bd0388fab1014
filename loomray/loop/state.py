"""The inputs of one run of the loop: where it starts, its per-run options, and what steering found."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loomray.config import CheckpointConfig, Tuning
from loomray.records import Message, Usage


@dataclass
class LoopState:
    """Where a run starts: a fresh transcript or a restored checkpoint."""

    session_id: str
    messages: list[Message]
    turn: int = 0
    usage: Usage = field(default_factory=Usage)
    user_id: str | None = None
    run_id: str | None = None
    agent_id: str | None = None
    parent_checkpoint_id: str | None = None
    forked_from: str | None = None
    epoch: int | None = None
    #: How the store holds the restored checkpoint (its chain, in this session's view), for the next
    #: checkpoint to build on; None: the next checkpoint is written whole. Opaque to the loop.
    chain: Any = None


@dataclass(frozen=True)
class ToolDecision:
    """A person's decision on one tool call that asked for one.

    ``approved``: run it, with ``arguments`` in place of the model's when
    given (an edit). Not approved: with ``response``, the tool does not run
    and the model gets ``response`` as its result (an answer in its place);
    else it is denied, and the model gets the denial with ``reason``.
    """

    approved: bool
    reason: str | None = None
    arguments: dict[str, Any] | None = None
    response: str | None = None

    @classmethod
    def from_fields(cls, body: Mapping[str, Any]) -> ToolDecision:
        """The decision a stored request or a journaled approval holds (fields of the wrong type are ignored)."""
        reason, arguments, response = body.get("reason"), body.get("arguments"), body.get("response")
        return cls(approved=bool(body.get("approved")), reason=reason if isinstance(reason, str) else None,
                   arguments=arguments if isinstance(arguments, dict) else None,
                   response=response if isinstance(response, str) else None)

    def fields(self) -> dict[str, Any]:
        """What a request and the journal store of it."""
        return {"approved": self.approved, "reason": self.reason, "arguments": self.arguments,
                "response": self.response}


@dataclass
class ControlSnapshot:
    """The control requests pending for a session, as one look at them (``controls.poll()``) found them.

    Names are the requests' ids (their object names); ``signals`` are oldest first.
    """

    cancelled: bool = False
    pauses: list[str] = field(default_factory=list)
    signals: list[tuple[str, str]] = field(default_factory=list)
    #: tool call id -> (request name, the decision)
    decisions: dict[str, tuple[str, ToolDecision]] = field(default_factory=dict)


class Controls(Protocol):
    """Where a run's control requests come from (:class:`loomray.control.SessionControls`)."""

    @property
    def cancel_requested(self) -> bool:
        """True once a cancel of this run was requested while it runs."""
        ...

    async def poll(self) -> ControlSnapshot:
        """One look at the pending requests (e.g. one LIST)."""
        ...

    def consume(self, name: str) -> None:
        """The request ``name`` was journaled as consumed: never hand it out again."""
        ...


@dataclass
class LoopOptions:
    """Per-run inputs that are not state."""

    tuning: Tuning
    checkpoint: CheckpointConfig | None
    prompt: str | None = None
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)
    output_schema: dict[str, Any] | None = None
    #: Turns the final answer into the structured value, raising on invalid output.
    output_validator: Callable[[str], Any] | None = None
    effort: str | None = None
    context: Any = None
    resumed_from_checkpoint: bool = False
    resume_position: str | None = None
    #: Raises when a write outside the loop (the journal) failed in a way that must stop the run.
    check_writes: Callable[[], None] | None = None
    #: Where control requests come from (None: none). See :mod:`loomray.control`.
    controls: Controls | None = None
    #: ``execution_status`` of the restored checkpoint (with ``resumed_from_checkpoint``).
    resume_status: str | None = None
    #: Makes the id of each checkpoint the run writes (None: ``new_id("ckpt")``).
    new_checkpoint_id: Callable[[], str] | None = None
    #: The W3C ``traceparent`` the run was requested under (telemetry only).
    trace_parent: str | None = None
