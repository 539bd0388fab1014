"""The checker itself: a deliberately broken backend under the scenarios must produce violations.

Each broken store sits between the fault-injecting wrapper (which logs the
calls as if they worked) and the real bytes, so the invariants see a store
that lies: acknowledged writes that never land, deletes that never happen,
conditional puts that are not conditional.
"""

from __future__ import annotations

import pytest
from durability_scenarios import run_scenario

from loomray.storage.objects import ObjectStore


class _Broken(ObjectStore):
    """Delegates to ``inner`` but drops puts whose key contains one of ``lose``, skips deletes of keys
    containing one of ``keep``, and ignores conditions when ``unconditional``."""

    backend = "memory"

    def __init__(self, inner: ObjectStore, *, lose=(), keep=(), unconditional: bool = False) -> None:
        self.inner, self.lose, self.keep, self.unconditional = inner, lose, keep, unconditional

    def put(self, *, key, data, if_none_match=False, if_match=None):
        if any(part in key for part in self.lose):
            return '"never-stored"'
        if self.unconditional:
            if_none_match, if_match = False, None
        return self.inner.put(key=key, data=data, if_none_match=if_none_match, if_match=if_match)

    def get(self, *, key):
        return self.inner.get(key=key)

    def list(self, *, prefix):
        return self.inner.list(prefix=prefix)

    def list_dirs(self, *, prefix):
        return self.inner.list_dirs(prefix=prefix)

    def delete(self, *, keys):
        self.inner.delete(keys=[k for k in keys if not any(part in k for part in self.keep)])

    def describe(self, key=None):
        return self.inner.describe(key)


def _invariants(kind: str, seeds: range, **broken) -> list[set[str]]:
    return [{v.invariant for v in run_scenario(seed, kind, "memory",
                                               wrap_inner=lambda inner: _Broken(inner, **broken)).violations}
            for seed in seeds]


def test_lost_journal_and_checkpoint_writes_show_as_lost_checkpoints_and_double_billing():
    # Not every seed gets the final lease holder to acknowledge a checkpoint (its faults may stop it first);
    # most do, and each of those is caught.
    found = _invariants("crash-restart", range(8), lose=("/journal/", "/checkpoints/"))
    assert sum("acked-readable" in f for f in found) >= 4, found
    assert any("rebilled-model" in f or "rerun-tool" in f for f in found), found


def test_deletes_that_never_happen_show_as_index_and_objects_disagreeing():
    found = _invariants("compaction", range(3), keep=("/checkpoints/",))
    assert any("index-objects" in f for f in found), found


def test_conditional_puts_that_are_not_conditional_grant_an_epoch_twice():
    found = _invariants("lease-storm", range(3), unconditional=True)
    assert any("epochs-rise" in f for f in found), found


def test_a_reader_that_loses_a_row_shows_as_views_disagreeing(monkeypatch):
    # The oracle compares every reader: a Store.query that drops the newest row is caught, by name.
    from loomray.storage.store import Store

    real = Store.query
    monkeypatch.setattr(Store, "query", lambda self, **kw: real(self, **kw).slice(1))
    found = [run_scenario(seed, "compaction", "memory").violations for seed in range(2)]
    assert all(any(v.invariant == "views-agree" and v.detail.startswith("query differs") for v in f)
               for f in found), found


# -- the billing excuse is narrow -------------------------------------------------------------------
def _log(case: str):
    """A hand-written call log: ``old`` (epoch 1) journals a tool step while ``new`` takes over (epoch 2);
    ``next`` (epoch 3) continues the run and runs that tool again."""
    import json
    from types import SimpleNamespace

    from durability_world import Incarnation

    from loomray.storage.faults import Call

    s = "sessions/_/sess"
    calls: list[Call] = []

    def put(actor, key, body):
        calls.append(Call(len(calls) + 1, actor, 0, "put", key, data=json.dumps(body).encode(), outcome="ok",
                          applied=True))

    def entry(actor, seq, step, kind, epoch, **output):
        put(actor, f"{s}/journal/run-a/{seq:08d}-{step}.json",
            {"kind": kind, "step_key": step, "seq": seq, "epoch": epoch, "output": output})

    def lease(actor, epoch):
        put(actor, f"{s}/epochs/{epoch:020d}", {"epoch": epoch})
        put(actor, f"{s}/lease.json", {"epoch": epoch})

    def listing():
        calls.append(Call(len(calls) + 1, "new", 0, "list", f"{s}/journal/run-a/", outcome="ok"))

    old = Incarnation("old#1", "old", "run", start=0, run_id="run-a", outcome="fenced")
    new = Incarnation("new#1", "new", "run", start=0, run_id="run-a", outcome="ok")
    lease("old", 1)
    entry("old", 0, "run-start", "run_start", 1)
    entry("old", 1, "t0000-model", "model", 1)
    new.start = len(calls)
    if case == "listed_before_the_step":
        entry("old", 2, "t0000-tool-c1", "tool", 1)
        listing()
    else:
        listing()
        entry("old", 2, "t0000-tool-c1", "tool", 1)
    if case == "writer_crashed":
        old.outcome = "crashed"
        old.end = len(calls)
    lease("new", 2)
    entry("new", 3 if case == "seal_does_not_fence_it" else 2, "seal-e2", "seal", 2, excluded=[], missing=[])
    calls.append(Call(len(calls) + 1, "old", 0, "get", f"{s}/lease.json", outcome="ok"))
    old.end = old.end if old.end is not None else len(calls)
    if case == "zombie_crashed_after_the_swap":
        old.outcome = "crashed"
    new.end = len(calls)
    nxt = Incarnation("next#1", "next", "run", start=len(calls), run_id="run-a", outcome="ok")
    lease("next", 3)
    nxt.tool_runs.append((len(calls), "run-a", "t0000-tool-c1", 0))
    nxt.end = len(calls)
    return SimpleNamespace(incarnations=[old, new, nxt], excused=[], faulty=SimpleNamespace(calls=calls))


@pytest.mark.parametrize("case, excused", [("live_zombie_inside_the_window", True),
                                           ("zombie_crashed_after_the_swap", True),
                                           ("listed_before_the_step", False),
                                           ("writer_crashed", True),
                                           ("seal_does_not_fence_it", False)])
def test_review_r3_rerun_is_excused_only_for_a_live_zombie_inside_a_takeover_listing_window(case, excused):
    """Re-running a journaled step is excused only when a writer that still held the lease journaled it
    after the takeover's last listing and before its swap (so it was alive during the takeover, whether it
    crashed before the swap or later) and a seal of the takeover's epoch fences it; anything else is a
    ``rerun-tool`` violation."""
    from durability_history import History
    from durability_journal_checks import _billing

    world = _log(case)
    violations = _billing(world, History.build(world.faulty.calls), None)
    assert (len(world.excused), [v.invariant for v in violations]) == ((1, []) if excused else (0, ["rerun-tool"]))
