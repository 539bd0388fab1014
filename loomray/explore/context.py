"""What every round of one exploration shares: the agent, the record, the judge, the rules and the budget."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loomray.explore.judges import call_judge
from loomray.explore.record import ExplorationRecord
from loomray.explore.stopping import StopRule
from loomray.explore.types import Budget, JudgeInput, Score

if TYPE_CHECKING:  # the Agent module imports this package
    from loomray.agent import Agent

#: How often a round looks at its running branches' checkpoints (early stopping, a spend budget).
POLL_S = 0.1


@dataclass
class Context:
    """One exploration's shared state; ``docs`` mirrors the record (loaded once, then kept as written)."""

    agent: Agent
    record: ExplorationRecord
    user_id: str | None
    judge: Any
    keep: int
    score_every: int | None
    stop_rule: StopRule
    budget: Budget
    #: When the exploration started (``time.time()``, stored in its plan): the wall-clock budget counts from it.
    started_at: float
    docs: dict[str, dict[str, Any]] = field(default_factory=dict)
    poll_s: float = POLL_S

    @property
    def exploration_id(self) -> str:
        return self.record.exploration_id

    async def put(self, name: str, doc: dict[str, Any]) -> dict[str, Any]:
        """Store ``doc`` once (create-only) and return what the store holds under ``name``."""
        stored = await asyncio.to_thread(self.record.put, name, doc)
        self.docs[name] = stored
        return stored

    async def judged(self, name: str, judged: JudgeInput) -> dict[str, Any]:
        """The stored score ``name``, judging ``judged`` first when there is none yet (never twice)."""
        if name in self.docs:
            return self.docs[name]
        score, spend = await call_judge(self.judge, self.agent, judged, f"{judged.session_id}-j{name.rsplit('-', 1)[-1]}",
                                        self.user_id)
        return await self.put(name, _score_doc(score, spend, judged))

    def judge_spend(self) -> float:
        """What every stored judge call cost."""
        return sum(d.get("judge_spend", 0.0) for n, d in self.docs.items() if "-score-" in n)

    def finished_spend(self, exclude_round: int) -> float:
        """What the branches of every round but ``exclude_round`` spent (their ``done`` records)."""
        prefix = f"r{exclude_round:03d}-"
        return sum(d.get("spend_usd") or 0.0 for n, d in self.docs.items() if "-done-" in n and not n.startswith(prefix))

    def over_budget(self, spend: float) -> str | None:
        """Why the exploration must stop now (``"budget_exceeded"``, ``"wall_clock_exceeded"``), or None."""
        if self.budget.max_cost_usd is not None and spend >= self.budget.max_cost_usd:
            return "budget_exceeded"
        if self.budget.max_wall_s is not None and time.time() - self.started_at >= self.budget.max_wall_s:
            return "wall_clock_exceeded"
        return None

    @property
    def watches(self) -> bool:
        """Whether rounds must look at running branches (early stopping or a spend limit), not only wait."""
        return self.score_every is not None or self.budget != Budget()


def _score_doc(score: Score, spend: float, judged: JudgeInput) -> dict[str, Any]:
    return {"value": score.value, "reasons": score.reasons, "judge_spend": spend, "turn": judged.turn,
            "final": judged.result is not None}
