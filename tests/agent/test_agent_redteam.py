"""Red team for issue 22 ("one history for every reader"), through ``loomray.Agent`` on a local directory.

Actors: a zombie paused inside a tool while another Agent takes the session
over and an operator prunes or deletes; a fork whose fork point the parent's
owner deletes; another user on the same store reading and forking across
tenants. After each attack every view (the Agent's list, "latest" and get by
id, ``Store.query`` and the compacted table from a cold store, a fork from a
listed checkpoint) must show one history. A test marked ``xfail(strict=True)``
is a break the red team found and left for the lead to fix (docs/red-team.md).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from agent_helpers import Crash, crash_at, lookup, paused_gate

from loomray import Agent, CheckpointConfig, Tuning
from loomray.errors import CheckpointNotFound
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage import layout, open_store
from loomray.storage.errors import LeaseLostError

TUNING = Tuning(checkpoint=CheckpointConfig(position="after_tools"))


def script(n: int = 4) -> list:
    return [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n)] + ["done"] * 8


async def views(agent: Agent, root: Path, session_id: str, user_id: str | None = None) -> dict[str, list[str]]:
    """The session's checkpoint ids as every reader sees them (list, get by id, "latest", query, table)."""
    listed = [m.checkpoint_id for m in await agent.list_checkpoints(session_id, limit=1000, user_id=user_id)]
    got = [c for c in listed if await agent.get_checkpoint(session_id, c, user_id=user_id) is not None]
    latest = await agent.get_checkpoint(session_id, user_id=user_id)
    cold = open_store(root)
    query = cold.query(user_id=user_id, session_id=session_id)["checkpoint_id"].to_pylist()
    cold.compact(tombstone_grace=timedelta(0))
    table = cold.query(user_id=user_id, session_id=session_id)["checkpoint_id"].to_pylist()
    cold.close()
    return {"list": sorted(listed), "get": sorted(got), "query": sorted(query), "table": sorted(table),
            "latest": [latest.checkpoint_id] if latest is not None else []}


def loomray_query(root: Path, session_id: str) -> list[dict]:
    """``loomray query --session SESSION --json`` on the store at ``root``, as a user types it."""
    import json
    import os

    from forked import run_loomray

    env = {k: v for k, v in os.environ.items() if k not in ("LOOMRAY_STORE", "RAY_ADDRESS")}
    out = run_loomray(["query", "--session", session_id, "--limit", "1000", "--json"],
                      env={**env, "LOOMRAY_STORE": str(root)}, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def same(ids: list[str], latest: str | None) -> dict[str, list[str]]:
    return {**dict.fromkeys(["list", "get", "query", "table"], sorted(ids)), "latest": [latest] if latest else []}


async def test_a_zombie_that_wakes_after_a_takeover_and_a_prune_shows_nothing(tmp_path):
    """A is paused inside a tool; B takes the session over, finishes, and the session is pruned. A wakes and
    checkpoints its pass: it is fenced, and every view stays empty (no zombie object reads as a tail)."""
    gate, paused, release = paused_gate()

    steps = [{"tool": "gate", "args": {"key": f"k{i}"}} for i in range(4)] + ["done"]
    root = tmp_path / "d"
    rt_a, rt_b = LocalRuntime(root), LocalRuntime(root)
    a = Agent("", model=ScriptedModel(steps), tools=[gate], runtime=rt_a, tuning=TUNING)
    b = Agent("", model=ScriptedModel(steps), tools=[gate], runtime=rt_b, tuning=TUNING)
    zombie = asyncio.ensure_future(a.run("task", session_id="s"))
    await asyncio.wait_for(paused.wait(), 30)
    assert (await b.run("task", session_id="s")).output == "done"
    open_store(root).prune(session_id="s")
    assert await views(b, root, "s") == same([], None)
    release.set()
    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(zombie, 30)
    assert await views(b, root, "s") == same([], None)
    rt_a.close()
    rt_b.close()


async def test_another_user_never_sees_nor_forks_from_a_session_of_the_same_id(tmp_path):
    """alice and bob each have a session "s" on one store. Nothing of alice's is in any of bob's views, bob
    cannot get, resume or fork from alice's checkpoint ids, and bob's prune leaves alice's history whole."""
    root = tmp_path / "d"
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(script()), tools=[lookup], runtime=runtime, tuning=TUNING)
    await agent.run("task", session_id="s", user_id="alice")
    await agent.run("task", session_id="s", user_id="bob")
    alice = [m.checkpoint_id for m in await agent.list_checkpoints("s", user_id="alice")]
    bob = [m.checkpoint_id for m in await agent.list_checkpoints("s", user_id="bob")]
    assert alice and bob and not set(alice) & set(bob)
    assert await views(agent, root, "s", "bob") == same(bob, bob[0])
    assert await agent.get_checkpoint("s", alice[-1], user_id="bob") is None
    with pytest.raises(CheckpointNotFound):
        await agent.resume("steal", session_id="s", from_checkpoint=alice[-1], user_id="bob")
    with pytest.raises(CheckpointNotFound):
        await agent.fork("s", from_checkpoint=alice[-1], prompts=["steal"], user_id="bob")
    open_store(root).prune(session_id="s", user_id="bob")
    assert await views(agent, root, "s", "alice") == same(alice, alice[0])
    assert await views(agent, root, "s", "bob") == same([], None)
    runtime.close()


