"""The agent loop: model call, tool calls, repeat. No Ray, no storage.

A *pass* is one model call plus the tool calls it asked for; ``turn`` counts
completed passes. Persistence is injected: the loop hands finished
:class:`~loomray.records.Checkpoint` records to a :class:`CheckpointWriter`
(serialized once, as bytes) and asks a :class:`~loomray.journal.StepRunner`
for model answers and tool results, which may be replayed from the journal.

Invariants the loop keeps:

- a transcript with dangling tool calls (an assistant message whose calls
  have no results yet, e.g. restored from an "after_model" checkpoint) is
  never sent to a model: the missing tool calls run (or replay) first;
- condensing happens at pass boundaries, before the checkpoint of that
  boundary, so a snapshot holds the condensed transcript;
- a failed checkpoint write logs a warning and the run goes on; an error
  the writer's ``is_fatal`` accepts (fencing, lost ownership, a non-transient
  error) stops the run before its next model or tool call once the write has
  reported it (with ``durability="async"`` an upload still in flight reports
  later: at the latest at the next checkpoint). ``LoopOptions.check_writes``
  covers writes the loop does not see, such as journal appends;
- repairing a transcript puts the results of dangling tool calls right after
  the assistant message that made the calls, before any later message;
- a spend limit (``Tuning.max_cost_usd``/``max_tokens``) is checked before
  every model call, after condensing: once the spend so far reached a limit
  the run checkpoints (unless nothing changed since the checkpoint it wrote or
  restored last) and returns ``stop_reason="budget_exceeded"`` without
  calling the model.

Control (``LoopOptions.controls``, see :mod:`loomray.control`). A *pass
boundary* is the top of a pass, right before its model call. At a boundary
the loop, in this order: stops for a cancel (nothing more is written);
stops for a pause (journals its consumption, then writes a checkpoint with
``execution_status="paused"``); stops over budget; then appends pending
signals as user messages, journaling each consumption. So no checkpoint is
ever written at a boundary after its signals: a restored boundary checkpoint
never holds them, and replay re-applies the journaled ones at the same
boundary, in journal order, before the (replayed) model call. A boundary
whose model step is journaled (replay) asks no new control request: adding
one would change the model input. Before tool calls that need approval
(``Tool.needs_approval``) the loop looks for a journaled decision, else asks
``controls`` for one; if any is missing, nothing of the pass runs and the
run returns ``stop_reason="awaiting_approval"`` after a checkpoint
(``position="after_model"``, ``execution_status="awaiting_approval"``). A
decision is journaled before the call runs (approved) or is answered with
the denial (denied). A cancel the caller requested while a step was in
flight (``controls.cancel_requested`` and the run's task cancelled) returns
``stop_reason="cancelled"``: queued checkpoint uploads are dropped, nothing
is flushed.
"""

from loomray.errors import OutputValidationError  # raised by the loop; importable from here as before
from loomray.loop.run import run_loop
from loomray.loop.state import Controls, ControlSnapshot, LoopOptions, LoopState, ToolDecision
from loomray.loop.transcript import CONTINUE_NUDGE, dangling_tool_calls
from loomray.loop.writer import CheckpointWriter, make_cursor, run_of_cursor

__all__ = [
    "CONTINUE_NUDGE", "CheckpointWriter", "ControlSnapshot", "Controls", "LoopOptions", "LoopState", "ToolDecision",
    "OutputValidationError", "dangling_tool_calls", "make_cursor", "run_loop", "run_of_cursor",
]
