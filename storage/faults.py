"""Fault injection for any :class:`~storage.objects.ObjectStore`: the storage half of the durability checker.

``FaultyObjectStore(inner, plan)`` wraps a backend, numbers every call in the
order it reaches the store, and logs it with its outcome and the keys it
wrote or deleted, so a checker can rebuild what happened in which order. A
:class:`FaultPlan` injects, at chosen call numbers or with a seeded
probability: ``fail`` (raise :class:`~storage.errors.TransientStorageError`
before the operation), ``drop`` (do it, then raise: the reply was lost),
``delay`` (park behind other actors' calls with a scheduler ``gate``, else
sleep briefly) or ``crash`` (raise :class:`ActorCrashed` and refuse every
later call of that actor, like a SIGKILL; whether the operation happened
first is a seeded coin unless the fault fixes it). Actors are named by the
:data:`current_actor` context variable or an ``actor`` callable.
"""

from __future__ import annotations

import builtins
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .errors import PreconditionFailed, TransientStorageError
from .objects import ObjectInfo, ObjectStore, StoredObject

#: Call kinds, in the order of the :class:`ObjectStore` interface.
OPS = ("put", "get", "list", "list_dirs", "delete")
#: Fault kinds a plan can inject.
FAULT_KINDS = ("fail", "drop", "delay", "crash")

#: The actor a storage call belongs to (a name); ``None`` outside any actor.
current_actor: ContextVar[str | None] = ContextVar("storage_faults_actor", default=None)


class ActorCrashed(BaseException):
    """The calling actor was crash-stopped (injected). A ``BaseException`` so no ordinary handler catches it."""


@dataclass(frozen=True)
class Fault:
    """One injected fault.

    ``hold`` is how long a ``delay`` lasts: scheduler steps with a gate,
    milliseconds without one. ``applied`` fixes whether a ``crash`` happens
    after the operation (True) or before it (False); ``None`` tosses the plan's
    seeded coin.
    """

    kind: str
    hold: int = 3
    applied: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")


@dataclass(frozen=True)
class Rule:
    """Inject ``fault`` with probability ``p`` into matching calls.

    A call matches when every given filter does: ``ops`` (call kinds),
    ``actors``, ``key_contains`` (a substring of the key or prefix), and the
    actor's own call numbers ``first`` .. ``last`` (inclusive, 1-based).
    """

    fault: Fault
    p: float = 1.0
    ops: frozenset[str] | None = None
    actors: frozenset[str] | None = None
    key_contains: str | None = None
    first: int | None = None
    last: int | None = None

    def matches(self, call: Call) -> bool:
        return ((self.ops is None or call.op in self.ops)
                and (self.actors is None or call.actor in self.actors)
                and (self.key_contains is None or self.key_contains in (call.key or ""))
                and (self.first is None or call.actor_n >= self.first)
                and (self.last is None or call.actor_n <= self.last))


@dataclass
class FaultPlan:
    """What to inject where. Exact points win over rules; the first matching rule that fires wins.

    ``at``: global call number -> fault. ``by_actor``: ``(actor, n)`` -> fault
    for that actor's n-th call. ``rules``: probabilistic faults, drawn from a
    ``random.Random(seed)`` in call order (deterministic when calls are serialized).
    """

    seed: int = 0
    at: dict[int, Fault] = field(default_factory=dict)
    by_actor: dict[tuple[str, int], Fault] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)


@dataclass
class Call:
    """One numbered storage call and what became of it.

    ``outcome``: "ok", "missing" (a get of an absent key), "precondition"
    (a conditional put lost), "error" (the backend raised), "failed" (injected
    before the operation), "dropped" (done, then the reply was lost),
    "crashed" (the actor died; ``applied`` says whether the operation happened).
    """

    n: int
    actor: str | None
    actor_n: int
    op: str
    key: str | None
    keys: tuple[str, ...] = ()
    data: bytes | None = None
    if_none_match: bool = False
    if_match: str | None = None
    fault: str | None = None
    outcome: str = "pending"
    applied: bool = False
    error: str | None = None


Gate = Callable[[Call, int], None]


