"""What each scenario kind is made of: its actors, their start conditions and the faults injected.

A builder gets the spec (passes, position, keep, user drawn already), the
kind's ``random.Random``, the fault plan, the actor list to fill, and
``crash(actor, lo, hi, p)`` / ``resume_or_run()`` helpers. The order of its
draws is the seed's scenario: change a kind by adding draws at its end.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from durability_world import Spec

from loomray.storage.faults import Fault, FaultPlan, Rule


def done(*names: str):
    return lambda s: all(s.done(n) for n in names)


def at_step(k: int):
    return lambda s: s.steps >= k


def either(*preds):
    return lambda s: any(p(s) for p in preds)


def acks_at_least(j: int):
    return lambda s: sum(len(i.acks) for i in s.world.incarnations) >= j


def _noise(rng: random.Random, level: str) -> list[Rule]:
    fail, drop, delay = {"none": (0, 0, 0), "low": (0.01, 0.01, 0.05), "mid": (0.03, 0.03, 0.08)}[level]
    rules = []
    if fail:
        rules.append(Rule(Fault("fail"), p=fail))
    if drop:
        rules.append(Rule(Fault("drop"), p=drop, ops=frozenset({"put", "delete", "get"})))
    if delay:
        rules.append(Rule(Fault("delay", hold=rng.randint(1, 6)), p=delay))
    return rules


def _crash_restart(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, "low")
    crash("holder", 1, 90, p=0.9)
    actors.append(("holder", "writer", {"kind": "run", "attempts": 2}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": done("holder")}))
    crash("taker", 1, 70, p=0.3)
    actors.append(("taker2", "writer", {"kind": "run", "start_when": done("taker")}))

def _zombie(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, "low")
    crash("holder", 30, 120, p=0.2)
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": at_step(rng.randint(2, 60))}))
    if rng.random() < 0.5:
        actors.append(("taker2", "writer", {"kind": "run", "start_when": done("holder", "taker")}))

def _compaction(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    # keep=20: no retention, so a reader that misses rows can only blame compaction.
    spec.keep = rng.choice([1, 2, 3, 20, 20])
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    actors.append(("holder", "writer", {"kind": "run"}))
    actors.append(("compactor", "compactor", {"rounds": rng.randint(3, 6)}))
    if rng.random() < 0.6:
        actors.append(("compactor2", "compactor", {"rounds": rng.randint(2, 5)}))
    actors.append(("reader", "reader", {"rounds": rng.randint(3, 5)}))
    if rng.random() < 0.7:
        actors.append(("reader2", "reader", {"rounds": 3, "start_when": at_step(rng.randint(5, 80))}))
    if rng.random() < 0.3:
        crash("holder", 20, 90)
        actors.append(("taker", "writer", {"kind": "run", "start_when": done("holder")}))

def _prune(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    crash("holder", 25, 100, p=0.85)
    j = rng.randint(1, 3)
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("pruner", "pruner", {"after_acks": j,
                                         "start_when": either(acks_at_least(j + rng.randint(0, 2)), done("holder"))}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": done("holder", "pruner")}))
    if rng.random() < 0.5:
        actors.append(("reader", "reader", {"rounds": 1, "start_when": done("pruner")}))

def _lease_loss(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("vandal", "vandal", {"start_when": at_step(rng.randint(3, 50))}))
    crash("holder", 20, 100, p=0.5)
    if rng.random() < 0.5:
        actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": done("holder", "vandal")}))
    else:
        actors.append(("taker", "writer", {"kind": resume_or_run(),
                                           "start_when": either(at_step(rng.randint(30, 90)), done("holder"))}))
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done("holder", "taker")}))

def _outage(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    mode = rng.choice(["lease-reads", "all"])
    first = rng.randint(8, 40)
    last = first + rng.choice([6, 12, 100000])
    spec.notes.append(f"holder outage ({mode}) from its call {first} to {last}")
    plan.rules = [Rule(Fault("fail"), p=1.0, actors=frozenset({"holder"}), first=first, last=last,
                       ops=frozenset({"get"}) if mode == "lease-reads" else None,
                       key_contains="lease.json" if mode == "lease-reads" else None)]
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": done("holder")}))

def _chaos(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, "mid")
    crash("holder", 10, 100, p=0.5)
    actors.append(("holder", "writer", {"kind": "run", "attempts": 2}))
    if rng.random() < 0.5:
        actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": at_step(rng.randint(5, 80))}))
    else:
        actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": done("holder")}))
    crash("taker", 10, 80, p=0.3)
    actors.append(("taker2", "writer", {"kind": "run", "start_when": done("holder", "taker")}))
    actors.append(("compactor", "compactor", {"rounds": 3}))
    if rng.random() < 0.5:
        actors.append(("compactor2", "compactor", {"rounds": 3, "start_when": at_step(rng.randint(1, 40))}))
    actors.append(("reader", "reader", {"rounds": 2, "start_when": at_step(rng.randint(1, 60))}))
    if rng.random() < 0.5:
        actors.append(("pruner", "pruner", {"after_acks": 1, "start_when": acks_at_least(rng.randint(1, 4))}))
    if rng.random() < 0.3:
        actors.append(("vandal", "vandal", {"start_when": at_step(rng.randint(5, 80))}))

def _clock_skew(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    spec.skews = {"taker": -rng.choice([60.0, 3600.0, 86400.0])}
    spec.notes.append(f"taker's clock is {-spec.skews['taker']:.0f}s behind")
    actors.append(("holder", "writer", {"kind": "run"}))
    actors.append(("taker", "writer", {"kind": "run", "attempts": 1, "start_when": done("holder")}))
    crash("taker", 15, 70)
    actors.append(("taker2", "writer", {"kind": resume_or_run(), "start_when": done("taker")}))

def _lease_storm(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    for i in range(5):
        actors.append((f"w{i}", "writer", {"kind": resume_or_run(), "attempts": 2}))
        crash(f"w{i}", 5, 60, p=0.2)
    if rng.random() < 0.5:
        actors.append(("vandal", "vandal", {"start_when": at_step(rng.randint(3, 40))}))
    actors.append(("last", "writer", {"kind": "run", "start_when": done(*(f"w{i}" for i in range(5)))}))


#: The actors and faults of each scenario kind: ``builder(spec, rng, plan, actors, crash, resume_or_run)``.
BUILDERS: dict[str, Any] = {
    "crash-restart": _crash_restart,
    "zombie": _zombie,
    "compaction": _compaction,
    "prune": _prune,
    "lease-loss": _lease_loss,
    "outage": _outage,
    "chaos": _chaos,
    "clock-skew": _clock_skew,
    "lease-storm": _lease_storm,
}




# -- the newer paths: pins, deletes, foreign files, an unreadable lease, stalls, control -----------------------
def _zombie_pause(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any,
                  resume_or_run: Any) -> None:
    """The holder stops inside a tool or a model call while a taker takes over (and finishes, or crashes before
    its first checkpoint); retention keeps fewer checkpoints than a batch holds, so the zombie's log has
    retention work pending when it wakes; a second taker recovers after both."""
    spec.keep = rng.choice([1, 2, 3])
    spec.batch = rng.choice([4, 16])
    where = rng.choice(["tool", "model"])
    n = rng.randint(1, spec.passes - 1)
    secs = rng.choice([0.0, 3.0, 3.0]) if where == "model" else 0.0
    spec.stalls = {"holder": (where, n, secs, ("taker",))}
    spec.notes.append(f"holder stalls in its {where} {n} ({secs:.0f} s) until the taker is done")
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "attempts": 1, "start_when": stalled("holder")}))
    crash("taker", 8, 30, p=0.4)
    if any(actor == "taker" for actor, _ in plan.by_actor):  # the taker crashes: a second one recovers after both
        actors.append(("taker2", "writer", {"kind": "resume", "start_when": done("holder", "taker")}))
    if rng.random() < 0.5:
        actors.append(("compactor", "compactor", {"rounds": 2, "grace": 0, "start_when": done("holder", "taker")}))
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done("holder", "taker")}))


def _pins(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    """A fork (crashing before its first checkpoint or not) holds pins on the parent's chain while prune, delete
    through the writer's own store and retention by the parent's next run retire the parent's rows; the compactor
    drops tombstones at once; the crashed fork is then re-issued."""
    spec.keep = rng.choice([1, 2, 3, 20, 20])
    spec.full_every = rng.choice([3, 500, 500])
    spec.rounds = 2
    plan.rules = _noise(rng, rng.choice(["none", "none", "low"]))
    actors.append(("holder", "writer", {"kind": "run", "attempts": 2}))
    actors.append(("forker", "forker", {"pick": rng.choice(["oldest", "newest"]), "crash": rng.random() < 0.7,
                                        "start_when": done("holder")}))
    actors.append(("deleter", "deleter", {"pick": rng.choice(["newest", "middle", "oldest", "forked"]),
                                          "own": rng.choice(["holder", None]), "start_when": done("forker")}))
    if rng.random() < 0.5:
        actors.append(("pruner", "pruner", {"after_acks": rng.randint(1, 3), "future": rng.random() < 0.3,
                                            "start_when": done("forker")}))
    after = ("deleter", "pruner") if any(a[0] == "pruner" for a in actors) else ("deleter",)
    if rng.random() < 0.6:  # the parent's next run: its retention retires the fork point's row
        actors.append(("taker", "writer", {"kind": "run2", "start_when": done(*after)}))
        after = ("taker",)
    actors.append(("compactor", "compactor", {"rounds": 2, "grace": 0, "start_when": done(*after)}))
    actors.append(("resumer", "fork_resumer", {"start_when": done("compactor")}))
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done("resumer")}))


def _foreign(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    """A foreign Parquet file lands in the session's index partition mid-run: compaction and prune go on."""
    plan.rules = _noise(rng, rng.choice(["none", "low"]))
    actors.append(("holder", "writer", {"kind": "run"}))
    actors.append(("planter", "planter", {"where": rng.choice(["checkpoints", "checkpoints", "sessions"]),
                                          "start_when": at_step(rng.randint(3, 40))}))
    actors.append(("compactor", "compactor", {"rounds": rng.randint(2, 4)}))
    after = ("holder", "planter")
    if rng.random() < 0.5:
        actors.append(("pruner", "pruner", {"after_acks": 1, "start_when": done("holder", "planter")}))
        after = ("holder", "planter", "pruner")  # as in ``prune``: a reader is not promised a view mid-prune
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done(*after)}))


