"""The bound on session actors under construction at once (actor placement): who counts, who waits, who is let go.

No cluster: the bound reads ``ray.nodes()``-shaped entries from a function
the test passes, and the starts are plain coroutines holding a slot.
"""

import asyncio

import pytest

from loomray.runtime import start_slots
from loomray.runtime.start_slots import MIN_STARTS, STARTS_PER_CPU, StartSlots, constructed, starts_allowed

pytestmark = pytest.mark.timeout(60)

SESSION = {"loomray_session": 1.0}


def _node(cpus, alive=True, **resources):
    return {"Alive": alive, "Resources": {"CPU": float(cpus), **resources}}


def test_the_bound_counts_the_cpus_of_live_nodes_that_can_host_the_session_actor():
    nodes = [_node(2), _node(4, loomray_session=10), _node(8, loomray_session=10), _node(16, False, loomray_session=10)]
    assert starts_allowed(nodes, SESSION) == STARTS_PER_CPU * 12  # the head (no resource) and the dead node do not count
    assert starts_allowed(nodes, {}) == STARTS_PER_CPU * 14
    assert starts_allowed([], SESSION) == MIN_STARTS  # no node known yet: still some starts
    assert starts_allowed([_node(1, loomray_session=1)], SESSION) == MIN_STARTS


def test_no_more_starts_than_the_bound_run_at_once_and_every_one_runs():
    slots = StartSlots(nodes=lambda: [_node(2, loomray_session=1)])  # bound: 4
    limit = starts_allowed([_node(2, loomray_session=1)], SESSION)
    inside, most, done = 0, 0, []

    async def start(i):
        nonlocal inside, most
        async with slots.slot(SESSION):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0.01)
            inside -= 1
        done.append(i)

    async def main():
        await asyncio.gather(*(start(i) for i in range(limit * 3)))

    asyncio.run(main())
    assert most == limit
    assert sorted(done) == list(range(limit * 3))
    assert slots.waited == limit * 2
    assert slots.busy == 0


def test_a_start_that_fails_gives_its_slot_back():
    slots = StartSlots(nodes=lambda: [])

    async def failing():
        async with slots.slot(SESSION):
            raise RuntimeError("the actor could not be created")

    async def main():
        for _ in range(MIN_STARTS * 2):
            with pytest.raises(RuntimeError):
                await failing()
        async with slots.slot(SESSION):  # would wait forever had the failures kept their slots
            return slots.busy

    assert asyncio.run(main()) == 1


def test_a_node_that_joins_raises_the_bound_for_the_next_start(monkeypatch):
    monkeypatch.setattr(start_slots, "NODES_TTL_S", 0.0)
    nodes = []
    slots = StartSlots(nodes=lambda: list(nodes))

    async def main():
        release = asyncio.Event()
        entered = 0

        async def hold():
            nonlocal entered
            async with slots.slot(SESSION):
                entered += 1
                await release.wait()

        holders = [asyncio.create_task(hold()) for _ in range(MIN_STARTS + 1)]
        await asyncio.sleep(0.05)
        at_bound = entered  # one start waits for a slot
        nodes.append(_node(8, loomray_session=1))  # a node joins
        more = asyncio.create_task(hold())
        await asyncio.sleep(0.05)
        entered_after = entered  # the new start got in at once, while every holder still holds
        release.set()
        await asyncio.wait_for(asyncio.gather(*holders, more), 5)
        return at_bound, entered_after

    at_bound, entered_after = asyncio.run(main())
    assert at_bound == MIN_STARTS
    assert entered_after >= MIN_STARTS + 1


class _Handle:
    """A stand-in for an actor handle whose ``info`` answers as told."""

    def __init__(self, answer):
        self.info = self
        self._answer = answer

    def remote(self):
        return self._answer()


def test_constructed_waits_for_the_answer_but_never_longer_than_its_timeout_and_never_raises():
    async def never():
        await asyncio.Event().wait()

    async def dies():
        raise RuntimeError("actor died in its constructor")

    async def answers():
        return {"pid": 1}

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await constructed(_Handle(never), timeout=0.2)
        waited = loop.time() - t0
        await constructed(_Handle(dies), timeout=5)
        await constructed(_Handle(answers), timeout=5)
        return waited

    waited = asyncio.run(main())
    assert 0.2 <= waited < 2
