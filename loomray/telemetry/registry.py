"""The observer registry: who gets each run's events in this process, and what the events do not carry."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, TypeVar

from loomray.events import Event


@dataclass(frozen=True)
class RunInfo:
    """What the events do not carry: which agent, model and lease epoch the run executes under."""

    agent_name: str | None = None
    model: str | None = None
    provider: str | None = None
    epoch: int | None = None
    node_id: str | None = None
    #: The URL of the store the run writes to (the ``store`` label of every metric).
    store: str | None = None
    #: The host the model's API is called at (``server.address``), when the model names one.
    server_address: str | None = None


class Observer(Protocol):
    """Anything with ``on_event(event, info)``; called synchronously, in event order, per run."""

    def on_event(self, event: Event, info: RunInfo) -> None: ...


ObserverT = TypeVar("ObserverT", bound=Observer)

#: Registered observers (copy-on-write: :func:`observers` hands out a snapshot without a lock).
_observers: tuple[Observer, ...] = ()
_lock = threading.Lock()


def add_observer(observer: ObserverT) -> ObserverT:
    """Register ``observer`` for every run executed in this process; returns it."""
    global _observers
    with _lock:
        if observer not in _observers:
            _observers = (*_observers, observer)
    return observer


def remove_observer(observer: Observer) -> None:
    """Unregister ``observer`` (no error if it was not registered)."""
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)


def observers() -> tuple[Observer, ...]:
    """The observers registered in this process."""
    return _observers