def _lease_corrupt(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any,
                   resume_or_run: Any) -> None:
    """``lease.json`` becomes unreadable mid-run: the run must not end ``completed``."""
    spec.batch = rng.choice([1, 2, 3, 16])
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("corrupter", "corrupter", {"start_when": both(at_step(rng.randint(8, 60)), acks_at_least(1))}))


def _control(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    """Budgets and pauses across runs, with checkpoints on and off, beside an ordinary run."""
    actors.append(("holder", "writer", {"kind": "run"}))
    actors.append(("budget", "controller", {"what": "budget", "checkpoint": rng.random() < 0.5}))
    actors.append(("pause", "controller", {"what": "pause", "checkpoint": rng.random() < 0.5}))


def _late_tombstones(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any,
                     resume_or_run: Any) -> None:
    """The holder's batch file (its rows and retention's tombstones, keep below the batch) is held after its
    lease proof passed while a taker claims the session, lists it and swaps the lease: the tombstones land
    after the takeover's listing (or before it, or after the swap), and no reader may honour a fenced writer's
    (storage.visibility rule 5): the checkpoints they name stay in every view, their objects readable."""
    spec.keep = rng.choice([1, 2, 3])
    spec.batch = rng.choice([4, 6])
    hold = rng.choice([15, 40, 80, 200])
    spec.notes.append(f"holder's index writes held {hold} steps")
    plan.rules = [Rule(Fault("delay", hold=hold), p=rng.choice([1.0, 1.0, 0.5]), actors=frozenset({"holder"}),
                       ops=frozenset({"put"}), key_contains="index/checkpoints/"),
                  *_noise(rng, rng.choice(["none", "none", "low"]))]
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "attempts": 1,
                                       "start_when": held("holder", "index/checkpoints/")}))
    if rng.random() < 0.5:
        actors.append(("compactor", "compactor", {"rounds": 2, "grace": 0, "start_when": done("holder", "taker")}))
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done("holder", "taker")}))


