"""The values an exploration is described and answered with: budgets, judge inputs, scores, branches, results.

They are plain data. What must survive the driver (variants, scores,
decisions) is stored as JSON by :mod:`loomray.explore.record`; these classes
are what a caller passes and gets back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loomray.records import Message, RunResult
from loomray.variants import Variant


@dataclass(frozen=True)
class Budget:
    """A limit for a whole exploration, shared by its branches and judge calls; ``None``: no limit.

    ``max_cost_usd`` counts what every branch's model calls cost since its
    fork point plus every model judge's calls; ``max_wall_s`` counts the
    seconds the exploration has been running, across resumes.
    """

    max_cost_usd: float | None = None
    max_wall_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_cost_usd", "max_wall_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Budget.{name} must be a number or None, got {type(value).__name__}")
            if math.isnan(value) or value < 0:
                raise ValueError(f"Budget.{name} must be >= 0, got {value!r}")

    @classmethod
    def of(cls, budget: Budget | float | int | None) -> Budget:
        """``budget`` as a :class:`Budget` (a number is a USD limit)."""
        if budget is None:
            return cls()
        if isinstance(budget, Budget):
            return budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"budget must be a float (USD), a loomray.Budget or None, got {type(budget).__name__}")
        return cls(max_cost_usd=float(budget))


@dataclass(frozen=True)
class Score:
    """A judge's verdict on a branch: ``value`` (higher is better) and why."""

    value: float
    reasons: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or math.isnan(self.value):
            raise TypeError(f"Score.value must be a number, got {self.value!r}")
        if not isinstance(self.reasons, str):
            raise TypeError(f"Score.reasons must be a str, got {type(self.reasons).__name__}")
        object.__setattr__(self, "value", float(self.value))

    @classmethod
    def of(cls, verdict: object) -> Score:
        """What a judge returned (a number or a :class:`Score`) as a Score; anything else is a ``TypeError``."""
        if isinstance(verdict, Score):
            return verdict
        if isinstance(verdict, (int, float)) and not isinstance(verdict, bool):
            return cls(float(verdict))
        raise TypeError(f"a judge must return a float or a loomray.Score, got {type(verdict).__name__}")


@dataclass(frozen=True)
class JudgeInput:
    """What a judge sees of one branch: its variant, round, transcript so far, and its result once finished."""

    session_id: str
    variant: Variant
    round: int
    messages: list[Message]
    result: RunResult | None = None
    #: The loop passes the branch had completed when this transcript was taken.
    turn: int = 0


@dataclass
class Branch:
    """One fork of an exploration, as the result reports it.

    ``stop_reason`` is the branch run's (``"completed"``, ``"budget_exceeded"``, ...),
    or ``"early_stopped"`` (cancelled as dominated), ``"exploration_budget"``
    (cancelled when the exploration's budget ran out) or ``"failed"``; None while it runs.
    ``spend_usd`` is what its model calls cost since its fork point (None: an unpriced call).
    """

    session_id: str
    variant: Variant
    round: int
    parent: str | None = None
    score: float | None = None
    reasons: str = ""
    stop_reason: str | None = None
    spend_usd: float | None = 0.0
    judge_spend_usd: float = 0.0
    turns: int = 0
    output: str = ""
    #: Scores taken along the way (early stopping): ``[turn, score]`` pairs, oldest first.
    interim: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Exploration:
    """What :meth:`loomray.Agent.explore` returns.

    ``winner`` is the session id of the best branch of the last round that
    ran (None when no branch was scored). ``spend_usd`` sums every branch's
    spend and every judge call's; ``saved_usd`` estimates what early-stopped
    branches did not spend (see docs/exploration.md). ``stop_reason`` is
    ``"completed"``, ``"budget_exceeded"`` or ``"wall_clock_exceeded"``.
    ``adopted_checkpoint_id`` is the base session's new checkpoint when the
    winner was adopted.
    """

    exploration_id: str
    session_id: str
    winner: str | None
    branches: list[Branch]
    spend_usd: float
    saved_usd: float
    stop_reason: str
    rounds_run: int = 0
    adopted_checkpoint_id: str | None = None

    def branch(self, session_id: str) -> Branch:
        """The branch of ``session_id`` (``KeyError`` when it is not one of this exploration's)."""
        for b in self.branches:
            if b.session_id == session_id:
                return b
        raise KeyError(session_id)
