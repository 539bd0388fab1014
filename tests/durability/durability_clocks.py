"""The clocks of a durability world: actors' skewed wall clocks (the ids they make) and the runs' lease-proof
clock, which a stalled model call moves on (see ``Spec.skews`` and ``Spec.stalls``)."""

from __future__ import annotations

import os
import time
from typing import Any


class _ShiftedTime:
    """``time`` as the runs' lease-proof clock sees it: ``monotonic()`` is ahead by the world's clock shift."""

    def __init__(self, world: Any) -> None:
        self.world = world

    def monotonic(self) -> float:
        return time.monotonic() + self.world.clock_shift

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def run_with_clocks(world: Any) -> None:
    """Run the world's scheduler with the runs' proof clock shifted and, if the spec says so, skewed id clocks."""
    import loomray.records
    import loomray.run_writes
    import loomray.session

    saved_time = loomray.run_writes.time
    loomray.run_writes.time = _ShiftedTime(world)  # type: ignore[assignment]
    saved = loomray.session.new_id, loomray.records.new_id, loomray.session.new_segment
    if world.spec.skews:
        loomray.session.new_id = loomray.records.new_id = lambda prefix: _skewed_new_id(world, prefix)
        loomray.session.new_segment = lambda: _skewed_new_segment(world)
    try:
        world.sched.run()
    finally:
        loomray.run_writes.time = saved_time
        loomray.session.new_id, loomray.records.new_id, loomray.session.new_segment = saved


def _skewed_tick(world: Any) -> tuple[int, int]:
    actor = world.sched.actor_of_call()
    ms = time.time_ns() // 1_000_000 + int(world.spec.skews.get(actor or "", 0) * 1000)
    last = world.clocks.get(actor, (0, 0))
    counter = last[1] + 1 if ms <= last[0] else 0
    ms = max(ms, last[0])
    world.clocks[actor] = (ms, counter)
    return ms, counter


def _skewed_new_id(world: Any, prefix: str) -> str:
    """``loomray.ids.new_id`` on the calling actor's own (skewed) clock, each actor monotonic on its own."""
    ms, counter = _skewed_tick(world)
    return f"{prefix}{ms:012x}{counter:04x}{os.urandom(5).hex()}"


def _skewed_new_segment(world: Any) -> str:
    """``loomray.ids.new_segment`` on the calling actor's skewed clock."""
    ms, counter = _skewed_tick(world)
    return f"ckpt{ms:012x}{counter:04x}{os.urandom(2).hex()}"
