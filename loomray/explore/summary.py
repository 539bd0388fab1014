"""The result of an exploration, read from its record: branches, winner, spend, what early stopping saved.

A pure function of the stored documents, so the driver that ran the
exploration, one that continued it and ``loomray tree`` all report the same.
"""

from __future__ import annotations

from typing import Any

from loomray.explore.record import variant_from_doc
from loomray.explore.stopping import rank
from loomray.explore.types import Branch, Exploration


def branches_of(docs: dict[str, dict[str, Any]]) -> list[Branch]:
    """Every planned branch of every round, as far as the record tells how it went."""
    out = []
    for name in sorted(n for n in docs if n.endswith("-plan") and n.startswith("r")):
        number = int(name[1:4])
        for planned in docs[name]["branches"]:
            sid = planned["session_id"]
            branch = Branch(session_id=sid, variant=variant_from_doc(planned["variant"]), round=number,
                            parent=planned["parent"])
            scores = sorted((n, d) for n, d in docs.items() if n.startswith(f"r{number:03d}-score-{sid}-"))
            branch.interim = [(d["turn"], d["value"]) for n, d in scores if not d.get("final")]
            branch.judge_spend_usd = sum(d.get("judge_spend", 0.0) for _, d in scores)
            if branch.interim:
                branch.score = branch.interim[-1][1]
            done = docs.get(f"r{number:03d}-done-{sid}")
            if done is not None:
                branch.stop_reason, branch.spend_usd = done["stop_reason"], done.get("spend_usd")
                branch.turns, branch.output = done.get("turns", 0), done.get("output", "")
                branch.score, branch.reasons = done.get("score"), done.get("reasons", "")
            out.append(branch)
    return out


def contenders(branches: list[Branch], round_: int) -> list[Branch]:
    """The branches of ``round_`` that may be kept or win: completed and scored; best first."""
    return rank([b for b in branches if b.round == round_ and b.stop_reason == "completed" and b.score is not None])


def winner_of(branches: list[Branch]) -> str | None:
    """The best completed branch of the last round that has one."""
    for number in sorted({b.round for b in branches}, reverse=True):
        best = contenders(branches, number)
        if best:
            return best[0].session_id
    return None


def saved(branches: list[Branch]) -> float:
    """What early-stopped branches did not spend: per round, the mean spend of its completed branches minus
    what each stopped branch spent before it stopped (never below 0). An estimate: a stopped branch might have
    run shorter or longer than its round's average."""
    total = 0.0
    for number in {b.round for b in branches}:
        finished = [b.spend_usd for b in branches if b.round == number and b.stop_reason == "completed"
                    and b.spend_usd is not None]
        if not finished:
            continue
        mean = sum(finished) / len(finished)
        total += sum(max(0.0, mean - (b.spend_usd or 0.0)) for b in branches
                     if b.round == number and b.stop_reason == "early_stopped")
    return total


def summarize(docs: dict[str, dict[str, Any]], exploration_id: str, session_id: str) -> Exploration:
    """The exploration as its record stands."""
    branches = branches_of(docs)
    spend = sum((b.spend_usd or 0.0) + b.judge_spend_usd for b in branches)
    adopt = docs.get("adopt")
    stop = docs.get("budget", {}).get("reason", "completed")
    rounds_run = max((b.round for b in branches), default=0)
    winner = adopt["winner"] if adopt else (docs["result"]["winner"] if "result" in docs else winner_of(branches))
    return Exploration(exploration_id=exploration_id, session_id=session_id, winner=winner, branches=branches,
                       spend_usd=spend, saved_usd=saved(branches), stop_reason=stop, rounds_run=rounds_run,
                       adopted_checkpoint_id=adopt.get("checkpoint_id") if adopt else None)
