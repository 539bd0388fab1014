"""An exploration under storage faults: a store that fails for a while decides nothing for good."""

from __future__ import annotations

import pytest
from explore_agents import judge, make_agent, variant

from loomray.runtime import LocalRuntime
from loomray.storage import Store
from loomray.storage.faults import Fault, FaultyObjectStore, Rule
from loomray.storage.localdir import LocalObjectStore


def test_a_store_failing_for_a_while_ends_no_branch_for_good(tmp_path):
    """A transient storage failure while a branch starts stops the exploration as a dead driver would; the
    continuation runs every branch to completion (before: every branch of the round was stored "failed")."""
    objects = FaultyObjectStore(LocalObjectStore(tmp_path / "store"))
    store = Store(objects, f"file://{tmp_path / 'store'}")
    agent = make_agent(LocalRuntime(store))
    agent.run_sync("task", session_id="base")
    # The first branch's lease listing fails once, past the store's retries.
    objects.plan.rules = [Rule(Fault("fail"), ops=frozenset({"list"}), key_contains="xpl-flaky-r1-000/leases/",
                               last=10**9)]
    variants = [variant("a", 0.2, 1), variant("b", 0.9, 1), variant("c", 0.5)]
    with pytest.raises(Exception) as failed:
        agent.explore_sync("base", variants=variants, judge=judge, exploration_id="xpl-flaky")
    assert "injected" in repr(failed.value) or "injected" in repr(failed.value.__cause__)
    objects.plan.rules = []
    result = agent.explore_sync("base", variants=variants, judge=judge, exploration_id="xpl-flaky")
    assert [b.stop_reason for b in result.branches] == ["completed"] * 3
    assert result.winner == "xpl-flaky-r1-001"
    agent.runtime.close()
