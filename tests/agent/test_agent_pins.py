"""Prune against pins held by running writers: a fork's pin on its parent's chain, on both sides of the pin.

A fork's checkpoints build on its parent's objects, which the fork's pin keeps
(docs/design.md "Checkpoints: incremental objects in chains"). Here another
store prunes while a run is held inside a tool (an Event), and after the run
goes on every checkpoint it wrote must load: the pruned session's running
writer builds on its head whatever retired it, and so must the pins that head
needs, in its own session and in the one it forked from. Once the runs are
over, pruning both sessions deletes every checkpoint object.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from agent_helpers import lookup, paused_gate

from loomray import Agent, CheckpointConfig, Tuning
from loomray.models import ScriptedModel
from loomray.storage import Store, layout

TUNING = Tuning(checkpoint=CheckpointConfig(position="after_tools"))


def steps(tool: str, n: int) -> list:
    return [{"tool": tool, "args": {"key": f"k{i}"}} for i in range(n)] + ["done"] * 8


def other_store(runtime) -> Store:
    """A second store on the runtime's bucket, as another process (an operator's ``loomray prune``) opens it."""
    return Store(runtime.store.objects, "pruner")


async def every_checkpoint_loads(agent: Agent, session_id: str) -> list[str]:
    """The listed ids of ``session_id``, after checking that each, and "latest" (the first), loads whole."""
    ids = [m.checkpoint_id for m in await agent.list_checkpoints(session_id, limit=1000)]
    assert ids, f"{session_id} lists no checkpoint"
    loaded = {c: await agent.get_checkpoint(session_id, c) for c in ids}
    assert all(ckpt is not None and ckpt.checkpoint_id == c for c, ckpt in loaded.items())
    latest = await agent.get_checkpoint(session_id)
    assert latest is not None and latest.checkpoint_id == ids[0]
    queried = other_store(agent.runtime).query(user_id=None, session_id=session_id)["checkpoint_id"].to_pylist()
    assert sorted(queried) == sorted(ids)
    return ids


def checkpoint_objects(runtime, session_id: str) -> list[str]:
    prefix = layout.session_prefix(session_id, None) + "checkpoints/"
    return [o.key for o in runtime.store.objects.list(prefix=prefix)]


@pytest.mark.parametrize("keep", [20, 1])
@pytest.mark.parametrize("before", [pytest.param(None, id="all"), pytest.param(timedelta(days=1), id="future")])
async def test_prune_of_a_running_fork_keeps_its_pin_on_a_pruned_parent(runtime_factory, before, keep):
    """P runs to the end; F forks from P's second checkpoint and is held in a tool after its first checkpoint.
    Another store prunes P (the fork's pin keeps the objects F builds on), then F itself (no ``before``: its
    rows go, the objects of the head F's writer builds on stay). F then goes on: its new checkpoints name P's
    objects in their chains, so F's pin on P must have stayed. On main the prune of F released it and deleted
    P's objects: every checkpoint F wrote after the prune failed to load. With ``before`` a day ahead (safe on
    main too) the prune of F spares its unfinished run's newest checkpoint, whose chain keeps the pin. With
    ``keep=1`` F's own retention runs beside the prune (its view of F is stale once the prune retired rows)."""
    runtime = runtime_factory()
    agent = Agent("", model=ScriptedModel(steps("lookup", 3)), tools=[lookup], runtime=runtime, tuning=TUNING)
    await agent.run("task", session_id="P")
    point = (await agent.list_checkpoints("P"))[-2].checkpoint_id
    gate, paused, release = paused_gate("k3")  # F's second tool call: F wrote one checkpoint
    forker = Agent("", model=ScriptedModel(steps("gate", 5)), tools=[gate],
                   runtime=runtime_factory(max_checkpoints_per_session=keep), tuning=TUNING)
    fork = asyncio.ensure_future(forker.fork("P", from_checkpoint=point, prompts=["branch"]))
    await asyncio.wait_for(paused.wait(), 30)
    [pin] = [o.key for o in runtime.store.objects.list(prefix=layout.pin_prefix("P", None))]
    fid = pin.rsplit("/", 1)[1].removesuffix(".json")
    pruner = other_store(runtime)
    cutoff = datetime.now(UTC) + before if before is not None else None
    assert pruner.prune(before=cutoff, session_id="P").checkpoints >= 3
    pruned = pruner.prune(before=cutoff, session_id=fid).checkpoints
    assert (pruned, len(await agent.list_checkpoints(fid))) == ((1, 0) if before is None else (0, 1))
    release.set()
    [done] = await asyncio.wait_for(fork, 30)
    assert done.output == "done"
    ids = await every_checkpoint_loads(forker, fid)
    assert (await forker.get_checkpoint(fid)).messages == done.messages
    # Both runs over: pruning F releases its pin, and P's objects it kept go with it.
    pruner.prune(session_id=fid)
    assert not checkpoint_objects(runtime, "P") and not checkpoint_objects(runtime, fid), ids
    assert not list(runtime.store.objects.list(prefix=layout.pin_prefix("P", None)))


