"""Run configuration: :class:`Tuning` and :class:`CheckpointConfig`, plain frozen dataclasses.

``Tuning`` accepts anything for ``checkpoint`` so the :class:`~loomray.Agent` constructor reports a wrong
type as a ``TypeError`` naming the field, not a validation error from deep inside a run.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: the records need the storage package; configuration does not
    from loomray.records import Usage

_POSITIONS = ("after_tools", "after_model", "both")
#: The longest chain a reader accepts: the same number as ``storage.chains.MAX_LINKS`` (a test holds them equal).
MAX_LINKS = 4096
_DURABILITY = ("sync", "async")


@dataclass(frozen=True)
class CheckpointConfig:
    """Which loop boundaries write a checkpoint (``position``) and how many links a chain reaches before a full
    snapshot (``full_every``, at most ``MAX_LINKS``: a reader refuses a longer chain); docs/api.md."""

    position: Literal["after_tools", "after_model", "both"] = "after_tools"
    full_every: int = 500

    def __post_init__(self) -> None:
        if self.position not in _POSITIONS:
            raise ValueError(f"CheckpointConfig.position must be one of {_POSITIONS}, got {self.position!r}")
        if type(self.full_every) is not int or not 1 <= self.full_every <= MAX_LINKS:
            raise ValueError(f"CheckpointConfig.full_every must be an int in [1, {MAX_LINKS}], got {self.full_every!r}")

    def saves_after_tools(self) -> bool:
        """True when position is "after_tools" or "both"."""
        return self.position in ("after_tools", "both")

    def saves_after_model(self) -> bool:
        """True when position is "after_model" or "both"."""
        return self.position in ("after_model", "both")


@dataclass(frozen=True)
class Tuning:
    """Knobs of the agent loop; each field in full: docs/api.md, "``Tuning`` and ``CheckpointConfig``".

    A bad value raises ``ValueError`` when built; a wrong ``checkpoint`` type is a ``TypeError`` when the
    Agent is built. The old ``compact_*`` keywords work for one release, with a ``DeprecationWarning``.
    """

    #: Any value is kept: a wrong type is the Agent constructor's ``TypeError`` (see above), not a dataclass's.
    checkpoint: bool | CheckpointConfig | None = False
    max_turns: int = 50
    durability: Literal["sync", "async"] = "sync"
    journal: bool = True
    condense_after_tokens: int | None = None
    condense_keep_last: int = 8
    output_retries: int = 1
    max_cost_usd: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        cost = self.max_cost_usd
        if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float))
                                 or math.isnan(cost) or cost < 0):
            raise ValueError(f"Tuning.max_cost_usd must be a non-negative number or None, got {cost!r}")
        tokens = self.max_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise ValueError(f"Tuning.max_tokens must be a non-negative int or None, got {tokens!r}")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"Tuning.max_turns must be a positive int, got {self.max_turns!r}")
        if self.durability not in _DURABILITY:
            raise ValueError(f"Tuning.durability must be one of {_DURABILITY}, got {self.durability!r}")
        if self.condense_after_tokens is not None and self.condense_after_tokens < 1:
            raise ValueError("Tuning.condense_after_tokens must be positive or None")
        if self.condense_keep_last < 2:
            raise ValueError("Tuning.condense_keep_last must be at least 2")

    @property
    def compact_after_tokens(self) -> int | None:
        """Deprecated: :attr:`condense_after_tokens` (removed in the next release)."""
        _renamed("compact_after_tokens", 3)
        return self.condense_after_tokens

    @property
    def compact_keep_last(self) -> int:
        """Deprecated: :attr:`condense_keep_last` (removed in the next release)."""
        _renamed("compact_keep_last", 3)
        return self.condense_keep_last

    def over_budget(self, usage: Usage) -> str | None:
        """Why the next model call would exceed a limit given ``usage`` (the spend so far, at or above it), or None."""
        if self.max_cost_usd is not None:
            if usage.cost_usd is None:
                return f"max_cost_usd={self.max_cost_usd} is set but the cost so far is unknown (unpriced model calls)"
            if usage.cost_usd >= self.max_cost_usd:
                return f"cost so far ${usage.cost_usd:.6f} reached max_cost_usd={self.max_cost_usd}"
        if self.max_tokens is not None and usage.total_tokens >= self.max_tokens:
            return f"tokens so far {usage.total_tokens} reached max_tokens={self.max_tokens}"
        return None

    def checkpoint_config(self) -> CheckpointConfig | None:
        """The effective checkpoint config, or None when off; ``TypeError`` for anything but a bool or config."""
        value = self.checkpoint
        if value is False or value is None:
            return None
        if value is True:
            return CheckpointConfig()
        if isinstance(value, CheckpointConfig):
            return value
        raise TypeError(f"Tuning.checkpoint takes True, False or CheckpointConfig(position=...), got {type(value).__name__}")


#: Tuning fields renamed in this release: old keyword -> new field. The old keywords work for one more release
#: (stored forms of a Tuning, e.g. a stored Variant, are read with the new names, without a warning).
RENAMED_FIELDS = {"compact_after_tokens": "condense_after_tokens", "compact_keep_last": "condense_keep_last"}


def _renamed(old: str, stacklevel: int) -> None:
    warnings.warn(f"Tuning.{old} is deprecated and will be removed in the next release; use Tuning.{RENAMED_FIELDS[old]} "
                  "(transcript condensing, not the index's compaction)", DeprecationWarning, stacklevel=stacklevel)


def _accepting_old_names(init: Callable[..., None]) -> Callable[..., None]:
    """``Tuning.__init__`` that also takes the renamed keywords (with a warning); both spellings at once is a
    ``TypeError``. A wrong value fails as it would under the new name, when the Tuning is built."""
    @functools.wraps(init)
    def __init__(self: Tuning, *args: Any, **kwargs: Any) -> None:
        for old, new in RENAMED_FIELDS.items():
            if old in kwargs:
                _renamed(old, 3)
                if new in kwargs:
                    raise TypeError(f"Tuning got both {old} (deprecated) and {new}; pass {new} only")
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)
    return __init__


Tuning.__init__ = _accepting_old_names(Tuning.__init__)  # type: ignore[method-assign]
