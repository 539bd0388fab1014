"""Starting an exploration's branches: forks whose session ids the exploration chose and stored first.

A driver that dies mid-round finds its branches again by those ids: re-issuing the same fork request
continues an unfinished run (journaled steps replay) and a finished branch is read from its final
checkpoint. ``Agent.fork`` picks ids itself, so the requests are built here as ``Agent.fork`` builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loomray.records import RunResult
from loomray.run_request import RunRequest
from loomray.variants import Variant

if TYPE_CHECKING:  # the Agent module imports this package
    from loomray.agent import Agent


@dataclass(frozen=True)
class BranchPlan:
    """One branch as its round's plan stores it: where it forks from and how it differs."""

    session_id: str
    parent: str
    from_checkpoint: str
    variant: Variant
    #: The parent's spend (``cumulative_usage.cost_usd``) at the fork point: the branch's own spend is above it.
    base_cost: float
    #: The fork point's turn: the branch's own passes are counted above it.
    base_turn: int = 0


def prompt_only(variant: Variant) -> bool:
    """Whether ``variant`` changes nothing but the prompt (all a prompt fork can do)."""
    return (variant.model is None and variant.instructions is None and variant.tools is None
            and variant.tuning is None and not variant.edits)


def fork_request(plan: BranchPlan, *, user_id: str | None, exploration_id: str, round_: int) -> RunRequest:
    """The fork request of one branch; the same plan always makes the same request (what a resume relies on).

    Its run id and hand-off id derive from the branch: a new driver's request names the very run the dead
    driver started, so it continues that run (or, finished, returns its result), and on Ray a supervisor
    still running it joins it instead of starting it over (:mod:`loomray.runtime.handoffs`).
    """
    variant = None if prompt_only(plan.variant) else plan.variant.to_json()  # a prompt fork's request, as before
    return RunRequest(kind="resume", prompt=plan.variant.prompt, session_id=plan.session_id, user_id=user_id,
                      from_checkpoint=plan.from_checkpoint, fork_of=plan.parent, run_id=f"run-{plan.session_id}",
                      request_id=f"req-{plan.session_id}", variant=variant,
                      metadata={"exploration_id": exploration_id, "round": round_})


async def start_branches(agent: Agent, plans: Sequence[BranchPlan], *, user_id: str | None, exploration_id: str,
                         round_: int) -> list[RunResult]:
    """Run the branches of ``plans`` at once (one fan-out on the agent's runtime); results in plan order."""
    requests = [fork_request(p, user_id=user_id, exploration_id=exploration_id, round_=round_) for p in plans]
    agents = [agent if prompt_only(p.variant) else agent.with_variant(p.variant) for p in plans]
    return list(await agent.runtime.execute_many(agents, requests))
