"""Prune and explorations: a finished exploration's record goes with its session; a running one's never does."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from explore_agents import judge, make_agent, variant

from loomray import JudgeInput, Score
from loomray.runtime import LocalRuntime


class FlakyJudge:
    """:func:`explore_agents.judge`, but its first call fails: the exploration stops half-way, as a driver
    killed there leaves it (its plan stored, no result). Every instance has the same reference, so a new one
    continues it."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __call__(self, judged: JudgeInput) -> Score:
        if self.fail:
            raise RuntimeError("the driver died here")
        return judge(judged)


def _keys(store, prefix):
    return {o.key for o in store.objects.list(prefix=prefix)}


def test_prune_removes_finished_explorations_and_never_a_running_one(tmp_path):
    agent = make_agent(LocalRuntime(tmp_path / "store"))
    store = agent.runtime.store
    agent.run_sync("task", session_id="base")
    finished = agent.explore_sync("base", variants=[variant("a", 0.2), variant("b", 0.9, 1)], judge=judge,
                                  exploration_id="xpl-done")
    running = [variant("c", 0.5, 1), variant("d", 0.4)]
    with pytest.raises(RuntimeError, match="driver died"):
        agent.explore_sync("base", variants=running, judge=FlakyJudge(fail=True), exploration_id="xpl-running")
    mine = "sessions/_/base/explorations/"
    done_keys, running_keys = _keys(store, mine + "xpl-done/"), _keys(store, mine + "xpl-running/")
    assert f"{mine}xpl-done/result.json" in done_keys and f"{mine}xpl-running/plan.json" in running_keys
    assert f"{mine}xpl-running/result.json" not in running_keys

    # Pruning the whole session (what deleting it is): the finished exploration's record and pointer go.
    plan = store.plan_prune(session_id="base")
    report = store.prune(session_id="base")
    assert _keys(store, mine + "xpl-done/") == set() and _keys(store, "explorations/_/xpl-done") == set()
    (base_plan,) = plan.sessions  # the dry run said so
    assert base_plan.explorations.deleted == ("xpl-done",) and base_plan.explorations.kept == ("xpl-running",)
    assert plan.summary()["explorations"] == report.explorations == 1
    # The running one loses nothing: whoever continues it reads back every decision it took.
    assert _keys(store, mine + "xpl-running/") == running_keys
    assert _keys(store, "explorations/_/xpl-running") == {"explorations/_/xpl-running.json"}
    # Its branches are sessions of their own, not in this prune's scope.
    assert store.checkpoints.list(finished.winner, limit=1)

    # Continued to its end, it is over: a prune before it finished keeps it, one after removes it.
    agent.run_sync("task", session_id="base")  # the pruned session again, to explore from
    result = agent.explore_sync("base", variants=running, judge=FlakyJudge(fail=False), exploration_id="xpl-running")
    assert result.stop_reason == "completed" and result.winner == "xpl-running-r1-000"
    earlier = datetime.now(timezone.utc) - timedelta(hours=1)
    assert store.prune(before=earlier, session_id="base").explorations == 0
    assert f"{mine}xpl-running/result.json" in _keys(store, mine)
    assert store.prune(before=datetime.now(timezone.utc) + timedelta(seconds=5)).explorations == 1
    assert _keys(store, mine) == set() and _keys(store, "explorations/") == set()
    agent.runtime.close()