async def test_prune_of_a_finished_fork_keeps_what_its_running_parent_builds_on(runtime):
    """P is held in a tool after two checkpoints; F forks from P's newest and finishes. Another store prunes P
    (no ``before``: P's rows go, its records too; the objects P's writer builds on stay) and then F, whose pin on
    P goes. P then goes on: its later checkpoints build on the objects F's pin held. On main releasing the pin
    collected them (P's retired head was not counted), so no checkpoint P wrote after the prunes loaded."""
    gate, paused, release = paused_gate("k2")
    agent = Agent("", model=ScriptedModel(steps("gate", 4)), tools=[gate], runtime=runtime, tuning=TUNING)
    parent = asyncio.ensure_future(agent.run("task", session_id="P"))
    await asyncio.wait_for(paused.wait(), 30)
    newest = (await agent.list_checkpoints("P"))[0].checkpoint_id
    forker = Agent("", model=ScriptedModel(["done"] * 4), tools=[lookup], runtime=runtime, tuning=TUNING)
    [fork] = await forker.fork("P", from_checkpoint=newest, prompts=["branch"])
    pruner = other_store(runtime)
    pruner.prune(session_id="P")
    pruner.prune(session_id=fork.session_id)
    assert runtime.store.objects.get(key=layout.pin_key("P", None, fork.session_id)) is None
    release.set()
    done = await asyncio.wait_for(parent, 30)
    assert done.output == "done"
    await every_checkpoint_loads(agent, "P")
    assert (await agent.get_checkpoint("P")).messages == done.messages
    more = await agent.run("and then?", session_id="P")
    assert more.messages[: len(done.messages)] == done.messages
    # The runs are over: a prune deletes every object and the pin that held some for P's writer.
    pruner.prune(session_id="P")
    assert not checkpoint_objects(runtime, "P")
    assert not list(runtime.store.objects.list(prefix=layout.pin_prefix("P", None)))


async def test_a_second_prune_of_a_running_session_keeps_what_the_first_kept_for_its_writer(runtime):
    """A run is held in a tool after two checkpoints; another store prunes the session twice (no ``before``).
    The first prune keeps the objects the run builds on next but deletes its run record and journal, so on
    main the second found no unfinished run, took those objects for orphans and deleted them: every checkpoint
    the run wrote afterwards failed to load. Once the run is over, a third prune deletes every object."""
    gate, paused, release = paused_gate("k2")
    agent = Agent("", model=ScriptedModel(steps("gate", 5)), tools=[gate], runtime=runtime, tuning=TUNING)
    run = asyncio.ensure_future(agent.run("task", session_id="s"))
    await asyncio.wait_for(paused.wait(), 30)
    pruner = other_store(runtime)
    pruner.prune(session_id="s")
    kept = checkpoint_objects(runtime, "s")
    assert kept
    pruner.prune(session_id="s")
    assert checkpoint_objects(runtime, "s") == kept
    release.set()
    done = await asyncio.wait_for(run, 30)
    await every_checkpoint_loads(agent, "s")
    assert (await agent.get_checkpoint("s")).messages == done.messages
    pruner.prune(session_id="s")
    assert not checkpoint_objects(runtime, "s")
    assert not list(runtime.store.objects.list(prefix=layout.pin_prefix("s", None)))
