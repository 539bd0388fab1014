"""RayRuntime on a real 3-node cluster: node death, supervisor death, cluster replacement,
zombies, fan-out, streaming events; the recovery tests run in both placements (``actor``: one
actor per session; ``dense``: sessions hosted many per host actor).

The in-process cluster is the one tests/ray/conftest.py shares between modules
(plus, for the cluster-replacement test, the old cluster in a subprocess); this
module has a store of its own on it. Session actors need the ``loomray_session``
resource, which only worker nodes have, so removing a worker really takes a
session down. Agents come from ``ray_agents`` (by value and by reference);
their ScriptedModel logs every model call to a file, so "no model call
repeated" is checked across processes, nodes and clusters.
"""

import asyncio
import copy
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from loomray.testing import free_port, pid_alive, wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture(scope="module")
def env(shared_cluster, tmp_path_factory):
    import ray_agents

    from loomray.runtime import RayRuntime

    runtime = RayRuntime(tmp_path_factory.mktemp("ray-runtime") / "store",
                         actor_options={"resources": {"loomray_session": 1}})
    yield shared_cluster.lc, runtime, ray_agents
    runtime.close()


@pytest.fixture(scope="module")
def dense_runtime(env):
    """The same store and session resource, with sessions hosted densely (hosts only on workers)."""
    lc, runtime, agents = env
    from loomray.runtime import RayRuntime

    dense = RayRuntime(runtime.config.store_url, actor_options={"resources": {"loomray_session": 1}},
                       placement="dense")
    yield dense
    dense.close()


@pytest.fixture(params=["actor", "dense"])
def placed(request, env):
    """``(lc, runtime, agents, suffix)`` for one placement: the dense runs use the ``*_dense`` agents."""
    lc, runtime, agents = env
    if request.param == "dense":
        return lc, request.getfixturevalue("dense_runtime"), agents, "_dense"
    return lc, runtime, agents, ""


def _driver_agent(agent, ref, runtime):
    """The test's handle on a ``ray_agents`` agent: same config, the Ray runtime, and its reference."""
    from loomray.runtime.actors import set_agent_ref

    mine = copy.copy(agent)
    mine.runtime = runtime
    if ref is not None:
        set_agent_ref(mine, ref)
    return mine


async def _until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _checkpoint_turn(store, session_id):
    rows = store.checkpoints.list(session_id, limit=1)
    return rows[0].turn if rows else -1


async def _session_info(runtime, session_id):
    """Where the session runs now, by its id: node_id, pid, host (its own actor, or its dense host)."""
    info = await runtime.session(session_id)
    assert info is not None and info.get("pid") is not None, info
    return info


def _transcript(messages):
    return [m.model_dump(mode="json") for m in messages]


async def _reference(agents, name, session_id):
    """The same agent's transcript from an uninterrupted in-process run."""
    from loomray.runtime import InProcRuntime

    ref = agents.make(name, 0.0, counted=False)
    ref.runtime = InProcRuntime()
    return _transcript((await ref.run("go", session_id=session_id)).messages)




async def test_node_death_mid_run_continues_on_another_node(placed):
    lc, runtime, agents, suffix = placed
    store, name = runtime.store, "nodekill" + suffix
    sid = f"s-{name}"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    events = []
    run = asyncio.create_task(agent.run("go", session_id=sid, emit=events.append))
    # Mid-run by the store's own account: two passes checkpointed, more to come.
    await _until(lambda: _checkpoint_turn(store, sid) >= 2, 60, "the checkpoint of turn 2")
    first = await _session_info(runtime, sid)
    live = {s["session_id"]: s for s in await runtime.status()}[sid]
    assert (live["status"], live["epoch"], live["restarts"]) == ("running", 1, 0)
    assert live["turn"] >= 2 and live["node_id"] == first["node_id"]
    assert live["host"] == first["host"] and live["placement"] == runtime.config.placement
    victim = lc.node_of(first["node_id"])
    assert victim is not None and victim is not lc.head

    # The supervisor lives on the head, so losing a worker never takes it down.
    assert (await runtime._call("ready"))["node_id"] == lc.head.node_id
    lc.remove_node(victim)  # SIGKILL: the actor dies with its node

    result = await asyncio.wait_for(run, 90)
    assert result.output == f"{name} finished"
    assert result.turns == agents.TURNS + 1
    # Every scripted reply was served exactly once, across both incarnations.
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    # The transcript is the one an uninterrupted run produces.
    assert _transcript(result.messages) == await _reference(agents, name, sid)
    row = store.sessions.get(sid)
    assert row.status == "completed"
    assert row.epoch == 2  # a second incarnation took the lease
    assert row.node_id != victim.node_id
    status = {s["session_id"]: s for s in await runtime.status()}
    s = status[sid]
    assert (s["status"], s["incarnation"], s["restarts"], s["epoch"]) == ("completed", 2, 1, 2)
    assert s["node_id"] == row.node_id and s["turn"] == agents.TURNS + 1
    # The driver's emit saw both incarnations: the second one starts again and replays journaled steps.
    assert [e.type for e in events].count("run_start") == 2 and events[-1].type == "run_end"
    assert any(e.type == "replayed_step" or getattr(e, "replayed", False) for e in events)
    assert events[-1].model_calls == result.model_calls
    lc.add_node()  # give later tests two session nodes again


