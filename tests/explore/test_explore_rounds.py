"""``Agent.explore`` on one process: judges, rounds and beams, adopting the winner, budgets, early stopping."""

from __future__ import annotations

import json

import pytest
from explore_agents import async_judge, judge, make_agent, model, variant

from loomray import Agent, Branch, Budget, ModelJudge, Score, Tuning, Variant
from loomray.errors import LoomrayUserError
from loomray.explore import successive_halving
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime


@pytest.fixture
def base(tmp_path):
    """An agent on a local store and a base session with one finished run to explore from."""
    agent = make_agent(LocalRuntime(tmp_path / "store"))
    agent.run_sync("task", session_id="base")
    yield agent
    agent.runtime.close()


def test_a_function_judge_picks_the_winner_and_the_base_adopts_it(base):
    variants = [variant("a", 0.2, 1), variant("b", 0.9, 2), variant("c", 0.5, 0)]
    result = base.explore_sync("base", variants=variants, judge=judge, adopt=True)
    assert result.stop_reason == "completed"
    by_prompt = {b.variant.prompt: b for b in result.branches}
    assert result.winner == by_prompt[variants[1].prompt].session_id
    assert [b.score for b in result.branches] == [0.2, 0.9, 0.5]
    assert all(b.stop_reason == "completed" and b.reasons.startswith("quality of") for b in result.branches)
    assert [b.turns for b in result.branches] == [2, 3, 1]
    # Spend is what each branch's model calls cost since the fork point; the total adds them up.
    assert all(b.spend_usd and b.spend_usd > 0 for b in result.branches)
    assert result.spend_usd == pytest.approx(sum(b.spend_usd for b in result.branches))
    # The base continues in place from the winner: a new checkpoint holding the winner's transcript.
    winner = base.get_checkpoint_sync(result.winner)
    adopted = base.get_checkpoint_sync("base")
    assert adopted.checkpoint_id == result.adopted_checkpoint_id
    assert adopted.messages == winner.messages and adopted.forked_from == result.winner
    assert adopted.cumulative_usage == winner.cumulative_usage
    assert base.runtime.store.checkpoints.list("base", limit=1)[0].chain, "built on the winner's chain"
    more = base.run_sync("task", session_id="base")
    assert more.messages[:len(winner.messages)] == winner.messages


def test_rounds_fork_the_kept_branches_again(base):
    seen = []

    def variants(round_, parents):
        seen.append((round_, [p.session_id for p in parents]))
        return [variant(f"r{round_}x", 0.1 * round_, 0), variant(f"r{round_}y", 0.2 * round_, 1)]

    result = base.explore_sync("base", variants=variants, judge=async_judge, rounds=3, keep=2)
    assert [len([b for b in result.branches if b.round == r]) for r in (1, 2, 3)] == [2, 4, 4]
    round1 = [b.session_id for b in result.branches if b.round == 1]
    assert seen[0] == (1, []) and seen[1] == (2, [round1[1], round1[0]])  # best first
    assert {b.parent for b in result.branches if b.round == 2} == set(round1)
    assert result.rounds_run == 3
    assert result.branch(result.winner).round == 3 and result.branch(result.winner).score == pytest.approx(0.6)
    # A round-3 branch's transcript holds its ancestors' prompts: it was forked from a round-2 branch.
    transcript = [m.content for m in base.get_checkpoint_sync(result.winner).messages if m.role == "user"]
    assert [t.split()[1] for t in transcript[1:]] == ["r1y", "r2y", "r3y"]


def test_a_finished_exploration_continues_to_the_same_result_and_mismatches_are_refused(base):
    variants = [variant("a", 0.3, 1), variant("b", 0.4, 1)]
    first = base.explore_sync("base", variants=variants, judge=judge, exploration_id="xpl-again")
    calls = base.model.calls
    again = base.explore_sync("base", variants=variants, judge=judge, exploration_id="xpl-again")
    assert base.model.calls == calls
    assert again.winner == first.winner and [b.score for b in again.branches] == [b.score for b in first.branches]
    with pytest.raises(ValueError, match="keep"):
        base.explore_sync("base", variants=variants, judge=judge, keep=2, exploration_id="xpl-again")
    with pytest.raises(ValueError, match="variants"):
        base.explore_sync("base", variants=variants[:1], judge=judge, exploration_id="xpl-again")
    with pytest.raises(ValueError, match="judge"):
        base.explore_sync("base", variants=variants, judge=async_judge, exploration_id="xpl-again")


