"""The fault-injecting object store and the deterministic scheduler the durability checker is built on."""

from __future__ import annotations

import threading

import pytest
from durability_sched import Scheduler

from loomray.storage.errors import PreconditionFailed, TransientStorageError
from loomray.storage.faults import ActorCrashed, Fault, FaultPlan, FaultyObjectStore, Rule, current_actor
from loomray.storage.memory import MemoryObjectStore


def _store(plan: FaultPlan | None = None, **kw) -> tuple[MemoryObjectStore, FaultyObjectStore]:
    inner = MemoryObjectStore("faults")
    return inner, FaultyObjectStore(inner, plan or FaultPlan(), **kw)


def test_calls_are_numbered_counted_and_logged():
    inner, f = _store()
    f.put(key="sessions/_/s/a.json", data=b"1")
    assert f.get(key="sessions/_/s/a.json").data == b"1"
    assert f.get(key="sessions/_/s/missing.json") is None
    assert [o.key for o in f.list(prefix="sessions/")] == ["sessions/_/s/a.json"]
    assert f.list_dirs(prefix="sessions/") == ["_"]
    f.delete(keys=["sessions/_/s/a.json"])
    assert [c.n for c in f.calls] == [1, 2, 3, 4, 5, 6]
    assert [c.outcome for c in f.calls] == ["ok", "ok", "missing", "ok", "ok", "ok"]
    assert dict(f.counts) == {"put": 1, "get": 2, "list": 1, "list_dirs": 1, "delete": 1}
    assert f.written == ["sessions/_/s/a.json"] and f.deleted == ["sessions/_/s/a.json"]
    assert f.calls[0].data == b"1" and f.calls[0].applied and not f.calls[1].applied
    assert inner.get(key="sessions/_/s/a.json") is None


def test_fail_raises_before_the_operation():
    inner, f = _store(FaultPlan(at={1: Fault("fail")}))
    with pytest.raises(TransientStorageError, match="injected put failure"):
        f.put(key="k", data=b"x")
    assert inner.get(key="k") is None
    assert f.calls[0].outcome == "failed" and not f.calls[0].applied
    f.put(key="k", data=b"x")  # call 2: no fault
    assert inner.get(key="k").data == b"x"


def test_drop_does_the_operation_then_loses_the_reply():
    inner, f = _store(FaultPlan(at={1: Fault("drop")}))
    with pytest.raises(TransientStorageError, match="reply loss"):
        f.put(key="k", data=b"x", if_none_match=True)
    assert inner.get(key="k").data == b"x"
    assert f.calls[0].outcome == "dropped" and f.calls[0].applied
    with pytest.raises(PreconditionFailed):  # the retry of a create-only put finds its own write
        f.put(key="k", data=b"x", if_none_match=True)
    assert f.calls[1].outcome == "precondition" and not f.calls[1].applied


@pytest.mark.parametrize("applied", [False, True])
def test_crash_stops_the_actor_for_good(applied):
    inner, f = _store(FaultPlan(by_actor={("w", 2): Fault("crash", applied=applied)}))
    token = current_actor.set("w")
    try:
        f.put(key="a", data=b"1")
        with pytest.raises(ActorCrashed) as info:
            f.put(key="b", data=b"2")
        assert not isinstance(info.value, Exception)  # no `except Exception` can swallow it
        assert (inner.get(key="b") is not None) == applied
        assert f.calls[1].outcome == "crashed" and f.calls[1].applied == applied
        with pytest.raises(ActorCrashed):  # every later call of that actor is refused, unnumbered
            f.get(key="a")
        assert len(f.calls) == 2 and "w" in f.dead
        with pytest.raises(ActorCrashed):
            f.check_alive("w")
    finally:
        current_actor.reset(token)
    assert f.get(key="a").data == b"1"  # other actors go on


def test_crash_coin_is_seeded():
    def outcomes(seed):
        inner, f = _store(FaultPlan(seed=seed, rules=[Rule(Fault("crash"), ops=frozenset({"put"}))]))
        out = []
        for i in range(20):
            token = current_actor.set(f"a{i}")
            try:
                with pytest.raises(ActorCrashed):
                    f.put(key=f"k{i}", data=b"x")
            finally:
                current_actor.reset(token)
            out.append(inner.get(key=f"k{i}") is not None)
        return out

    assert outcomes(7) == outcomes(7)
    assert True in outcomes(7) and False in outcomes(7)