async def test_a_fork_resumes_after_the_parents_owner_deleted_its_fork_point(tmp_path):
    """A fork crashes before its first checkpoint; the parent's owner then deletes the fork point with
    ``delete_checkpoint`` (not retention). The fork's pin keeps the object, and the fork resumes from it; for
    everyone else the checkpoint is gone (not listed, not found, no new fork from it)."""
    root = tmp_path / "d"
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(script()), tools=[lookup], runtime=runtime, tuning=TUNING)
    await agent.run("task", session_id="orig")
    metas = await agent.list_checkpoints("orig")
    point = metas[2]
    base = await agent.get_checkpoint("orig", point.checkpoint_id)
    with pytest.raises(Crash):
        await agent.resume("another way", session_id="orig", from_checkpoint=point.checkpoint_id,
                           emit=crash_at("model_call", 1))
    pins = [o.key for o in runtime.store.objects.list(prefix=layout.pin_prefix("orig", None))]
    fork_id = pins[0].rsplit("/", 1)[1].removesuffix(".json")
    assert open_store(root).checkpoints.delete("orig", point.checkpoint_id)
    rest = [m.checkpoint_id for m in metas if m.checkpoint_id != point.checkpoint_id]
    assert await views(agent, root, "orig") == same(rest, metas[0].checkpoint_id)
    with pytest.raises(CheckpointNotFound):
        await agent.resume("again", session_id="orig", from_checkpoint=point.checkpoint_id)
    result = await agent.resume(session_id=fork_id)
    assert result.forked_from == "orig" and result.messages[: len(base.messages)] == base.messages
    runtime.close()


async def test_a_fork_from_every_listed_checkpoint_restores_that_checkpoint(tmp_path):
    """After retention (keep 3) and a delete in the middle, a fork from each listed checkpoint restores exactly
    that checkpoint's transcript: the list names nothing a fork cannot start from."""
    root = tmp_path / "d"
    runtime = LocalRuntime(root, max_checkpoints_per_session=3)
    agent = Agent("", model=ScriptedModel(script(6)), tools=[lookup], runtime=runtime, tuning=TUNING)
    await agent.run("task", session_id="s")
    metas = await agent.list_checkpoints("s")
    assert len(metas) == 3
    assert runtime.store.checkpoints.delete("s", metas[1].checkpoint_id)
    left = [m.checkpoint_id for m in metas if m.checkpoint_id != metas[1].checkpoint_id]
    assert await views(agent, root, "s") == same(left, left[0])
    for cid in left[1:]:  # the newest continues in place; the others fork
        ckpt = await agent.get_checkpoint("s", cid)
        [fork] = await agent.fork("s", from_checkpoint=cid, prompts=[None])
        assert fork.forked_from == "s" and fork.messages[: len(ckpt.messages)] == ckpt.messages
    runtime.close()