def test_early_stopping_cancels_dominated_branches_and_reports_the_saving(tmp_path):
    agent = make_agent(LocalRuntime(tmp_path / "store"), delay=0.2)
    agent.run_sync("task", session_id="base")
    # Scored after 4 passes (the one rung a running branch reaches: each finishes at its 7th): successive
    # halving keeps the better half.
    variants = [variant(name, q, 6) for name, q in (("a", 0.1), ("b", 0.9), ("c", 0.3), ("d", 0.7))]
    result = agent.explore_sync("base", variants=variants, judge=judge, score_every=4)
    stops = {b.variant.prompt.split()[1]: b.stop_reason for b in result.branches}
    assert stops == {"a": "early_stopped", "b": "completed", "c": "early_stopped", "d": "completed"}
    stopped = [b for b in result.branches if b.stop_reason == "early_stopped"]
    finished = [b for b in result.branches if b.stop_reason == "completed"]
    assert all(b.turns < 7 and b.interim for b in stopped)
    assert result.saved_usd > 0
    mean = sum(b.spend_usd for b in finished) / len(finished)
    assert result.saved_usd == pytest.approx(sum(mean - b.spend_usd for b in stopped))
    assert result.winner == next(b.session_id for b in finished if b.score == 0.9)
    for b in stopped:  # cancelled through the cancel path: the session runs no more
        assert agent.resume_sync(None, session_id=b.session_id).stop_reason == "cancelled"


def test_successive_halving_keeps_the_better_half_and_never_fewer_than_keep():
    ranked = [Branch(session_id=f"s{i}", variant=Variant(), round=1, score=score)
              for i, score in enumerate([0.5, 0.9, 0.1, 0.7, 0.3])]
    assert successive_halving(ranked, 1) == ["s4", "s2"]
    assert successive_halving(ranked, 4) == ["s2"]
    assert successive_halving(ranked[:1], 1) == []


def test_a_custom_stop_rule_decides(tmp_path):
    agent = make_agent(LocalRuntime(tmp_path / "store"), delay=0.1)
    agent.run_sync("task", session_id="base")

    def only_the_best(branches, keep):
        best = max(branches, key=lambda b: b.score)
        return [b.session_id for b in branches if b is not best]

    variants = [variant(name, q, 6) for name, q in (("a", 0.1), ("b", 0.9), ("c", 0.3))]
    result = agent.explore_sync("base", variants=variants, judge=judge, score_every=2, stop_rule=only_the_best)
    assert [b.stop_reason for b in result.branches] == ["early_stopped", "completed", "early_stopped"]


def test_a_budget_stops_the_exploration_cleanly_with_a_result(tmp_path):
    agent = make_agent(LocalRuntime(tmp_path / "store"), delay=0.2)
    agent.run_sync("task", session_id="base")
    variants = [variant("quick", 0.5, 0)] + [variant(f"long{i}", 0.9, 30) for i in range(3)]
    result = agent.explore_sync("base", variants=variants, judge=judge, rounds=2, budget=Budget(max_cost_usd=0.001))
    assert result.stop_reason == "budget_exceeded"
    reasons = sorted(b.stop_reason for b in result.branches)
    assert reasons == ["completed", "exploration_budget", "exploration_budget", "exploration_budget"]
    assert result.winner == result.branches[0].session_id and result.rounds_run == 1
    assert all(b.turns < 31 for b in result.branches[1:])
    # Reached, and overshot only by the calls the running branches had in flight (~0.00025 USD each at that
    # turn; the model answers every 200 ms, the exploration looks every 100 ms and cancels the branches at
    # once): two each at most, leaving room for a loaded machine. Running on would have cost ~50 times more.
    assert 0.001 <= result.spend_usd < 0.001 + 3 * 2 * 0.00025


def test_a_wall_clock_budget_stops_it_too(tmp_path):
    agent = make_agent(LocalRuntime(tmp_path / "store"), delay=0.05)
    agent.run_sync("task", session_id="base")
    result = agent.explore_sync("base", variants=[variant("long", 0.9, 30)], judge=judge, budget=Budget(max_wall_s=0.5))
    assert result.stop_reason == "wall_clock_exceeded"
    assert result.branches[0].stop_reason == "exploration_budget" and result.winner is None