def held(name: str, key: str):
    """True while actor ``name`` is held in a delayed call on a key containing ``key``."""
    return lambda s: (a := s.actors.get(name)) is not None and a.hold > 0 and key in (a.waiting_on or "")


def both(*preds):
    return lambda s: all(p(s) for p in preds)


def stalled(name: str):
    return lambda s: name in s.world.stalled


def _explore(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any, resume_or_run: Any) -> None:
    """One exploration of the base session continued by id by three drivers in turn: the first two under
    storage noise, crash-stopped at a drawn call (most seeds); the third, fault-free, finishes it
    (:mod:`durability_explore`)."""
    drivers = frozenset({"explorer", "explorer2"})
    plan.rules = [dataclasses.replace(r, actors=drivers) for r in _noise(rng, rng.choice(["none", "low", "mid"]))]
    # Crash-stops where a decision meets its consequence: around a score's put (judged, score stored, branch
    # not yet recorded as done) and a model step's journal entry (called, journaled or not).
    plan.rules[:0] = [Rule(Fault("crash"), p=rng.choice([0.0, 0.3, 0.6]), actors=drivers, ops=frozenset({"put"}),
                           key_contains="-score-"),
                      Rule(Fault("crash"), p=rng.choice([0.0, 0.1]), actors=drivers, ops=frozenset({"put"}),
                           key_contains="-model")]
    actors.append(("holder", "writer", {"kind": "run"}))
    actors.append(("explorer", "explorer", {"start_when": done("holder")}))
    crash("explorer", 5, 500, p=0.9)
    actors.append(("explorer2", "explorer", {"start_when": done("explorer")}))
    crash("explorer2", 5, 300, p=0.5)
    actors.append(("explorer3", "explorer", {"start_when": done("explorer2")}))