async def paused_run(root: Path, maintain) -> tuple[Agent, LocalRuntime]:
    """A run paused inside its third tool (two after-tools checkpoints written, incremental ones building on the
    first); ``maintain(store)`` runs from another store meanwhile; then the run finishes."""
    paused, release = asyncio.Event(), asyncio.Event()

    async def gate(key: str) -> str:
        """Look something up, slowly for k2."""
        if key == "k2":
            paused.set()
            await release.wait()
        return f"value of {key}"

    steps = [{"tool": "gate", "args": {"key": f"k{i}"}} for i in range(5)] + ["done"]
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(steps), tools=[gate], runtime=runtime, tuning=TUNING)
    running = asyncio.ensure_future(agent.run("task", session_id="s"))
    await asyncio.wait_for(paused.wait(), 30)
    other = open_store(root)
    maintain(other)
    other.close()
    release.set()
    assert (await asyncio.wait_for(running, 30)).output == "done"
    return agent, runtime


async def test_delete_of_a_running_sessions_checkpoint_leaves_its_later_checkpoints_readable(tmp_path):
    """While a run is paused in a tool, the owner deletes the run's newest acknowledged checkpoint (``loomray
    delete`` from another store). The checkpoints the run writes after it must be readable in every view.

    They are not: the delete collected the object (no live row or tail needed it yet), and the run's later
    checkpoints name it in their chain. The list and ``Store.query`` show them, get by id raises
    ``CheckpointException``, "latest" falls back to the run's first checkpoint with a warning, and the next
    ``run`` continues from there: the rest of the run's work is lost."""
    root = tmp_path / "d"
    deleted: list[str] = []

    def delete_newest(store):
        newest = store.checkpoints.list("s")[0].checkpoint_id
        assert store.checkpoints.delete("s", newest)
        deleted.append(newest)

    agent, runtime = await paused_run(root, delete_newest)
    metas = await agent.list_checkpoints("s")
    ids = [m.checkpoint_id for m in metas]
    assert deleted[0] not in ids and len(ids) >= 3
    assert await views(agent, root, "s") == same(ids, ids[0])
    runtime.close()


@pytest.mark.parametrize("before", [
    pytest.param(None, id="all"),
    pytest.param(datetime.now(UTC) + timedelta(days=1), id="before-future")])
async def test_prune_of_a_running_session_leaves_its_later_checkpoints_readable(tmp_path, before):
    """While a run is paused in a tool, ``prune(session_id=...)`` removes the session's checkpoints. The run then
    writes more: whatever every view shows of them, it shows the same, and the list's head is "latest".

    With ``before`` the run's newest checkpoint and its chain stay, and this holds. Without it (``all``) every
    object goes, the run's later checkpoints name pruned objects in their chain: listed and queried, but get
    by id and "latest" raise ``CheckpointException``, and so does the session's next ``run``."""
    root = tmp_path / "d"
    agent, runtime = await paused_run(root, lambda store: store.prune(before=before, session_id="s"))
    ids = [m.checkpoint_id for m in await agent.list_checkpoints("s")]
    assert ids, "the run's checkpoints after the prune are gone"
    assert await views(agent, root, "s") == same(ids, ids[0])
    runtime.close()