def test_a_model_judge_is_journaled_and_billed_once(base):
    mj_replies = ScriptedModel([lambda request: json.dumps(
        {"score": len(request.messages[-1].content) / 1000, "reasons": "by length"})])
    mj = ModelJudge(mj_replies, "Score the branch by how much it did.")
    variants = [variant("a", 0.3, 0), variant("b", 0.4, 3)]
    result = base.explore_sync("base", variants=variants, judge=mj, exploration_id="xpl-model")
    assert mj_replies.calls == 2
    assert result.winner == result.branches[1].session_id and result.branches[1].reasons == "by length"
    judge_spend = sum(b.judge_spend_usd for b in result.branches)
    assert judge_spend > 0
    assert result.spend_usd == pytest.approx(judge_spend + sum(b.spend_usd for b in result.branches))
    # The judge calls are sessions of their own, journaled and checkpointed: continuing pays for none again.
    again = base.explore_sync("base", variants=variants, judge=mj, exploration_id="xpl-model")
    assert mj_replies.calls == 2 and again.spend_usd == pytest.approx(result.spend_usd)


def test_bad_arguments_are_refused_before_anything_runs(base):
    good = [variant("a", 0.1)]
    with pytest.raises(TypeError, match="judge"):
        base.explore_sync("base", variants=good, judge="best")
    with pytest.raises(ValueError, match="keep"):
        base.explore_sync("base", variants=good, judge=judge, keep=0)
    with pytest.raises(ValueError, match="empty"):
        base.explore_sync("base", variants=[], judge=judge)
    with pytest.raises(TypeError, match="budget"):
        base.explore_sync("base", variants=good, judge=judge, budget="lots")
    with pytest.raises(ValueError, match="exploration_id"):
        base.explore_sync("base", variants=good, judge=judge, exploration_id="a/b")
    no_ckpt = Agent("x", model=model(), runtime=base.runtime, tuning=Tuning(checkpoint=False))
    with pytest.raises(LoomrayUserError, match="checkpoint"):
        no_ckpt.explore_sync("base", variants=good, judge=judge)
    assert Score.of(1) == Score(1.0)
    assert not base.runtime.store.objects.get(key="explorations/_/nothing.json")


def test_a_branch_runs_its_variants_instructions_and_stores_its_variant(base):
    brief = Variant(prompt="variant i q=0.6 passes=0", instructions="Be brief.")
    result = base.explore_sync("base", variants=[brief], judge=judge)
    assert result.branches[0].score == 0.6
    branch = result.branches[0].session_id
    assert base.get_checkpoint_sync(branch).messages[0].content == "Be brief."
    assert base.get_checkpoint_sync("base").messages[0].content != "Be brief."
    runs = base.runtime.store.runs.list(branch)
    assert runs[0].request["variant"]["instructions"] == "Be brief."


def test_a_round_planned_here_starts_its_branches_without_reading_them_first(base, monkeypatch):
    """No branch of a round whose plan this driver just stored can have run: the round starts them at once
    (reading 64 branches' checkpoints first was most of a driver's start of a round)."""
    runtime, events = base.runtime, []
    real_list, real_many = runtime.list_checkpoints, runtime.execute_many

    async def list_checkpoints(session_id, **kwargs):
        events.append(("look", session_id))
        return await real_list(session_id, **kwargs)

    async def execute_many(agents, requests, **kwargs):
        events.append(("start", [r.session_id for r in requests]))
        return await real_many(agents, requests, **kwargs)

    monkeypatch.setattr(runtime, "list_checkpoints", list_checkpoints)
    monkeypatch.setattr(runtime, "execute_many", execute_many)
    result = base.explore_sync("base", variants=[variant("a", 0.2, 1), variant("b", 0.5, 0)], judge=judge, rounds=2,
                               keep=1)
    assert result.stop_reason == "completed" and len(result.branches) == 4
    starts = [i for i, (kind, _) in enumerate(events) if kind == "start"]
    assert len(starts) == 2
    for i in starts:
        started = set(events[i][1])
        assert not [sid for kind, sid in events[:i] if kind == "look" and sid in started], events[:i]
    # Once started, each branch is read (how it ended) by the round that ran it.
    assert {sid for kind, sid in events if kind == "look"} == {b.session_id for b in result.branches}
