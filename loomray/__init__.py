"""loomray: durable long-running LLM agent sessions, checkpointed to S3-compatible storage.

Importing ``loomray`` never imports Ray; ``loomray.runtime.RayRuntime`` does,
when first used.
"""

from loomray.agent import Agent
from loomray.config import CheckpointConfig, Tuning
from loomray.decisions import Approve, Respond
from loomray.errors import CheckpointException
from loomray.explore import Branch, Budget, Exploration, JudgeInput, ModelJudge, Score
from loomray.ids import new_id
from loomray.records import Checkpoint, CheckpointMeta, Message, RunResult, ToolCall, Usage
from loomray.tools import Tool, ToolContext, tool
from loomray.variants import Edit, Variant, VariantError

__all__ = [
    "Agent", "Tuning", "CheckpointConfig", "tool", "Tool", "ToolContext", "Message", "ToolCall", "Usage",
    "Checkpoint", "CheckpointMeta", "RunResult", "new_id", "CheckpointException",
    "Variant", "Edit", "VariantError", "Approve", "Respond",
    "Exploration", "Branch", "JudgeInput", "Score", "ModelJudge", "Budget",
]