async def test_supervisor_killed_mid_run_new_one_adopts_the_session(placed):
    lc, runtime, agents, suffix = placed
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    name = "orphaned" + suffix
    sid = f"s-{name}"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: _checkpoint_turn(runtime.store, sid) >= 2, 60, "the checkpoint of turn 2")
    host = (await _session_info(runtime, sid))["host"]
    old = ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE)
    old_id = old._actor_id.hex()

    ray.kill(old)  # no restart: the driver's next call creates a replacement

    result = await asyncio.wait_for(run, 90)
    assert result.output == f"{name} finished"
    new = ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE)
    assert new._actor_id.hex() != old_id
    # The detached session actor (or host) was never interrupted: one lease, each reply once, nothing lost.
    assert runtime.store.sessions.get(sid).epoch == 1
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    assert _transcript(result.messages) == await _reference(agents, name, sid)
    sessions = {s["session_id"]: s for s in await runtime.status()}
    assert sessions[sid]["status"] == "completed"
    assert sessions[sid]["host"] == host and sessions[sid]["incarnation"] == 1  # attached, not restarted


async def test_run_that_ends_while_no_supervisor_lives_is_collected_from_its_actor(placed):
    """The supervisor is killed mid-run and its replacement comes only after the run ended (on a loaded
    machine its worker process takes that long to start). Nobody adopts a finished session, so the driver
    resends its hand-off: the replacement must collect the outcome from the run's lingering actor (or
    activation), not answer it from a new incarnation with a second lease."""
    lc, runtime, agents, suffix = placed
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    name = "unwatched" + suffix
    sid = f"s-{name}"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: _checkpoint_turn(runtime.store, sid) >= 2, 60, "the checkpoint of turn 2")
    host = (await _session_info(runtime, sid))["host"]
    # Held, the runtime's lock keeps its driver from creating a replacement until the run is over.
    with runtime._supervisor_lock:
        ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))
        await _until(lambda: runtime.store.sessions.get(sid).status == "completed", 60, "the run's end")

    result = await asyncio.wait_for(run, 90)
    assert result.output == f"{name} finished"
    assert runtime.store.sessions.get(sid).epoch == 1  # one lease: answered by the run that ended
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    assert _transcript(result.messages) == await _reference(agents, name, sid)
    s = {x["session_id"]: x for x in await runtime.status()}[sid]
    assert (s["status"], s["host"], s["incarnation"], s["epoch"]) == ("completed", host, 1, 1)


async def test_a_wait_longer_than_the_readoption_timeout_survives_its_supervisor(env, monkeypatch):
    """The driver waits for a replacement to adopt its session ``_READOPT_TIMEOUT_S``, counted from the
    supervisor's loss: a run waited on for longer than that (shortened here to 1 s) is adopted as any other,
    not given up the moment its supervisor dies."""
    from loomray.runtime import ray_runtime
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    lc, runtime, agents = env
    monkeypatch.setattr(ray_runtime, "_READOPT_TIMEOUT_S", 1.0)
    name, sid = "outwaited", "s-outwaited"
    agent = _driver_agent(agents.outwaited, f"ray_agents:{name}", runtime)
    started = time.monotonic()
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: _checkpoint_turn(runtime.store, sid) >= 2 and time.monotonic() - started > 1.5, 60,
                 "the checkpoint of turn 2, the driver's wait older than the timeout")
    ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))

    result = await asyncio.wait_for(run, 90)
    assert result.output == f"{name} finished"
    assert runtime.store.sessions.get(sid).epoch == 1
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))