def _child(d: Path, kill: str):
    """``crash_child.py`` on ``d/store``, session ``sess-crash``, after-tools checkpoints, killed by a real SIGKILL
    at ``kill`` (empty: runs to the end, recovering what an earlier process left)."""
    import os

    from crash_procs import run_child

    env = {**os.environ, "CRASH_POSITION": "after_tools", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return run_child([str(d), "sess-crash", str(d / "out.json"), kill], env, d / f"child-{kill or 'end'}.log"
                     .replace(":", "-"))


@pytest.mark.parametrize("op", ["delete-newest", "prune-before-future"])
async def test_maintenance_after_a_sigkill_then_recovery_agree(tmp_path, op):
    """A real process dies by SIGKILL inside its 4th tool: its three after-tools checkpoints are objects no index
    row names yet (a tail). The owner then deletes the newest one listed, or prunes the session with a
    ``before`` in the future (which keeps what recovery of the unfinished run needs). A second process then
    recovers the run. Every view agrees, the deleted checkpoint never comes back, and the run completes."""
    import signal

    d = tmp_path / "p"
    d.mkdir()
    first = _child(d, "tool:4")
    assert first.returncode == -signal.SIGKILL, first.stderr
    root = d / "store"
    store = open_store(root)
    listed = [r.checkpoint_id for r in store.checkpoints.list("sess-crash")]
    assert len(listed) == 3 and len(store.query(user_id=None, session_id="sess-crash")) < 3  # a tail
    if op == "delete-newest":
        assert store.checkpoints.delete("sess-crash", listed[0])
    else:
        store.prune(before=datetime.now(UTC) + timedelta(days=1), session_id="sess-crash")
    store.close()
    second = _child(d, "")
    assert second.returncode == 0, second.stderr
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(["unused"]), runtime=runtime)
    ids = [m.checkpoint_id for m in await agent.list_checkpoints("sess-crash", limit=1000)]
    assert await views(agent, root, "sess-crash") == same(ids, ids[0])
    if op == "delete-newest":
        assert listed[0] not in ids
    runtime.close()


async def test_forks_of_forks_stay_readable_after_their_ancestors_are_pruned(tmp_path):
    """P runs; F1 forks from P's second checkpoint and runs; F2 forks from F1's newest. Then P and F1 are pruned
    whole (no ``before``). F2's pins keep every object its chain names in P and F1: every view of F2 agrees, each
    listed checkpoint loads, and F2 goes on from its latest."""
    root = tmp_path / "d"
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(script(3)), tools=[lookup], runtime=runtime, tuning=TUNING)
    await agent.run("task", session_id="P")
    p_metas = await agent.list_checkpoints("P")
    [f1] = await agent.fork("P", from_checkpoint=p_metas[-2].checkpoint_id, prompts=["branch one"])
    f1_newest = (await agent.list_checkpoints(f1.session_id))[0].checkpoint_id
    [f2] = await agent.fork(f1.session_id, from_checkpoint=f1_newest, prompts=["branch two"])
    before = [m.checkpoint_id for m in await agent.list_checkpoints(f2.session_id)]
    assert before
    pruner = open_store(root)
    pruner.prune(session_id="P")
    pruner.prune(session_id=f1.session_id)
    pruner.close()
    assert await views(agent, root, "P") == same([], None)
    assert await views(agent, root, f2.session_id) == same(before, before[0])
    more = await agent.run("and then?", session_id=f2.session_id)
    assert more.messages[: len(f2.messages)] == f2.messages
    runtime.close()


async def test_two_zombies_and_a_third_owner_with_retention_leave_one_readable_history(tmp_path):
    """A is paused in a tool; B takes over and is paused in a later tool; C takes over and finishes, with
    retention keeping 3 (C's chain builds on A's and B's objects). Then B and A wake, in that order, and are
    fenced. Every view agrees on C's last 3 checkpoints, each loads, and a fork from the oldest restores it."""
    gates = {"k1": asyncio.Event(), "k3": asyncio.Event()}
    released = {k: asyncio.Event() for k in gates}
    seen: dict[str, int] = {}

    async def gate(key: str) -> str:
        """Look something up; the first call for k1 and for k3 waits to be released."""
        seen[key] = seen.get(key, 0) + 1
        if key in gates and seen[key] == 1:
            gates[key].set()
            await released[key].wait()
        return f"value of {key}"

    steps = [{"tool": "gate", "args": {"key": f"k{i}"}} for i in range(6)] + ["done"] * 4
    root = tmp_path / "d"
    runtimes = [LocalRuntime(root, max_checkpoints_per_session=3) for _ in range(3)]
    a, b, c = (Agent("", model=ScriptedModel(steps), tools=[gate], runtime=rt, tuning=TUNING) for rt in runtimes)
    run_a = asyncio.ensure_future(a.run("task", session_id="s"))
    await asyncio.wait_for(gates["k1"].wait(), 30)
    run_b = asyncio.ensure_future(b.run("task", session_id="s"))
    await asyncio.wait_for(gates["k3"].wait(), 30)
    assert (await c.run("task", session_id="s")).output == "done"
    for key, run in (("k3", run_b), ("k1", run_a)):
        released[key].set()
        with pytest.raises(LeaseLostError):
            await asyncio.wait_for(run, 30)
    ids = [m.checkpoint_id for m in await c.list_checkpoints("s")]
    assert len(ids) == 3
    assert await views(c, root, "s") == same(ids, ids[0])
    assert sorted(r["checkpoint_id"] for r in loomray_query(root, "s")) == sorted(ids)
    oldest = await c.get_checkpoint("s", ids[-1])
    [fork] = await c.fork("s", from_checkpoint=ids[-1], prompts=[None])
    assert fork.messages[: len(oldest.messages)] == oldest.messages
    for rt in runtimes:
        rt.close()


