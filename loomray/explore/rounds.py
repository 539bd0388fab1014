"""One round of an exploration: run its branches, score them, stop the dominated ones, record how each ended.

The round works from what the store says, not from what this process
remembers: each branch's progress is its latest checkpoint, each score and
decision a record object. So the same code continues a round another driver
started: finished branches are read back (never run again), unfinished ones
are re-issued (their runs continue, replaying journaled steps), stored
scores and decisions are reused.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from loomray.explore.context import Context
from loomray.explore.forking import BranchPlan, start_branches
from loomray.explore.judges import transcript
from loomray.explore.types import Branch, JudgeInput
from loomray.records import Checkpoint, RunResult
from loomray.storage.errors import TransientStorageError


@dataclass
class _Live:
    """A branch while its round runs."""

    plan: BranchPlan
    branch: Branch
    seen: str | None = None  # the last checkpoint looked at
    done: bool = False
    rung_scores: dict[int, float] = field(default_factory=dict)


class RoundRun:
    """Runs round ``number`` of the exploration in ``ctx`` over the branches ``plans``."""

    def __init__(self, ctx: Context, number: int, plans: list[BranchPlan], *, fresh: bool = False) -> None:
        self.ctx, self.number = ctx, number
        #: This process stored the round's plan just now: none of its branches has started yet.
        self.fresh = fresh
        self.live = [_Live(p, Branch(session_id=p.session_id, variant=p.variant, round=number, parent=p.parent))
                     for p in plans]
        self.stop_reason: str | None = None

    def name(self, kind: str, live: _Live | None = None, suffix: str = "") -> str:
        """A record name of this round: ``r001-{kind}[-{branch}][-{suffix}]``."""
        parts = [f"r{self.number:03d}", kind, *([live.plan.session_id] if live else []), *([suffix] if suffix else [])]
        return "-".join(parts)

    async def run(self) -> list[Branch]:
        """Run the round to its end (or the budget's) and return its branches as they ended."""
        self._restore()
        if not self.fresh:  # a round planned before (a dead driver's): its branches may have run, even finished
            await asyncio.gather(*(self._look(lv) for lv in self.live if not lv.done))
        await self._check_budget()
        pending = [lv for lv in self.live if not lv.done and self.name("stop", lv) not in self.ctx.docs]
        if pending:
            task = asyncio.ensure_future(start_branches(self.ctx.agent, [lv.plan for lv in pending],
                                                        user_id=self.ctx.user_id,
                                                        exploration_id=self.ctx.exploration_id, round_=self.number))
            await self._watch(task)
            await self._settle(pending, task)
        for live in self.live:  # stopped before they were (re)started
            if not live.done:
                await self._end(live, None)
        return [lv.branch for lv in self.live]

    def _restore(self) -> None:
        """What the record already says about each branch: its rung scores, and how it ended (one pass over the
        record: a third round's record holds hundreds of documents)."""
        by_id = {live.plan.session_id: live for live in self.live}
        rung_score = re.compile(rf"r{self.number:03d}-score-(.+)-k(\d+)")
        for name, doc in self.ctx.docs.items():
            match = rung_score.fullmatch(name)
            live = by_id.get(match.group(1)) if match is not None else None
            if match is not None and live is not None:
                live.rung_scores[int(match.group(2))] = doc["value"]
                live.branch.interim.append((doc["turn"], doc["value"]))
        for live in self.live:
            _fill_rungs(live)
            done = self.ctx.docs.get(self.name("done", live))
            if done is not None:
                _apply_done(live.branch, done, self.ctx.docs.get(self.name("score", live, "final")))
                live.done = True

    async def _watch(self, task: asyncio.Future[Any]) -> None:
        """Until ``task`` ends: look at each running branch, decide rungs, keep to the budget."""
        while not task.done():
            await asyncio.wait({task}, timeout=self.ctx.poll_s)
            if not self.ctx.watches or task.done():
                continue
            await asyncio.gather(*(self._look(lv) for lv in self.live if not lv.done))
            await self._decide_rungs()
            await self._check_budget()

    async def _look(self, live: _Live) -> None:
        """Read ``live``'s latest checkpoint: its spend, a rung score when it passed one, its end when it finished."""
        agent, sid = self.ctx.agent, live.plan.session_id
        metas = await agent.runtime.list_checkpoints(sid, limit=1, user_id=self.ctx.user_id)
        if not metas or metas[0].checkpoint_id == live.seen:
            return
        ckpt = await agent.runtime.get_checkpoint(sid, metas[0].checkpoint_id, user_id=self.ctx.user_id)
        if ckpt is None:
            return
        live.seen = ckpt.checkpoint_id
        self._progress(live, ckpt)
        if ckpt.execution_status == "completed":
            await self._finish(live, ckpt.messages, _result_of(ckpt))
            return
        every, passes = self.ctx.score_every, live.branch.turns
        rung = passes // every if every else 0
        if rung >= 1 and rung not in live.rung_scores and self.name("stop", live) not in self.ctx.docs:
            judged = JudgeInput(sid, live.plan.variant, self.number, transcript(ckpt.messages), None, passes)
            doc = await self.ctx.judged(self.name("score", live, f"k{rung:03d}"), judged)
            live.rung_scores[rung] = doc["value"]
            _fill_rungs(live)
            live.branch.interim.append((doc["turn"], doc["value"]))
            live.branch.score, live.branch.reasons = doc["value"], doc["reasons"]

    def _progress(self, live: _Live, ckpt: Checkpoint) -> None:
        _spent(live, ckpt.cumulative_usage.cost_usd)
        live.branch.turns = max(0, ckpt.turn - live.plan.base_turn)

    async def _finish(self, live: _Live, messages: list[Any], result: RunResult) -> None:
        """A branch that completed: its final score (judged once), then its ``done`` record."""
        judged = JudgeInput(live.plan.session_id, live.plan.variant, self.number, transcript(messages), result,
                            live.branch.turns)
        score = await self.ctx.judged(self.name("score", live, "final"), judged)
        doc = {"stop_reason": "completed", "spend_usd": live.branch.spend_usd, "turns": live.branch.turns,
               "output": result.output[:4000], "score": score["value"], "reasons": score["reasons"]}
        _apply_done(live.branch, await self.ctx.put(self.name("done", live), doc), score)
        live.done = True

    async def _end(self, live: _Live, result: RunResult | None, error: str | None = None) -> None:
        """A branch that stopped without completing: stopped by the exploration, by its own run, or failed."""
        stop = self.ctx.docs.get(self.name("stop", live))
        reason = stop["reason"] if stop else ("failed" if result is None else result.stop_reason)
        if result is not None:
            _spent(live, result.usage.cost_usd)
        doc = {"stop_reason": reason, "spend_usd": live.branch.spend_usd, "turns": live.branch.turns,
               "output": "", "score": live.branch.score, "reasons": live.branch.reasons, "error": error}
        _apply_done(live.branch, await self.ctx.put(self.name("done", live), doc), None)
        live.done = True

    async def _settle(self, pending: list[_Live], task: asyncio.Future[Any]) -> None:
        """The fan-out ended: every branch it ran that is not done yet ends by its result (or its checkpoint)."""
        try:
            results: list[RunResult | None] = list(task.result())
            error = None
        except Exception as e:  # one branch's failure fails the fan-out: each branch ends by what it stored
            if _transient(e):
                # The store failed for a while, not a branch: stop here as a dead driver would, deciding nothing
                # for the branches (a stored "failed" would be for good); a continuation re-issues them.
                raise
            results, error = [None] * len(pending), f"{type(e).__name__}: {e}"
        for live, result in zip(pending, results, strict=True):
            if live.done:
                continue
            await self._look(live)
            if live.done:
                continue
            if result is not None and result.stop_reason == "completed" and \
                    self.name("stop", live) not in self.ctx.docs:
                live.branch.turns = max(0, result.turns - live.plan.base_turn)
                _spent(live, result.usage.cost_usd)
                await self._finish(live, result.messages, result)
            else:
                await self._end(live, result, error)

    async def _stop(self, live: _Live, reason: str, **why: Any) -> None:
        """Decide (once, stored) that ``live`` stops, then cancel its session through the agent's cancel path."""
        await self.ctx.put(self.name("stop", live), {"reason": reason, **why})
        await self.ctx.agent.cancel(live.plan.session_id, user_id=self.ctx.user_id)

    async def _decide_rungs(self) -> None:
        """Apply the stop rule at each rung every branch still in the race has been scored at, once, in order."""
        every = self.ctx.score_every
        if not every:
            return
        rung = 1
        while True:
            name = self.name("rung", suffix=f"k{rung:03d}")
            racing = [lv for lv in self.live if not self._stopped_before(lv, rung)]
            if name not in self.ctx.docs:
                running = [lv for lv in racing if not lv.done]
                if not running or any(rung not in lv.rung_scores for lv in running):
                    return
                entrants = [self._at_rung(lv, rung) for lv in racing if lv.done is False or lv.branch.score is not None]
                chosen = set(self.ctx.stop_rule([b for b in entrants if b.score is not None], self.ctx.keep))
                stop = [lv.plan.session_id for lv in running if lv.plan.session_id in chosen]
                await self.ctx.put(name, {"stop": stop})
            await asyncio.gather(*(self._stop(lv, "early_stopped", rung=rung) for lv in self.live
                                   if lv.plan.session_id in self.ctx.docs[name]["stop"]
                                   and self.name("stop", lv) not in self.ctx.docs))
            rung += 1

    def _stopped_before(self, live: _Live, rung: int) -> bool:
        """Out of the race at ``rung``: stopped at an earlier rung (or by the budget), or ended without completing."""
        stop = self.ctx.docs.get(self.name("stop", live))
        stopped_earlier = stop is not None and stop.get("rung", 0) < rung
        return stopped_earlier or (live.done and live.branch.stop_reason != "completed")

    def _at_rung(self, live: _Live, rung: int) -> Branch:
        """The branch as the stop rule sees it at ``rung``: ``score`` is its score there (or its final score)."""
        value = live.rung_scores.get(rung, live.branch.score if live.done else None)
        return Branch(session_id=live.plan.session_id, variant=live.plan.variant, round=self.number,
                      parent=live.plan.parent, score=value, spend_usd=live.branch.spend_usd, turns=live.branch.turns)

    def spend(self) -> float:
        """What this round's branches spent so far."""
        return sum(lv.branch.spend_usd or 0.0 for lv in self.live)

    async def _check_budget(self) -> None:
        """Stop every running branch, once, when the exploration's budget is spent."""
        ctx = self.ctx
        stored = ctx.docs.get("budget")
        if stored is None:
            reason = ctx.over_budget(ctx.finished_spend(self.number) + self.spend() + ctx.judge_spend())
            if reason is None:
                return
            stored = await ctx.put("budget", {"reason": reason, "round": self.number})
        self.stop_reason = stored["reason"]
        await asyncio.gather(*(self._stop(lv, "exploration_budget") for lv in self.live
                               if not lv.done and self.name("stop", lv) not in ctx.docs))


def _transient(error: BaseException) -> bool:
    """Whether a transient storage failure (one that outlived its retries) is in ``error``'s causes."""
    seen: set[int] = set()
    cur: BaseException | None = error
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, TransientStorageError):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