async def test_supervisor_and_actor_both_killed_new_supervisor_restarts_by_reference(placed):
    lc, runtime, agents, suffix = placed
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    name = "adopted" + suffix
    sid = f"s-{name}"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: agents.steps_started(name) >= 2, 60, "two tool steps")
    host = (await _session_info(runtime, sid))["host"]  # its actor; or, dense, the host of it and others

    # Nothing in memory survives: the only way back is the session row (agent_ref + spec) and the store.
    ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))
    ray.kill(ray.get_actor(host, namespace=NAMESPACE))

    result = await asyncio.wait_for(run, 90)
    assert result.output == f"{name} finished"
    row = runtime.store.sessions.get(sid)
    assert row.status == "completed" and row.epoch == 2 and row.agent_ref == f"ray_agents:{name}"
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    s = {x["session_id"]: x for x in await runtime.status()}[sid]
    assert s["placement"] == runtime.config.placement and s["epoch"] == 2  # restarted the way it ran
    assert runtime.config.placement == "actor" or s["host"] != host  # dense: on a host that is alive


async def test_zombie_incarnation_is_fenced_and_never_latest(placed):
    """A node freezes (raylet SIGSTOP: a partition, not a crash) mid tool step. Ray declares it dead,
    the supervisor starts a new incarnation elsewhere, then the frozen one's step finishes: its
    writes are refused and nothing it wrote after the takeover is ever "latest"."""
    lc, runtime, agents, suffix = placed
    name = "zombie" + suffix
    store, sid = runtime.store, f"s-{name}"
    workdir = agents.ROOT / name
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: _checkpoint_turn(store, sid) >= 2, 60, "the checkpoint of turn 2")
    (workdir / "hold").write_text("")
    await _until(lambda: agents.pids_with(name, "holding"), 30, "a tool step to hold")
    zombie_pid = next(iter(agents.pids_with(name, "holding")))
    info = await _session_info(runtime, sid)
    assert info["pid"] == zombie_pid
    victim = lc.node_of(info["node_id"])
    raylet = victim.all_processes["raylet"][0].process
    os.kill(raylet.pid, signal.SIGSTOP)
    try:
        # Ray declares the frozen node dead; the supervisor restarts the session on another node.
        await _until(lambda: store.leases.current_epoch(sid) >= 2, 60, "a new incarnation's lease")
        takeover_turn = _checkpoint_turn(store, sid)
        await _until(lambda: agents.pids_with(name, "holding") - {zombie_pid}, 60, "the new incarnation's step")
        assert pid_alive(zombie_pid)  # the old incarnation still runs: a zombie
        (workdir / "hold").unlink()
        # The zombie's step finishes and it tries to journal it, holding epoch 1.
        await _until(lambda: zombie_pid in agents.pids_with(name, "released"), 30, "the zombie to wake up")
        result = await asyncio.wait_for(run, 90)
    finally:
        os.kill(raylet.pid, signal.SIGCONT)
        lc.remove_node(victim)
    assert result.output == f"{name} finished"
    assert _transcript(result.messages) == await _reference(agents, name, sid)
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    # Its writes were refused: every checkpoint after the takeover, and the latest, carry epoch 2 ...
    rows = store.checkpoints.list(sid, limit=None)
    assert rows[0].epoch == 2 and rows[0].execution_status == "completed"
    assert all(r.epoch == 2 for r in rows if r.turn > takeover_turn)
    # ... and the journal holds no entry of epoch 1 for any step after the one the zombie was in (a
    # pass's last tool result may have no entry at all: the pass's checkpoint holds it).
    run_id = store.sessions.get(sid).run_id
    late = [e for e in store.journal.list(sid, run_id) if e.kind == "tool" and e.step_key >= f"t{takeover_turn:04d}"]
    assert [e.step_key for e in late if e.epoch != 2] == []
    wait_for(lambda: not pid_alive(zombie_pid), timeout=30, what="the zombie process to exit")
    lc.add_node()