@pytest.mark.parametrize("then", ["bare-takeover", "recovery"])
async def test_a_fork_from_a_dead_writers_tail_resumes_after_a_takeover(tmp_path, then):
    """A process dies by SIGKILL with three unindexed checkpoints (a tail); a user forks from the oldest listed
    one, and the fork crashes before its first checkpoint. Then the parent session is taken over: by a bare
    lease acquire (``loomray lease repair``, an adopting supervisor) or by a recovery run in a new process.
    The fork's pin holds its fork point, so the fork resumes from it (rule 4)."""
    import signal

    d = tmp_path / "p"
    d.mkdir()
    assert _child(d, "tool:4").returncode == -signal.SIGKILL
    root = d / "store"
    runtime = LocalRuntime(root)
    agent = Agent("", model=ScriptedModel(["fork done"] * 4), runtime=runtime, tuning=TUNING)
    point = (await agent.list_checkpoints("sess-crash"))[-1].checkpoint_id
    assert point not in runtime.store.query(user_id=None, session_id="sess-crash")["checkpoint_id"].to_pylist()
    base = await agent.get_checkpoint("sess-crash", point)
    with pytest.raises(Crash):
        await agent.resume("fork here", session_id="sess-crash", from_checkpoint=point,
                           emit=crash_at("model_call", 1))
    pins = [o.key for o in runtime.store.objects.list(prefix=layout.pin_prefix("sess-crash", None))]
    fork_id = pins[0].rsplit("/", 1)[1].removesuffix(".json")
    if then == "bare-takeover":
        open_store(root).leases.acquire("sess-crash", owner="operator")
    else:
        assert _child(d, "").returncode == 0
    result = await agent.resume(session_id=fork_id)
    assert result.forked_from == "sess-crash" and result.messages[: len(base.messages)] == base.messages
    runtime.close()


@pytest.mark.parametrize("then", ["no-takeover", "bare-takeover"])
async def test_a_dead_writers_tail_survives_a_bare_takeover_before_recovery(tmp_path, then):
    """A process dies by SIGKILL inside its 4th tool, its three after-tools checkpoints an unindexed tail. Before
    a recovery runs, the session's lease is taken (``loomray lease repair``, a supervisor adopting it). The
    tail holds the results of tools 1-3: recovery must restore it, so each of those tools ran once."""
    import signal

    d = tmp_path / "p"
    d.mkdir()
    assert _child(d, "tool:4").returncode == -signal.SIGKILL
    root = d / "store"
    store = open_store(root)
    tail = [r.checkpoint_id for r in store.checkpoints.list("sess-crash")]
    assert len(tail) == 3
    if then == "bare-takeover":
        store.leases.acquire("sess-crash", owner="operator")
    store.close()
    assert _child(d, "").returncode == 0
    effects = (d / "effects").read_text().split()
    assert [effects.count(f"ray-{i}") for i in range(5)] == [1, 1, 1, 1, 1], effects
