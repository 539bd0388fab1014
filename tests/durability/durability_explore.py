"""The ``explore`` scenario kind: one exploration's create-only decisions under faults, crash-stops and resumes.

Cast (see :func:`durability_kinds._explore`): the holder runs the base
session; then explorers continue one exploration by its id, one after the
other, as drivers that die and are started again would: ``explorer`` and
``explorer2`` meet storage noise and may be crash-stopped at a drawn call;
``explorer3`` meets no fault and must finish it. The exploration: 3 variants a
round, 2 rounds, keep 1; each branch makes one tool pass and an answer; a
function judge scores it from its prompts. Each explorer is a process of its
own (its own ``Store``), runs its branches in process one after the other
and its store calls on one thread, so the scheduler orders every one of its
storage calls.

The oracle, from the call log and the ledger of model and judge calls:

- ``explore-twice``: a record object (a decision) was written twice, or
  without create-only, or deleted;
- ``explore-rerun``: a branch's model call was made again after the first
  one's journal entry landed, or after the branch's ``done`` record did;
- ``explore-rejudged``: the judge was called for a score already stored;
- ``explore-result``: the last explorer did not finish the exploration, a
  branch did not complete (nothing but the store fails here: a transient
  failure must not end a branch for good), or the result disagrees with the
  judge (a completed branch's score, the winner: the best completed branch
  of the last round, whose parent the first round kept).
"""

from __future__ import annotations

import asyncio
import hashlib
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from durability_history import Violation, _v

from loomray import Agent, JudgeInput, Score, Tuning, Variant
from loomray.models import ModelResponse
from loomray.records import Message, ToolCall, Usage
from loomray.runtime.base import Runtime, per_request
from loomray.storage import layout
from loomray.storage.faults import ActorCrashed, current_actor

XID = "xpl-durable"
WIDTH, ROUNDS = 3, 2


@dataclass
class ExploreLedger:
    """What the explorers did: model and judge calls at storage call positions, how each explorer ended."""

    #: (position, actor, branch session id, pass) of every real model call of a branch.
    model_calls: list[tuple[int, str, str, int]] = field(default_factory=list)
    #: (position, actor, score record name) of every judge call.
    judge_calls: list[tuple[int, str, str]] = field(default_factory=list)
    #: actor -> "ok", "crashed" or the error it ended with.
    ends: dict[str, str] = field(default_factory=dict)
    result: Any = None


def ledger(world: Any) -> ExploreLedger:
    if not hasattr(world, "explore_ledger"):
        world.explore_ledger = ExploreLedger()
    return world.explore_ledger


def quality(prompts: str) -> float:
    """The judge's score of a branch whose chain of prompts is ``prompts`` (deterministic, ties unlikely)."""
    return int(hashlib.sha256(prompts.encode()).hexdigest()[:6], 16) / 0xFFFFFF


def _branch_of(prompts: list[str]) -> str:
    """The branch session a chain of variant prompts ("r1v2", "r2v0") runs in (keep=1: one parent a round)."""
    last = prompts[-1]
    round_, i = last[1:].split("v")
    return f"{XID}-r{round_}-{int(i):03d}"


class _Model:
    """Each branch: one tool pass, then an answer naming its chain of prompts; every real call is counted."""

    name = "scripted-explore"

    def __init__(self, world: Any) -> None:
        self.world = world

    async def complete(self, request: Any) -> ModelResponse:
        actor = current_actor.get()
        self.world.faulty.check_alive(actor)
        users = [i for i, m in enumerate(request.messages) if m.role == "user"]
        prompts = [request.messages[i].content for i in users[1:]]  # the base session's task first
        done = sum(1 for m in request.messages[users[-1]:] if m.role == "assistant")
        if prompts:
            ledger(self.world).model_calls.append((self.world.faulty.call_count, actor or "?",
                                                   _branch_of(prompts), done))
        if prompts and done < 1:
            message = Message(role="assistant", content="", tool_calls=[ToolCall(id=f"c{done}", name="step",
                                                                                 arguments={"n": done})])
        else:
            message = Message(role="assistant", content=f"answer {'/'.join(prompts)}")
        return ModelResponse(message=message, usage=Usage(input_tokens=10, output_tokens=5, requests=1,
                                                          cost_usd=0.001),
                             stop_reason="tool_use" if message.tool_calls else "end_turn", model=self.name)