async def test_fan_out_eight_forks_one_actor_each(placed):
    lc, runtime, agents, suffix = placed
    agent = _driver_agent(agents.quick, None, runtime)  # by value only
    src = "s-source" + suffix
    source = await agent.run("hi", session_id=src)
    assert source.output == "answer 0"
    if runtime.config.placement == "dense":
        # A worker added by an earlier test got its host on the pool's first use since (just now);
        # a fork prefers a warm host to waiting for one to start, so let it come up first.
        def warm_nodes():
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("loomray/host/")]
            return {ray.get(ray.get_actor(n, namespace="loomray").ready.remote(), timeout=60)["node_id"]
                    for n in names}

        wait_for(lambda: {n.node_id for n in lc.workers} <= warm_nodes(), timeout=60, what="a warm host per worker")
    before = [r.checkpoint_id for r in runtime.store.checkpoints.list(src)]

    forks = await agent.fork(src, from_checkpoint=source.checkpoint_id, prompts=[f"p{i}" for i in range(8)])

    assert len(forks) == 8
    assert len({f.session_id for f in forks}) == 8 and src not in {f.session_id for f in forks}
    assert all(f.output == "answer 1" for f in forks)
    from loomray.checkpoint_format import load_checkpoint

    for i, f in enumerate(forks):
        ckpt = load_checkpoint(runtime.store, f.session_id)
        assert ckpt is not None
        assert ckpt.forked_from == src and ckpt.session_id == f.session_id
        assert f.messages[-2].content == f"p{i}"  # results in prompt order
    # The source session is untouched.
    assert [r.checkpoint_id for r in runtime.store.checkpoints.list(src)] == before
    supervised = {s["session_id"]: s for s in await runtime.status()}
    assert all(supervised[f.session_id]["status"] == "completed" for f in forks)
    nodes = {supervised[f.session_id]["node_id"] for f in forks}
    assert len(nodes) >= 1
    if runtime.config.placement == "dense":
        # Spread by load over both workers' hosts; never the head (the hosts need loomray_session).
        assert len(nodes) == 2 and lc.head.node_id not in nodes
        assert all(supervised[f.session_id]["host"].startswith("loomray/host/") for f in forks)


async def test_fork_concurrency_bound_holds_and_progress_is_reported(env):
    lc, runtime, agents = env
    from loomray.runtime import RayRuntime

    seen = []
    bounded = RayRuntime(runtime.config.store_url, actor_options={"resources": {"loomray_session": 1}},
                         max_concurrent_forks=2, on_fork_progress=seen.append)
    agent = _driver_agent(agents.bounded, None, bounded)
    source = await agent.run("hi", session_id="s-bounded")

    forks = await agent.fork("s-bounded", from_checkpoint=source.checkpoint_id, prompts=[f"q{i}" for i in range(5)])

    assert [f.output for f in forks] == ["fork done"] * 5
    # Observed from inside the forks: never more than two worked at once.
    assert agents.max_overlap("bounded") <= 2
    assert seen, "no progress reported"
    assert max(p["running"] for p in seen) <= 2
    assert any(p["queued"] > 0 for p in seen)  # the rest waited their turn
    last = seen[-1]
    assert (last["total"], last["completed"], last["queued"], last["running"], last["done"]) == (5, 5, 0, 0, True)
    assert last["max_running"] == 2 and last["limit"] == 2
    bounded.close()


async def test_emit_delivers_the_actors_events_to_the_driver(placed):
    lc, runtime, agents, suffix = placed
    from loomray.runtime import InProcRuntime

    name = "streamed" + suffix
    sid = f"s-{name}"
    agent = _driver_agent(getattr(agents, name), f"ray_agents:{name}", runtime)
    events = []
    result = await agent.run("go", session_id=sid, emit=events.append)

    reference_events = []
    ref = agents.make(name, 0.0, counted=False)
    ref.runtime = InProcRuntime()
    await ref.run("go", session_id=sid, emit=reference_events.append)
    assert [e.type for e in events] == [e.type for e in reference_events]
    assert events[0].type == "run_start" and events[-1].type == "run_end"
    assert all(e.session_id == sid for e in events)
    assert sum(e.type == "model_response" for e in events) == result.turns
    assert events[-1].output == result.output