def _prune_running(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any,
                   resume_or_run: Any) -> None:
    """The holder stalls inside a tool while other stores prune without ``before``: its session twice, or its
    session and then a finished fork of its newest checkpoint (whose pin on the holder's chain goes). The first
    prune deletes the run's records and keeps what the holder builds on next; when the holder goes on, every
    checkpoint it writes must read back whole (``chain-intact``)."""
    spec.batch = rng.choice([1, 4, 16])
    fork = rng.random() < 0.5
    waiters = ("forker", "pruner", "pruner2") if fork else ("pruner", "pruner2")
    n = rng.randint(1, spec.passes - 1)
    spec.stalls = {"holder": ("tool", n, 0.0, waiters)}
    spec.notes.append(f"holder stalls in its tool {n} while {', '.join(waiters)} run")
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    after = stalled("holder")
    if fork:
        actors.append(("forker", "forker", {"pick": "newest", "crash": False, "start_when": after}))
        after = done("forker")
    actors.append(("pruner", "pruner", {"whole": True, "start_when": after}))
    actors.append(("pruner2", "pruner", {"whole": True, "target": "fork" if fork else "session",
                                         "start_when": done("pruner")}))
    actors.append(("reader", "reader", {"rounds": 1, "start_when": done("holder")}))


def _zombie_read(spec: Spec, rng: random.Random, plan: FaultPlan, actors: list, crash: Any,
                 resume_or_run: Any) -> None:
    """``zombie`` with a cold reader racing the takeover: each read's parallel calls are served in a drawn order,
    other actors running between them (lease.json may be read before a LIST of its round, as on S3); in half the
    seeds the takers' kept lease copies are never written, so only lease.json fences the zombie's late objects."""
    plan.rules = _noise(rng, "low")
    if rng.random() < 0.5:
        plan.rules.insert(0, Rule(Fault("fail"), ops=frozenset({"put"}), actors=frozenset({"taker", "taker2"}),
                                  key_contains="/leases/"))
    crash("holder", 30, 120, p=0.2)
    takeover = rng.randint(2, 60)
    actors.append(("holder", "writer", {"kind": "run", "attempts": 1}))
    actors.append(("taker", "writer", {"kind": resume_or_run(), "start_when": at_step(takeover)}))
    actors.append(("reader", "reader", {"rounds": rng.randint(4, 8), "any_order": True,
                                        "start_when": at_step(max(1, takeover + rng.randint(-4, 8)))}))
    if rng.random() < 0.5:
        actors.append(("taker2", "writer", {"kind": "run", "start_when": done("holder", "taker")}))


BUILDERS.update({"zombie-pause": _zombie_pause, "pins": _pins, "foreign": _foreign, "lease-corrupt": _lease_corrupt,
                 "control": _control, "late-tombstones": _late_tombstones, "explore": _explore,
                 "prune-running": _prune_running, "zombie-read": _zombie_read})