class LedgerJudge:
    """Scores a branch by :func:`quality` of its prompts; counts each call (one reference for every explorer)."""

    def __init__(self, world: Any) -> None:
        self.world = world

    def __call__(self, judged: JudgeInput) -> Score:
        self.world.faulty.check_alive(current_actor.get())
        name = f"r{judged.round:03d}-score-{judged.session_id}-final"
        ledger(self.world).judge_calls.append((self.world.faulty.call_count, current_actor.get() or "?", name))
        prompts = [m.content for m in judged.messages if m.role == "user"][1:]
        return Score(quality("/".join(prompts)), "by its prompts")


class _OneAtATime(Runtime):
    """In process, a round's branches one after the other (each actor's storage calls stay in one order)."""

    async def execute_many(self, agent: Any, requests: Any, **kwargs: Any) -> list[Any]:
        return [await self.execute(a, r, **kwargs) for a, r in zip(per_request(agent, requests), requests,
                                                                     strict=True)]


def _variants(round_: int, parents: list) -> list[Variant]:
    return [Variant(prompt=f"r{round_}v{i}") for i in range(WIDTH)]


def explorer(world: Any, name: str):
    """An explorer actor: continues exploration :data:`XID` of the base session, by its id."""

    def step(n: int) -> str:
        """A tool pass that does nothing."""
        return "ok"

    def fn() -> None:
        store = world.new_store()
        world.stores.append(store)
        agent = Agent("Explore.", model=_Model(world), tools=[step], tuning=Tuning(checkpoint=True),
                      runtime=_OneAtATime(store, max_checkpoints_per_session=20), name="durability-explorer")

        async def main() -> Any:
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(1, thread_name_prefix=f"{name}-io"))
            return await agent.explore(world.spec.session_id, variants=_variants, judge=LedgerJudge(world),
                                       rounds=ROUNDS, keep=1, exploration_id=XID, user_id=world.spec.user_id)

        try:
            ledger(world).result = asyncio.run(main())
            ledger(world).ends[name] = "ok"
        except ActorCrashed:
            ledger(world).ends[name] = "crashed"
            raise
        except Exception as e:  # a driver that meets a storage error stops; the next one continues
            ledger(world).ends[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return fn


def explore_summary(world: Any) -> list[str]:
    """How each explorer ended and the calls it made (for a scenario's report)."""
    if not hasattr(world, "explore_ledger"):
        return []
    led = world.explore_ledger
    return [f"{name}: {end.splitlines()[0][:200]}; model calls "
            f"{[(p, s[-6:], k) for p, a, s, k in led.model_calls if a == name]}; judge calls "
            f"{[(p, n[-20:]) for p, a, n in led.judge_calls if a == name]}" for name, end in led.ends.items()]


# -- the oracle -----------------------------------------------------------------------------------------------
def _performed(c: Any) -> bool:
    return c.op == "put" and (c.outcome in ("ok", "dropped") or (c.outcome == "crashed" and c.applied))


def check_explore(world: Any) -> list[Violation]:
    """The invariants of the ``explore`` kind (nothing when no explorer ran)."""
    if not hasattr(world, "explore_ledger"):
        return []
    out: list[Violation] = []
    led, calls, uid = world.explore_ledger, world.faulty.calls, world.spec.user_id
    record = layout.exploration_prefix(world.spec.session_id, uid, XID)
    written: dict[str, list[int]] = {}
    for c in calls:
        for key in (c.keys or ((c.key,) if c.key else ())):
            if not key.startswith(record):
                continue
            if c.op == "delete":
                _v(out, "explore-twice", f"call {c.n}: {c.actor} deleted decision {key}")
            elif c.op == "put" and not c.if_none_match:
                _v(out, "explore-twice", f"call {c.n}: {c.actor} wrote decision {key} without create-only")
            if _performed(c):
                written.setdefault(key, []).append(c.n)
    for key, at in written.items():
        if len(at) > 1:
            _v(out, "explore-twice", f"decision {key} written {len(at)} times (calls {at})")
    for pos, actor, name in led.judge_calls:
        stored = written.get(f"{record}{name}.json", [])
        if stored and stored[0] < pos:
            _v(out, "explore-rejudged", f"{actor} called the judge for {name} at call {pos}; it was stored at "
                                        f"call {stored[0]}")
    _reruns(world, led, calls, written, record, out)
    _result(led, out)
    return out


def _reruns(world: Any, led: ExploreLedger, calls: list, written: dict[str, list[int]], record: str,
            out: list[Violation]) -> None:
    uid = world.spec.user_id
    seen: dict[tuple[str, int], list[tuple[int, str]]] = {}
    for pos, actor, sid, k in led.model_calls:
        done = [n for key, ns in written.items() if key.startswith(f"{record}r") and key.endswith(f"-done-{sid}.json")
                for n in ns]
        if done and done[0] < pos:
            _v(out, "explore-rerun", f"{actor} called the model for {sid} pass {k} at call {pos}; the branch ended "
                                     f"(its done record) at call {done[0]}")
        for first, who in seen.get((sid, k), []):
            landed = _journaled(calls, who, first, layout.journal_prefix(sid, uid))
            if landed is not None and landed < pos:
                _v(out, "explore-rerun", f"{actor} called the model for {sid} pass {k} at call {pos}; {who}'s call "
                                         f"at {first} was journaled at call {landed}")
        seen.setdefault((sid, k), []).append((pos, actor))


def _journaled(calls: list, actor: str, after: int, prefix: str) -> int | None:
    """Where ``actor``'s model call at ``after`` was journaled: its next model entry put for the session landed."""
    for c in calls[after:]:
        if c.actor == actor and c.op == "put" and (c.key or "").startswith(prefix) and (c.key or "").endswith(
                "-model.json"):
            return c.n if _performed(c) else None
    return None


def _result(led: ExploreLedger, out: list[Violation]) -> None:
    last = led.ends.get("explorer3")
    if last != "ok" or led.result is None:
        _v(out, "explore-result", f"the last explorer (no faults) did not finish the exploration: {last}")
        return
    result = led.result
    # No branch fails on its own here (its model and tool never do): only the store fails, and a store that
    # failed for a while must not decide a branch's end for good.
    ended = [f"{b.session_id} {b.stop_reason}" for b in result.branches if b.stop_reason != "completed"]
    if ended or len(result.branches) != WIDTH * ROUNDS:
        _v(out, "explore-result", f"{len(result.branches)} branches (want {WIDTH * ROUNDS}), not completed: {ended}")
    for b in result.branches:
        if b.stop_reason == "completed" and b.score != quality(b.output.removeprefix("answer ")):
            _v(out, "explore-result", f"branch {b.session_id} scored {b.score}, its prompts say "
                                      f"{quality(b.output.removeprefix('answer '))}")
    final = [b for b in result.branches if b.round == max(x.round for x in result.branches)
             and b.stop_reason == "completed"]
    if final:
        best = max(final, key=lambda b: (b.score, -result.branches.index(b)))
        if result.winner != best.session_id:
            _v(out, "explore-result", f"winner {result.winner}, the best completed branch of the last round is "
                                      f"{best.session_id}")
    first = [b for b in result.branches if b.round == 1 and b.stop_reason == "completed"]
    second = [b for b in result.branches if b.round == 2]
    if first and second:
        kept = max(first, key=lambda b: (b.score, -result.branches.index(b))).session_id
        if any(b.parent != kept for b in second):
            _v(out, "explore-result", f"round 2 forks from {sorted({b.parent for b in second})}, round 1's best "
                                      f"completed branch is {kept}")