async def test_submit_by_reference_errors_and_status(placed):
    lc, runtime, agents, suffix = placed
    from loomray.errors import LoomrayUserError

    with pytest.raises(LoomrayUserError, match="must look like"):
        await runtime.submit("not a reference", "go")
    with pytest.raises(LoomrayUserError, match="cannot import"):
        await runtime.submit("no_such_module_xyz:agent", "go", session_id="s-badref" + suffix)
    with pytest.raises(LoomrayUserError, match="not a loomray Agent"):
        await runtime.submit("ray_agents:TURNS", "go", session_id="s-notagent" + suffix)
    t0 = time.monotonic()
    with pytest.raises(LoomrayUserError, match="not supervised.*does not know it"):
        await runtime.wait("s-never-submitted")
    assert time.monotonic() - t0 < 10  # a clear answer, not a long retry
    sid = await runtime.submit("ray_agents:quick", "hello", session_id="s-submitted" + suffix)
    assert sid == "s-submitted" + suffix
    result = await runtime.wait(sid)
    assert result.output == "answer 0"
    s = {x["session_id"]: x for x in await runtime.status()}[sid]
    assert s["status"] == "completed" and s["epoch"] == 1 and s["turn"] == 1
    # Nothing of it is left marked active: the supervisor's periodic pass will not look at it again.
    assert (None, sid) not in runtime.store.active.list()
    # The supervisor's index compaction (it also runs in the background) merges the small files.
    store = runtime.store

    def index_files():
        return len(store.index_files("checkpoints")) + len(store.index_files("sessions"))

    before = index_files()
    report = await runtime._call("compact")
    assert report["files_before"] == before and report["files_after"] == index_files() < before


async def test_fenced_actor_stops_and_reports_lease_lost(placed):
    lc, runtime, agents, suffix = placed
    from loomray.runtime.actors import NAMESPACE, session_actor_name
    from loomray.storage.errors import LeaseLostError

    agent_name = "fenced" + suffix
    sid = f"s-{agent_name}"
    agent = _driver_agent(getattr(agents, agent_name), f"ray_agents:{agent_name}", runtime)
    run = asyncio.create_task(agent.run("go", session_id=sid))
    await _until(lambda: agents.steps_started(agent_name) >= 2, 60, "two tool steps")
    info = await _session_info(runtime, sid)

    intruder = runtime.store.leases.acquire(sid, owner="intruder")  # takes over: epoch 2

    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(run, 60)
    assert intruder.epoch == 2
    if runtime.config.placement == "actor":
        # The fenced incarnation exits and frees its name; the supervisor does not restart it.
        name = session_actor_name(runtime.config.store_url, sid)

        def gone():
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return True
            return False

        wait_for(gone, timeout=30, what=f"actor {name} to exit")
        wait_for(lambda: not pid_alive(info["pid"]), timeout=30, what="the fenced actor's process to exit")
    else:
        # The host drops the fenced activation and goes on hosting the others; nothing restarts it.
        host = ray.get_actor(info["host"], namespace=NAMESPACE)
        hosted = await host.sessions.remote()
        assert sid not in {h["session_id"] for h in hosted} and pid_alive(info["pid"])
    assert runtime.store.leases.current_epoch(sid) == 2
    # It stopped mid-run: the script was not played to the end.
    assert len(agents.model_calls(agent_name)) < agents.TURNS + 1
    status = {s["session_id"]: s for s in await runtime.status()}
    assert status[sid]["status"] == "fenced" and status[sid]["incarnation"] == 1


async def test_dense_sessions_on_one_host_neither_block_nor_kill_each_other(env):
    """One host, ten sessions: eight hold a thread each in a blocking sync tool, one's model raises,
    one runs quick passes. The quick one finishes while the eight still block (they run off the
    host's event loop, and the host has threads to spare); the failure stays its own session's."""
    lc, runtime, agents = env
    from loomray.runtime import RayRuntime

    # A pool of its own, pinned to one worker by that node's resource: one host holds them all.
    worker = lc.workers[0]
    rt = RayRuntime(runtime.config.store_url, placement="dense", hosts_per_node=1,
                    actor_options={"resources": {"loomray_session": 1, lc.resource_of(worker): 0.001}})
    workdir = agents.ROOT / "isolation"
    blocked = [asyncio.create_task(_driver_agent(agents.isolation_agent("blocking"), None, rt)
                                   .run("go", session_id=f"s-iso-block-{i}")) for i in range(8)]
    await _until(lambda: len(list(workdir.glob("blocked-*"))) >= 8, 60, "eight blocked tool threads")
    failing = asyncio.create_task(_driver_agent(agents.isolation_agent("failing"), None, rt)
                                  .run("go", session_id="s-iso-fail"))

    quick = await asyncio.wait_for(_driver_agent(agents.isolation_agent("quick"), None, rt)
                                   .run("go", session_id="s-iso-quick"), 60)

    assert quick.output == "quick done" and quick.turns == 6
    with pytest.raises(Exception, match="boom"):
        await failing
    assert not any(t.done() for t in blocked)  # still blocked, and nobody else waited for them
    (workdir / "release").write_text("")
    assert [r.output for r in await asyncio.gather(*blocked)] == ["blocking done"] * 8
    status = {s["session_id"]: s for s in await rt.status()}
    sids = [f"s-iso-block-{i}" for i in range(8)] + ["s-iso-fail", "s-iso-quick"]
    assert len({status[sid]["host"] for sid in sids}) == 1
    assert {status[sid]["node_id"] for sid in sids} == {worker.node_id}
    assert status["s-iso-fail"]["status"] == "failed" and status["s-iso-quick"]["status"] == "completed"
    rt.close()


