"""Run configuration: :class:`Tuning` and :class:`CheckpointConfig`.

Both are plain frozen dataclasses. ``Tuning`` accepts anything for
``checkpoint`` so that a wrong type is reported by the :class:`~loomray.Agent`
constructor as a ``TypeError`` naming the field (our configuration contract), not as a
pydantic validation error from deep inside a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

_POSITIONS = ("after_tools", "after_model", "both")
_DURABILITY = ("sync", "async")


@dataclass(frozen=True)
class CheckpointConfig:
    """Which loop boundaries write a checkpoint.

    ``position`` is ``"after_tools"`` (default: after the tool calls of a pass),
    ``"after_model"`` (right after the model answered, before its tools run) or
    ``"both"``.
    """

    position: Literal["after_tools", "after_model", "both"] = "after_tools"

    def __post_init__(self) -> None:
        if self.position not in _POSITIONS:
            raise ValueError(f"CheckpointConfig.position must be one of {_POSITIONS}, got {self.position!r}")

    def saves_after_tools(self) -> bool:
        """True when position is "after_tools" or "both"."""
        return self.position in ("after_tools", "both")

    def saves_after_model(self) -> bool:
        """True when position is "after_model" or "both"."""
        return self.position in ("after_model", "both")


@dataclass(frozen=True)
class Tuning:
    """Knobs of the agent loop.

    - ``checkpoint``: ``False`` (default), ``True`` (= ``CheckpointConfig()``) or a
      :class:`CheckpointConfig`. Anything else raises ``TypeError`` when the
      Agent is built.
    - ``max_turns``: passes (model call + its tools) one run may take before
      :class:`~loomray.errors.MaxTurnsExceeded`.
    - ``durability``: ``"sync"`` awaits each checkpoint upload before the loop
      goes on; ``"async"`` overlaps the upload with the next model call (uploads
      stay ordered and are all awaited before the run returns).
    - ``journal``: record every model and tool step (needed for replay and
      crash recovery without checkpoints). On by default.
    - ``compact_after_tokens``: when the estimated transcript size passes this
      many tokens, older messages are compacted before the next checkpoint.
      ``None`` disables auto-compaction.
    - ``compact_keep_last``: how many recent messages compaction keeps verbatim.
    - ``output_retries``: how often the model is asked again when its final
      answer does not validate against ``output_schema``.
    """

    checkpoint: Any = False
    max_turns: int = 50
    durability: Literal["sync", "async"] = "sync"
    journal: bool = True
    compact_after_tokens: int | None = None
    compact_keep_last: int = 8
    output_retries: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"Tuning.max_turns must be a positive int, got {self.max_turns!r}")
        if self.durability not in _DURABILITY:
            raise ValueError(f"Tuning.durability must be one of {_DURABILITY}, got {self.durability!r}")
        if self.compact_after_tokens is not None and self.compact_after_tokens < 1:
            raise ValueError("Tuning.compact_after_tokens must be positive or None")
        if self.compact_keep_last < 2:
            raise ValueError("Tuning.compact_keep_last must be at least 2")

    def checkpoint_config(self) -> CheckpointConfig | None:
        """The effective checkpoint config, or None when checkpointing is off.

        Raises ``TypeError`` for anything but ``bool`` or :class:`CheckpointConfig`.
        """
        value = self.checkpoint
        if value is False or value is None:
            return None
        if value is True:
            return CheckpointConfig()
        if isinstance(value, CheckpointConfig):
            return value
        raise TypeError(
            "Tuning.checkpoint takes True, False or CheckpointConfig(position=...), "
            f"got {type(value).__name__}"
        )