def _spent(live: _Live, cost: float | None) -> None:
    """The branch's spend since its fork point, from its cumulative cost (None: an unpriced call)."""
    live.branch.spend_usd = None if cost is None else max(0.0, cost - live.plan.base_cost)


def _fill_rungs(live: _Live) -> None:
    """A branch that passed several rungs between two looks was scored once, at the highest: that score stands
    for the rungs it skipped (the same rule whichever process fills them)."""
    for rung in range(max(live.rung_scores, default=0), 0, -1):
        if rung not in live.rung_scores:
            live.rung_scores[rung] = live.rung_scores[rung + 1]


def _apply_done(branch: Branch, done: dict[str, Any], score: dict[str, Any] | None) -> None:
    branch.stop_reason = done["stop_reason"]
    branch.spend_usd = done.get("spend_usd")
    branch.turns = done.get("turns", 0)
    branch.output = done.get("output", "")
    branch.score, branch.reasons = done.get("score"), done.get("reasons", "")
    if score is not None:
        branch.judge_spend_usd = score.get("judge_spend", 0.0)


def _result_of(ckpt: Checkpoint) -> RunResult:
    """A finished branch's result, read back from its final checkpoint."""
    output = next((m.content for m in reversed(ckpt.messages) if m.role == "assistant"), "")
    return RunResult(output=output, messages=list(ckpt.messages), usage=ckpt.cumulative_usage,
                     session_id=ckpt.session_id, user_id=ckpt.user_id, turns=ckpt.turn,
                     checkpoint_id=ckpt.checkpoint_id, forked_from=ckpt.forked_from)