class FaultyObjectStore(ObjectStore):
    """An :class:`ObjectStore` that injects faults from a :class:`FaultPlan` and logs every call.

    ``gate(call, hold)``, when given, is called before each operation (``hold``
    is 0) and again for a ``delay`` (``hold`` > 0): a scheduler parks the
    calling thread there until it lets that actor proceed. Calls are numbered
    when they leave the gate, so with a scheduler the numbers are the order in
    which the operations ran. ``actor()`` names the calling actor (default:
    :data:`current_actor`). ``keep_data(key)`` says which written bytes to keep
    in the log (default: all).
    """

    def __init__(self, inner: ObjectStore, plan: FaultPlan | None = None, *, gate: Gate | None = None,
                 actor: Callable[[], str | None] | None = None,
                 keep_data: Callable[[str], bool] | None = None) -> None:
        self.inner = inner
        self.plan = plan or FaultPlan()
        self.backend = inner.backend
        self.gate = gate
        self._actor = actor or current_actor.get
        self._keep_data = keep_data or (lambda key: True)
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self._n = 0
        self._actor_n: Counter[str | None] = Counter()
        #: Every call, in number order.
        self.calls: list[Call] = []
        #: Calls per kind ("put", "get", ...).
        self.counts: Counter[str] = Counter()
        #: Injected faults per kind ("fail", "drop", "delay", "crash").
        self.injected: Counter[str] = Counter()
        #: Every key a put was attempted on, and every key a delete named, in call order.
        self.written: list[str] = []
        self.deleted: list[str] = []
        #: Actors that were crash-stopped.
        self.dead: set[str | None] = set()

    # -- actors ------------------------------------------------------------
    def kill(self, actor: str | None) -> None:
        """Crash-stop ``actor``: every later call it makes raises :class:`ActorCrashed`."""
        with self._lock:
            self.dead.add(actor)

    def check_alive(self, actor: str | None) -> None:
        """Raise :class:`ActorCrashed` if ``actor`` was crash-stopped (for non-storage work, e.g. a tool)."""
        if actor in self.dead:
            raise ActorCrashed(f"actor {actor!r} was crash-stopped")

    @property
    def call_count(self) -> int:
        """Calls numbered so far (the number of the latest call)."""
        return self._n

    # -- the call path -----------------------------------------------------
    def _call(self, op: str, key: str | None, do: Callable[[], Any], *, keys: tuple[str, ...] = (),
              data: bytes | None = None, if_none_match: bool = False, if_match: str | None = None) -> Any:
        actor = self._actor()
        self.check_alive(actor)
        call, fault, crash_after = self._admit(Call(0, actor, 0, op, key, keys=keys, data=data,
                                                    if_none_match=if_none_match, if_match=if_match))
        if fault is not None and fault.kind == "delay":  # no gate: hold the call for a moment
            time.sleep(fault.hold / 1000)
        if fault is not None and fault.kind == "fail":
            call.outcome = "failed"
            raise TransientStorageError(f"{self.describe(key)}: injected {op} failure (call {call.n})")
        if fault is not None and fault.kind == "crash" and not crash_after:
            return self._crash(call)
        crashing = fault is not None and fault.kind == "crash"
        try:
            result = do()
        except PreconditionFailed as e:
            call.outcome, call.error = "precondition", str(e)
            if crashing:
                return self._crash(call)
            raise
        except Exception as e:
            call.outcome, call.error = "error", f"{type(e).__name__}: {e}"
            if crashing:
                return self._crash(call)
            raise
        call.applied = op in ("put", "delete")
        call.outcome = "missing" if op == "get" and result is None else "ok"
        if crashing:
            return self._crash(call, applied=call.applied)
        if fault is not None and fault.kind == "drop":
            call.outcome = "dropped"
            raise TransientStorageError(f"{self.describe(key)}: injected {op} reply loss after the "
                                        f"operation (call {call.n})")
        return result

    def _admit(self, asked: Call) -> tuple[Call, Fault | None, bool]:
        """Pass ``asked`` through the gate, number and log it, and choose its fault: ``(call, fault, whether a
        crash comes after the operation)``. A ``delay`` with a gate parks the call again behind other actors'
        calls (it is numbered when it really runs) and is not returned."""
        actor, hold, delayed = asked.actor, 0, False
        while True:
            if self.gate is not None:
                self.gate(Call(0, actor, 0, asked.op, asked.key), hold)
                self.check_alive(actor)  # killed while parked
            with self._lock:
                call = Call(self._n + 1, actor, self._actor_n[actor] + 1, asked.op, asked.key, keys=asked.keys,
                            data=asked.data if asked.data is not None and asked.key is not None
                            and self._keep_data(asked.key) else None,
                            if_none_match=asked.if_none_match, if_match=asked.if_match)
                fault = self._choose(call)
                if fault is not None and fault.kind == "delay" and not delayed and self.gate is not None:
                    # Park again behind other actors' calls; the number is taken when the call really runs.
                    self.injected["delay"] += 1
                    delayed, hold = True, max(1, fault.hold)
                    continue
                self._log(call)
                if delayed:
                    call.fault = "delay"
                    fault = None if fault is not None and fault.kind == "delay" else fault
                crash_after = False
                if fault is not None:
                    call.fault = fault.kind
                    self.injected[fault.kind] += 1
                    if fault.kind == "crash":
                        crash_after = fault.applied if fault.applied is not None else self._rng.random() < 0.5
                return call, fault, crash_after

    def _log(self, call: Call) -> None:
        """Number ``call`` and record it (under the lock)."""
        self._n += 1
        self._actor_n[call.actor] += 1
        self.calls.append(call)
        self.counts[call.op] += 1
        if call.op == "put" and call.key is not None:
            self.written.append(call.key)
        elif call.op == "delete":
            self.deleted.extend(call.keys)

    def _crash(self, call: Call, applied: bool = False) -> Any:
        call.outcome, call.applied = "crashed", applied
        self.kill(call.actor)
        raise ActorCrashed(f"actor {call.actor!r} crash-stopped at storage call {call.n} ({call.op} "
                           f"{call.key!r}, operation {'done' if applied else 'not done'})")

    def _choose(self, call: Call) -> Fault | None:
        plan = self.plan
        fault = plan.at.get(call.n) or plan.by_actor.get((call.actor, call.actor_n))  # type: ignore[arg-type]
        if fault is not None:
            return fault
        for rule in plan.rules:
            if rule.matches(call) and (rule.p >= 1.0 or self._rng.random() < rule.p):
                return rule.fault
        return None

    # -- ObjectStore -------------------------------------------------------
    def put(self, *, key: str, data: bytes, if_none_match: bool = False, if_match: str | None = None) -> str:
        data = bytes(data)
        return self._call("put", key, lambda: self.inner.put(key=key, data=data, if_none_match=if_none_match,
                                                              if_match=if_match),
                          data=data, if_none_match=if_none_match, if_match=if_match)

    def get(self, *, key: str) -> StoredObject | None:
        return self._call("get", key, lambda: self.inner.get(key=key))

    def list(self, *, prefix: str) -> Iterator[ObjectInfo]:
        # Materialized inside the call, so the whole listing is one numbered call.
        return iter(self._call("list", prefix, lambda: list(self.inner.list(prefix=prefix))))

    def list_dirs(self, *, prefix: str) -> builtins.list[str]:
        return self._call("list_dirs", prefix, lambda: self.inner.list_dirs(prefix=prefix))

    def delete(self, *, keys: builtins.list[str]) -> None:
        keys = list(keys)
        return self._call("delete", keys[0] if keys else None, lambda: self.inner.delete(keys=keys), keys=tuple(keys))

    def describe(self, key: str | None = None) -> str:
        return self.inner.describe(key)

    def fsspec(self) -> tuple[Any, str]:
        return self.inner.fsspec()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # Backend attributes (a local root, an S3 bucket or client) stay reachable through the wrapper.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


__all__ = ["FAULT_KINDS", "OPS", "ActorCrashed", "Call", "Fault", "FaultPlan", "FaultyObjectStore", "Rule",
           "current_actor"]
