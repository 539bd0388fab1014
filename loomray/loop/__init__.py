"""The agent loop: model call, tool calls, repeat. No Ray, no storage.

Persistence is injected: the loop hands finished checkpoints to a :class:`CheckpointWriter` and asks a
:class:`~loomray.journal.StepRunner` for model answers and tool results, which may be replayed. The
invariants it keeps and the order of a pass boundary: docs/design.md, "The loop's invariants".
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