def test_concurrent_first_use_of_a_fresh_runtime_connects_once(env):
    """Runs gathered on a fresh RayRuntime in a process not yet connected to Ray: exactly one
    ``ray.init`` (it used to be called once per run: "Perhaps you called ray.init twice"), all complete."""
    lc, runtime, agents = env
    code = textwrap.dedent(f"""
        import asyncio, copy
        import ray_agents
        from loomray.runtime import RayRuntime

        rt = RayRuntime({runtime.config.store_url!r}, address={lc.address!r}, placement="dense",
                        actor_options={{"resources": {{"loomray_session": 1}}}})

        async def main():
            mine = [copy.copy(ray_agents.quick) for _ in range(6)]
            for a in mine:
                a.runtime = rt
            results = await asyncio.gather(*(a.run("hi", session_id=f"s-gathered-{{i}}") for i, a in enumerate(mine)))
            print(" ".join(r.output.replace(" ", "_") for r in results))

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-6:] == ["answer_0"] * 6



# Actor placement only, to keep the suite fast: adopting a dense session the way it ran is covered by the
# both-killed test above and by test_ray_placement (a supervisor configured for actors restarts dense ones dense).
@pytest.mark.parametrize("placed", ["actor"], indirect=True)
async def test_whole_cluster_lost_new_cluster_resumes_via_supervise(placed):
    """Cluster A (a subprocess) runs a session submitted by a driver that exits at once; A is shut
    down mid-run, while the session holds in a tool step (so not between a model call's answer and its
    journal write, where any kill repeats that call); ``supervise(store)`` on this cluster (B) picks the
    session up and finishes it."""
    lc, runtime, agents, suffix = placed
    from loomray.runtime.ray_runtime import supervise

    name = "restart" + suffix
    store, sid = runtime.store, f"s-{name}"
    run_dir = tempfile.mkdtemp(prefix="lr-", dir="/tmp")  # short: Ray's socket paths live under it
    daemon = subprocess.Popen([sys.executable, str(REPO / "cluster" / "local_daemon.py"), run_dir, "2",
                               str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        address_file = Path(run_dir) / "address"
        await _until(lambda: address_file.exists() or daemon.poll() is not None, 120, "cluster A")
        assert daemon.poll() is None, daemon.stdout.read().decode()[-2000:]
        address = address_file.read_text().strip()
        code = ("import sys; from loomray.runtime import RayRuntime; "
                f"rt = RayRuntime({runtime.config.store_url!r}, address={address!r}, "
                f"actor_options={{'resources': {{'loomray_session': 1}}}}, placement={runtime.config.placement!r}); "
                f"print(rt.submit_sync('ray_agents:{name}', 'go', session_id={sid!r}))")
        t0 = time.monotonic()
        driver = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert driver.returncode == 0, driver.stderr[-2000:]
        assert driver.stdout.split()[-1] == sid
        # The driver is gone; the run goes on in cluster A.
        await _until(lambda: _checkpoint_turn(store, sid) >= 2, 60, "cluster A to checkpoint turn 2")
        (agents.ROOT / name / "hold").write_text("")
        await _until(lambda: agents.pids_with(name, "holding"), 30, "a tool step to hold in cluster A")
        assert store.sessions.get(sid).status == "running"
        assert time.monotonic() - t0 < 120
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=90)
        (agents.ROOT / name / "hold").unlink(missing_ok=True)  # cluster B's incarnation runs straight through
    assert "processes killed after the grace period: []" in out.decode(), out.decode()[-2000:]
    interrupted_at = _checkpoint_turn(store, sid)
    assert interrupted_at < agents.TURNS + 1 and store.sessions.get(sid).status == "running"

    stop, reports = threading.Event(), []
    # The session's agent was submitted to cluster A's supervisor: here the operator allows it.
    keeper = threading.Thread(target=supervise, args=(runtime.config.store_url,), daemon=True,
                              kwargs={"interval_s": 0.5, "stop": stop, "report": reports.append,
                                      "allowed_agents": (f"ray_agents:{name}",)})
    keeper.start()
    try:
        await _until(lambda: store.sessions.get(sid).status == "completed", 90, "cluster B to finish the session")
    finally:
        stop.set()
        keeper.join(timeout=30)
    row = store.sessions.get(sid)
    assert row.epoch == 2 and row.node_id in lc.alive_node_ids()
    assert sorted(agents.model_calls(name)) == list(range(agents.TURNS + 1))
    from loomray.checkpoint_format import load_checkpoint

    ckpt = load_checkpoint(runtime.store, sid)
    assert ckpt is not None and ckpt.execution_status == "completed"
    assert _transcript(ckpt.messages) == await _reference(agents, name, sid)
    # Restarted the way it ran (the active mark carries the placement), and its mark is gone.
    s = await runtime.session(sid)
    assert s is not None and s["placement"] == runtime.config.placement
    assert (None, sid) not in store.active.list()


def test_supervise_keeper_recreates_a_killed_supervisor(env):
    from loomray.runtime.actors import NAMESPACE, supervisor_name
    from loomray.runtime.ray_runtime import supervise

    lc, runtime, agents = env
    stop, reports = threading.Event(), []
    keeper = threading.Thread(target=supervise, args=(runtime.config.store_url,), daemon=True,
                              kwargs={"interval_s": 0.2, "stop": stop, "report": reports.append})
    keeper.start()
    try:
        wait_for(lambda: reports, timeout=30, what="the keeper to find a supervisor")

        def supervisor_id():
            try:
                return ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE)._actor_id.hex()
            except ValueError:
                return None

        old_id = supervisor_id()
        ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))
        wait_for(lambda: supervisor_id() not in (None, old_id), timeout=30, what="a replacement supervisor")
        assert any("re-creating" in r for r in reports)
    finally:
        stop.set()
        keeper.join(timeout=30)
    assert not keeper.is_alive()


async def test_activations_placed_together_reach_their_host_in_one_call(env, dense_runtime):
    """Three sessions placed on one host at once travel as one host call; each still gets its own answer,
    and a request the host cannot start fails alone while the others run to their end."""
    lc, runtime, agents = env
    from loomray.errors import SessionStartError
    from loomray.runtime.activation_batch import ActivationBatcher
    from loomray.runtime.actors import AgentSpec
    from loomray.runtime.hosts import host_prefix
    from loomray.session import RunRequest

    agent = _driver_agent(agents.make("batched", 0.0), None, dense_runtime)
    await agent.run("warm", session_id="s-batch-warm")  # the pool has a host now
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(host_prefix(dense_runtime.config.store_url)))
    host = ray.get_actor(name, namespace="loomray")
    calls_before = (await host.ready.remote())["activation_calls"]
    spec, config = AgentSpec.of(agent), dense_runtime.config
    requests = [RunRequest(prompt="go", session_id=f"s-batch-{i}").model_dump_json() for i in range(2)]
    batcher = ActivationBatcher()

    answers = await asyncio.gather(
        *(batcher.activate(name, host, config, spec, r, None) for r in [requests[0], "{not json", requests[1]]),
        return_exceptions=True)

    assert [a["session_id"] for a in (answers[0], answers[2])] == ["s-batch-0", "s-batch-1"]
    assert isinstance(answers[1], SessionStartError)
    assert (await host.ready.remote())["activation_calls"] == calls_before + 1
    outcomes = [await host.run.remote(f"s-batch-{i}", None) for i in range(2)]
    assert [o.status for o in outcomes] == ["completed", "completed"]
    for i in range(2):
        await host.deactivate.remote(f"s-batch-{i}", None)
