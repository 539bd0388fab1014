"""Exploration: run variants of a session from one checkpoint, judge them, keep the best, adopt the winner.

:func:`explore` is what :meth:`loomray.Agent.explore` runs (see docs/exploration.md).
The parts: :mod:`~loomray.explore.types` (what callers pass and get),
:mod:`~loomray.explore.record` (the stored record), :mod:`~loomray.explore.judges`,
:mod:`~loomray.explore.stopping` (early-stopping rules), :mod:`~loomray.explore.rounds`
(one round), :mod:`~loomray.explore.adopt` and :mod:`~loomray.explore.engine`.
"""

from loomray.explore.engine import explore
from loomray.explore.judges import ModelJudge
from loomray.explore.record import find_exploration
from loomray.explore.stopping import StopRule, successive_halving
from loomray.explore.types import Branch, Budget, Exploration, JudgeInput, Score

__all__ = ["explore", "ModelJudge", "Budget", "Branch", "Exploration", "JudgeInput", "Score", "StopRule",
           "successive_halving", "find_exploration"]
