"""A seeded, deterministic scheduler that interleaves actors at storage-call granularity.

Each actor runs in its own thread. Every storage call an actor makes goes
through :class:`storage.faults.FaultyObjectStore`, whose ``gate`` parks the
calling thread here. Exactly one actor runs at a time: the scheduler waits
until the running actor parks at its next storage call (or finishes), then
lets one parked actor go, picked by a ``random.Random(seed)``. So a seed
fixes the order of every storage operation, and a failing seed replays.

Actors are named with :data:`storage.faults.current_actor`; ``asyncio.to_thread``
carries it into worker threads. A call from a thread without a name (a pool
thread inside the storage layer) belongs to the running actor: nobody else
can be making calls then.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from loomray.storage.faults import ActorCrashed, Call, current_actor


class StallError(RuntimeError):
    """The running actor neither made a storage call nor finished within the stall timeout."""


@dataclass
class _Actor:
    name: str
    fn: Callable[[], None]
    start_when: Callable[[Scheduler], bool] | None
    state: str = "new"  # new -> running <-> parked -> done
    hold: int = 0
    waiting_on: str = ""
    crashed: bool = False
    error: BaseException | None = None
    error_tb: str = ""
    thread: threading.Thread | None = None
    steps: int = 0


@dataclass
class Stall:
    actor: str
    stacks: str


class Scheduler:
    """Runs actors one storage call at a time, in an order chosen by ``seed``.

    ``add(name, fn, start_when=...)`` registers an actor; ``start_when(sched)``
    delays its start until it holds (e.g. "the holder is done", "after 40
    steps"). ``run()`` drives everything to completion and returns the stalls
    it had to break (an actor that blocked outside storage calls).
    """

    def __init__(self, seed: int, *, stall_timeout: float = 60.0) -> None:
        self.rng = random.Random(f"sched-{seed}")
        self.cv = threading.Condition()
        self.actors: dict[str, _Actor] = {}
        self.running: str | None = None
        self.steps = 0
        self.stall_timeout = stall_timeout
        self.stalls: list[Stall] = []
        #: (step, actor, what it was parked on) for every decision, for traces.
        self.trace: list[tuple[int, str, str]] = []
        self.on_stall: Callable[[str], None] | None = None

    # -- registration ------------------------------------------------------
    def add(self, name: str, fn: Callable[[], None], *, start_when: Callable[[Scheduler], bool] | None = None) -> None:
        if name in self.actors:
            raise ValueError(f"actor {name!r} exists")
        self.actors[name] = _Actor(name, fn, start_when)

    def done(self, name: str) -> bool:
        """True once actor ``name`` finished (normally, crashed or failed)."""
        a = self.actors.get(name)
        return a is not None and a.state == "done"

    # -- the storage gate ----------------------------------------------------
    def actor_of_call(self) -> str | None:
        """The actor a storage call belongs to: the context's name, else the running actor."""
        name = current_actor.get()
        return name if name is not None else self.running

    def gate(self, call: Call, hold: int) -> None:
        """Park the calling thread until the scheduler lets its actor run (``hold`` steps at least)."""
        name = call.actor
        with self.cv:
            a = self.actors.get(name) if name is not None else None
            if a is None:
                raise RuntimeError(f"storage call {call.op} {call.key!r} from outside any scheduled actor")
            a.state = "parked"
            a.hold = hold
            a.waiting_on = f"{call.op} {call.key}"
            if self.running == name:
                self.running = None
            self.cv.notify_all()
            while a.state != "running":
                self.cv.wait()

    def pause(self, steps: int) -> None:
        """Let other actors make at least ``steps`` storage calls before this one goes on (no call made)."""
        name = current_actor.get()
        if name is not None and steps > 0:
            self.gate(Call(0, name, 0, "pause", None), steps)

    # -- driving -------------------------------------------------------------
    def _main(self, a: _Actor) -> None:
        current_actor.set(a.name)
        try:
            with self.cv:
                while a.state != "running":
                    self.cv.wait()
            a.fn()
        except ActorCrashed:
            a.crashed = True
        except BaseException as e:  # reported by the harness as an actor error
            a.error = e
            a.error_tb = traceback.format_exc()
        finally:
            with self.cv:
                a.state = "done"
                if self.running == a.name:
                    self.running = None
                self.cv.notify_all()

    def run(self) -> list[Stall]:
        """Run every actor to its end; return the stalls that were broken."""
        for a in self.actors.values():
            a.thread = threading.Thread(target=self._main, args=(a,), name=f"actor-{a.name}", daemon=True)
            a.thread.start()
        while True:
            with self.cv:
                deadline = time.monotonic() + self.stall_timeout
                while self.running is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._break_stall(self.running)
                        break
                    self.cv.wait(timeout=min(left, 1.0))
                live = [a for a in self.actors.values() if a.state != "done"]
                if not live:
                    break
                eligible = [a for a in live if a.state == "parked"
                            or (a.state == "new" and (a.start_when is None or a.start_when(self)))]
                if not eligible:
                    # Only actors waiting for a start condition nobody can make true any more: start them.
                    eligible = [a for a in live if a.state == "new"]
                ready = [a for a in eligible if a.hold <= 0] or [min(eligible, key=lambda a: (a.hold, a.name))]
                ready.sort(key=lambda a: a.name)
                choice = self.rng.choice(ready)
                for a in eligible:
                    if a is not choice and a.hold > 0:
                        a.hold -= 1
                choice.hold = 0
                self.steps += 1
                choice.steps += 1
                self.trace.append((self.steps, choice.name, choice.waiting_on if choice.state == "parked" else "start"))
                choice.state = "running"
                self.running = choice.name
                self.cv.notify_all()
        for a in self.actors.values():
            if a.thread is not None:
                a.thread.join(timeout=5)
        return self.stalls

    def _break_stall(self, name: str) -> None:
        a = self.actors[name]
        frames = sys._current_frames()
        stacks = []
        for t in threading.enumerate():
            if t.name.startswith(f"actor-{name}") or t.name.startswith("asyncio_") or t.name.startswith("storage-"):
                f = frames.get(t.ident)  # type: ignore[arg-type]
                if f is not None:
                    stacks.append(f"--- {t.name}\n" + "".join(traceback.format_stack(f)))
        self.stalls.append(Stall(name, "\n".join(stacks)))
        if self.on_stall is not None:
            self.on_stall(name)  # e.g. crash-stop it in the store, so its next call ends it
        # Leave it behind: it is no longer scheduled and counts as done.
        a.state = "done"
        self.running = None
