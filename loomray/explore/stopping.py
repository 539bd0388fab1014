"""Early stopping: which running branches to cancel once every branch of a round was scored at a rung.

A rung is a point every ``score_every`` passes (counted from the branch's
fork point). When each branch of the round has a score at rung ``n`` (its
score after ``n * score_every`` passes, or its final score if it finished
sooner), the stop rule sees those branches, each with ``score`` set to that
rung's score, and names the running ones to cancel. The rule is a function
``(branches: list[Branch], keep: int) -> iterable of session ids``; the
default is :func:`successive_halving`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from loomray.explore.types import Branch

StopRule = Callable[[list[Branch], int], Iterable[str]]


def successive_halving(branches: list[Branch], keep: int) -> list[str]:
    """Keep the better half (never fewer than ``keep``); the rest are dominated and stop.

    Ties keep the branch listed first (the order the round planned them).
    """
    survivors = max(keep, math.ceil(len(branches) / 2))
    ranked = rank(branches)
    return [b.session_id for b in ranked[survivors:]]


def rank(branches: list[Branch]) -> list[Branch]:
    """Best first by score (an unscored branch last); a stable order, so ties keep the planned order."""
    return sorted(branches, key=lambda b: -b.score if b.score is not None else math.inf)
