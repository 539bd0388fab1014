"""The inputs of one run of the loop: where it starts, its per-run options, and what steering found."""

from __future__ import annotations

from collections.abc import Callable
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


@dataclass
class ControlSnapshot:
    """The control requests pending for a session, as one look at them (``controls.poll()``) found them.

    Names are the requests' ids (their object names); ``signals`` are oldest first.
    """

    cancelled: bool = False
    pauses: list[str] = field(default_factory=list)
    signals: list[tuple[str, str]] = field(default_factory=list)
    #: tool call id -> (request name, approved, reason)
    decisions: dict[str, tuple[str, bool, str | None]] = field(default_factory=dict)


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