def test_rules_filter_by_kind_actor_key_and_call_range():
    rule = Rule(Fault("fail"), ops=frozenset({"get"}), actors=frozenset({"w"}), key_contains="lease.json",
                first=2, last=3)
    inner, f = _store(FaultPlan(rules=[rule]))
    inner.put(key="s/lease.json", data=b"{}")
    token = current_actor.set("w")
    try:
        f.get(key="s/lease.json")  # w's call 1: before the window
        for _ in range(2):  # calls 2 and 3: inside
            with pytest.raises(TransientStorageError):
                f.get(key="s/lease.json")
        f.get(key="s/lease.json")  # call 4: after
        f.get(key="s/other.json")
    finally:
        current_actor.reset(token)
    f.get(key="s/lease.json")  # another actor
    assert [c.fault for c in f.calls] == [None, "fail", "fail", None, None, None]
    assert f.injected["fail"] == 2


def test_delay_without_a_gate_just_waits():
    inner, f = _store(FaultPlan(at={1: Fault("delay", hold=1)}))
    f.put(key="k", data=b"x")
    assert f.calls[0].fault == "delay" and inner.get(key="k").data == b"x"


def test_backend_attributes_pass_through(tmp_path):
    from loomray.storage.localdir import LocalObjectStore

    f = FaultyObjectStore(LocalObjectStore(tmp_path / "root"))
    assert f.root == (tmp_path / "root").resolve() and f.backend == "file"
    assert f.describe("k").endswith("key 'k'")


def _interleaving(seed: int) -> list[tuple[str, str]]:
    sched = Scheduler(seed, stall_timeout=10)
    inner = MemoryObjectStore("sched")
    f = FaultyObjectStore(inner, FaultPlan(seed=seed, rules=[Rule(Fault("delay", hold=2), p=0.2)]),
                          gate=sched.gate, actor=sched.actor_of_call)

    def actor(name):
        def fn():
            for i in range(5):
                f.put(key=f"{name}/{i}", data=b"x")
        return fn

    for name in ("a", "b", "c"):
        sched.add(name, actor(name))
    assert sched.run() == []
    return [(c.actor, c.key) for c in f.calls]


def test_scheduler_runs_one_call_at_a_time_in_a_seeded_order():
    first = _interleaving(3)
    assert first == _interleaving(3)
    assert len(first) == 15 and {a for a, _ in first} == {"a", "b", "c"}
    for name in "abc":  # each actor's own calls stay in program order
        assert [k for a, k in first if a == name] == [f"{name}/{i}" for i in range(5)]
    assert any(_interleaving(s) != first for s in range(4, 10))


def test_scheduler_start_conditions_and_pause():
    sched = Scheduler(1, stall_timeout=10)
    f = FaultyObjectStore(MemoryObjectStore("s"), gate=sched.gate, actor=sched.actor_of_call)
    order = []

    def holder():
        for i in range(4):
            f.put(key=f"h{i}", data=b"x")
            order.append("h")

    def taker():
        order.append("t-start")
        sched.pause(3)
        f.put(key="t", data=b"x")

    sched.add("holder", holder)
    sched.add("taker", taker, start_when=lambda s: s.done("holder"))
    sched.run()
    assert order == ["h", "h", "h", "h", "t-start"]
    assert [c.actor for c in f.calls] == ["holder"] * 4 + ["taker"]


def test_scheduler_breaks_a_stall_and_reports_it():
    sched = Scheduler(1, stall_timeout=0.3)
    f = FaultyObjectStore(MemoryObjectStore("s"), gate=sched.gate, actor=sched.actor_of_call)
    sched.on_stall = f.kill
    release = threading.Event()

    def stuck():
        f.put(key="a", data=b"x")
        release.wait(1)  # blocks outside any storage call
        f.put(key="b", data=b"x")

    sched.add("stuck", stuck)
    stalls = sched.run()
    release.set()
    assert [s.actor for s in stalls] == ["stuck"] and "release.wait" in stalls[0].stacks
    sched.actors["stuck"].thread.join(5)
    assert sched.actors["stuck"].crashed  # its next storage call ended it
