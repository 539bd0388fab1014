"""One bad session harms no one, and a lost supervisor bills nothing twice (on a real 3-node cluster).

- A tool's ``SystemExit`` / ``KeyboardInterrupt`` ends its own session's run with a typed error, in both
  placements; a dense host's other sessions run on in the same process.
- A host whose event loop ends anyway is replaced like a lost node: its sessions are reactivated and no
  model call is made twice.
- A session whose tool keeps killing its host (``os._exit``) is attributed and moved to a process of its
  own; it fails alone, with the reason; its neighbours finish, and none of their restarts is charged.
- A supervisor killed during a fan-out (``loomray supervise`` re-creates it): the driver's resend runs no
  fork twice.
- Every view agrees on how a session ended: cancelled, awaiting approval, ... is never "completed".

Agents come from ``chaos_agents`` (by reference: a restart imports them on any node); their models
log every call to a file, so "no model call twice" is checked across processes.
"""

import asyncio
import copy
import threading
import time

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

#: Seconds a contained failure may take to reach the driver (a hang is what the bug was).
BOUND_S = 60


@pytest.fixture(scope="module")
def env(shared_cluster, tmp_path_factory):
    import chaos_agents

    yield shared_cluster.lc, tmp_path_factory.mktemp("ray-containment") / "store", chaos_agents


def _runtime(env, **options):
    """A runtime on this module's store whose sessions (or hosts) all sit on the first worker."""
    from loomray.runtime import RayRuntime

    lc, store, _ = env
    resources = {"loomray_session": 1, lc.resource_of(lc.workers[0]): 0.001}
    return RayRuntime(store, actor_options={"resources": resources}, **options)


def _mine(agents, name, runtime):
    """The test's handle on agent ``chaos_agents.{name}``: the Ray runtime and its reference."""
    from loomray.runtime.actors import set_agent_ref

    agent = copy.copy(getattr(agents, name))
    agent.runtime = runtime
    set_agent_ref(agent, f"chaos_agents:{name}")
    return agent


async def _until(predicate, timeout, what):
    """Poll ``predicate`` without blocking the driver's event loop (its runs are tasks on it)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def _status(statuses, sid):
    return next(s for s in statuses if s["session_id"] == sid)


@pytest.mark.parametrize("placement", ["actor", "dense"])
async def test_a_tool_raising_system_exit_fails_its_own_run_only(env, placement):
    _, _, agents = env
    rt = _runtime(env, placement=placement, hosts_per_node=1 if placement == "dense" else None)
    name = "exits" if placement == "actor" else "exits_dense"
    neighbours = [] if placement == "actor" else [0, 1]
    runs = [asyncio.create_task(_mine(agents, f"nb{i}", rt).run("go", session_id=f"s-nb{i}")) for i in neighbours]

    with pytest.raises(Exception, match="SystemExit") as caught:  # on main: a hang (TimeoutError)
        await asyncio.wait_for(_mine(agents, name, rt).run("go", session_id=f"s-{name}"), BOUND_S)

    assert type(caught.value).__name__ == "ToolAborted" and caught.value.tool == "leave"
    assert agents.model_calls(name) == [0]
    done = await asyncio.wait_for(asyncio.gather(*runs), BOUND_S)
    assert [r.output for r in done] == [f"nb{i} finished" for i in neighbours]
    assert all(agents.neighbour_calls_ok(i) for i in neighbours)
    statuses = await rt.status()
    assert _status(statuses, f"s-{name}")["status"] == "failed"
    assert rt.store.sessions.get(f"s-{name}").status == "failed"
    if neighbours:  # the same host ran them all, and never restarted: the process went on
        hosts = {_status(statuses, sid)["host"] for sid in [f"s-{name}"] + [f"s-nb{i}" for i in neighbours]}
        assert len(hosts) == 1
        assert all(_status(statuses, f"s-nb{i}")["incarnation"] == 1 for i in neighbours)
    rt.close()


async def test_a_tool_raising_keyboard_interrupt_in_its_thread_fails_its_run(env):
    _, _, agents = env
    rt = _runtime(env)
    with pytest.raises(Exception, match="KeyboardInterrupt") as caught:
        await asyncio.wait_for(_mine(agents, "interrupts", rt).run("go", session_id="s-interrupts"), BOUND_S)
    assert type(caught.value).__name__ == "ToolAborted"
    assert (await rt.session("s-interrupts"))["status"] == "failed"
    rt.close()


async def test_a_host_whose_loop_died_is_replaced_and_its_sessions_go_on(env):
    """The loop of a dense host ends (a callback raised SystemExit): the host exits, the supervisor
    reactivates its sessions like a lost node's, and no model call is made twice."""
    _, _, agents = env
    rt = _runtime(env, placement="dense", hosts_per_node=1)
    neighbours = [2, 3]
    runs = [asyncio.create_task(_mine(agents, f"nb{i}", rt).run("go", session_id=f"s-nb{i}")) for i in neighbours]
    await _until(lambda: all(agents.model_calls(f"nb{i}") for i in neighbours), timeout=BOUND_S, what="neighbours")
    breaker = await asyncio.wait_for(_mine(agents, "loop_breaker", rt).run("go", session_id="s-breaker"), BOUND_S)

    assert breaker.output == "loop_breaker finished"
    done = await asyncio.wait_for(asyncio.gather(*runs), BOUND_S)
    assert [r.output for r in done] == [f"nb{i} finished" for i in neighbours]
    assert sorted(agents.model_calls("loop_breaker")) == [0, 1]
    assert all(agents.neighbour_calls_ok(i) for i in neighbours)
    statuses = await rt.status()
    for sid in ["s-breaker"] + [f"s-nb{i}" for i in neighbours]:
        s = _status(statuses, sid)
        # Restarted once, like a lost node's session, and not charged: its host crashed with its node up.
        assert (s["status"], s["restarts"], s["charged_restarts"]) == ("completed", 1, 0), s
    rt.close()


async def test_a_session_that_keeps_crashing_its_host_fails_alone(env):
    """A dense session whose tool calls os._exit: it is moved to a process of its own after two host
    crashes and fails there alone with the reason; its neighbours finish, none of their restarts charged."""
    from loomray.errors import LoomrayRunError

    _, _, agents = env
    rt = _runtime(env, placement="dense", hosts_per_node=1, max_restarts_per_session=3)
    neighbours = [4, 5]
    runs = [asyncio.create_task(_mine(agents, f"nb{i}", rt).run("go", session_id=f"s-nb{i}")) for i in neighbours]
    await _until(lambda: all(agents.model_calls(f"nb{i}") for i in neighbours), timeout=BOUND_S, what="neighbours")

    with pytest.raises(LoomrayRunError, match="restart limit reached.*moved out of shared session hosts"):
        await asyncio.wait_for(_mine(agents, "crasher", rt).run("go", session_id="s-crasher"), 4 * BOUND_S)

    done = await asyncio.wait_for(asyncio.gather(*runs), BOUND_S)
    assert [r.output for r in done] == [f"nb{i} finished" for i in neighbours]
    assert all(agents.neighbour_calls_ok(i) for i in neighbours)
    assert sorted(set(agents.model_calls("crasher"))) == [0]  # never got past its tool
    statuses = await rt.status()
    crasher = _status(statuses, "s-crasher")
    assert crasher["status"] == "failed" and crasher["quarantined"] and crasher["charged_restarts"] == 2
    assert rt.store.sessions.get("s-crasher").status == "failed"
    for i in neighbours:
        assert _status(statuses, f"s-nb{i}")["charged_restarts"] == 0
    rt.close()


async def test_a_quarantined_session_stays_in_its_own_process_after_its_supervisor_dies(env):
    """Quarantine outlives the supervisor that decided it: its replacement adopts the session into a
    process of its own, never back onto a shared host (where it crashed its neighbours twice more)."""
    from loomray.errors import LoomrayRunError
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    _, _, agents = env
    rt = _runtime(env, placement="dense", hosts_per_node=1, max_restarts_per_session=4)
    run = asyncio.create_task(_mine(agents, "crasher", rt).run("go", session_id="s-quarantined"))
    deadline = time.monotonic() + 4 * BOUND_S
    while not next((s["quarantined"] for s in await rt.status() if s["session_id"] == "s-quarantined"), False):
        assert time.monotonic() < deadline and not run.done(), "never quarantined"
        await asyncio.sleep(0.1)
    ray.kill(ray.get_actor(supervisor_name(rt.config.store_url), namespace=NAMESPACE))

    # The next call makes a replacement (the driver's wait does too); its first view of the session:
    adopted = None
    while adopted is None:
        assert time.monotonic() < deadline, "never adopted"
        adopted = next((s for s in await rt.status() if s["session_id"] == "s-quarantined"), None)
    assert (adopted["quarantined"], adopted["placement"]) == (True, "actor"), adopted
    with pytest.raises(LoomrayRunError, match="restart limit reached.*moved out of shared session hosts"):
        await asyncio.wait_for(run, 4 * BOUND_S)
    rt.close()


async def test_the_restart_limit_counts_across_supervisors(env):
    """Deaths charged to a session under a supervisor that then dies still count under the one adopting it:
    a session that crashes its own process every time gets ``max_restarts_per_session`` starts in all (one
    more at most, when the dying supervisor had not yet seen a death), not that many again per supervisor."""
    from loomray.errors import LoomrayRunError
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    _, _, agents = env
    crashes = lambda: len(list(agents.workdir("crasher").glob("crash-*")))  # noqa: E731
    before = crashes()
    rt = _runtime(env, max_restarts_per_session=4)
    run = asyncio.create_task(_mine(agents, "crasher", rt).run("go", session_id="s-limit-across"))
    deadline = time.monotonic() + 4 * BOUND_S
    while next((s["charged_restarts"] for s in await rt.status() if s["session_id"] == "s-limit-across"), 0) < 2:
        assert time.monotonic() < deadline and not run.done(), "never restarted twice"
        await asyncio.sleep(0.1)
    ray.kill(ray.get_actor(supervisor_name(rt.config.store_url), namespace=NAMESPACE))

    with pytest.raises(LoomrayRunError, match="restart limit reached"):
        await asyncio.wait_for(run, 4 * BOUND_S)
    assert 4 <= crashes() - before <= 5  # on main: 6 or 7 (the adopting supervisor started counting at 0)
    rt.close()


def test_max_restarts_per_session_is_checked():
    from loomray.runtime import RayRuntime

    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_restarts_per_session"):
            RayRuntime("/tmp/loomray-unused", max_restarts_per_session=bad)


async def test_a_supervisor_killed_mid_fan_out_runs_no_fork_twice(env):
    """8 forks, 2 at a time; the supervisor is killed after some finished while others run, and
    ``supervise`` re-creates it: the driver's resend continues or answers each fork, never re-runs it."""
    from loomray.runtime.actors import NAMESPACE, supervisor_name
    from loomray.runtime.ray_runtime import supervise

    _, _, agents = env
    rt = _runtime(env, max_concurrent_forks=2)
    agent = _mine(agents, "forker", rt)
    source = await agent.run("hi", session_id="s-fan-source")
    stop = threading.Event()
    keeper = threading.Thread(target=supervise, args=(rt.config.store_url,), daemon=True,
                              kwargs={"interval_s": 0.2, "stop": stop, "report": lambda line: None})
    keeper.start()
    try:
        fork = asyncio.create_task(agent.fork("s-fan-source", from_checkpoint=source.checkpoint_id,
                                              prompts=[f"p{i}" for i in range(8)]))
        await _until(lambda: agents.model_calls("forker").count(2) >= 3, timeout=BOUND_S, what="three finished forks")
        ray.kill(ray.get_actor(supervisor_name(rt.config.store_url), namespace=NAMESPACE))

        forks = await asyncio.wait_for(fork, 3 * BOUND_S)
    finally:
        stop.set()
    assert [f.output for f in forks] == ["fork done"] * 8
    calls = agents.model_calls("forker")
    assert (calls.count(0), calls.count(1), calls.count(2)) == (1, 8, 8), calls
    assert len({f.session_id for f in forks}) == 8
    rt.close()


async def test_every_view_agrees_on_how_a_session_ended(env):
    _, _, agents = env
    rt = _runtime(env)
    here = agents.workdir("holder")
    (here / "hold").write_text("")
    holder = _mine(agents, "holder", rt)
    run = asyncio.create_task(holder.run("go", session_id="s-held"))
    await _until(lambda: list(here.glob("held-*")), timeout=BOUND_S, what="the held tool")
    await holder.cancel("s-held")
    assert (await asyncio.wait_for(run, BOUND_S)).stop_reason == "cancelled"

    waiting = await _mine(agents, "approver", rt).run("go", session_id="s-approval")
    assert waiting.stop_reason == "awaiting_approval"

    statuses = await rt.status()
    for sid, state in (("s-held", "cancelled"), ("s-approval", "awaiting_approval")):
        assert _status(statuses, sid)["status"] == state
        assert (await rt.session(sid))["status"] == state
        assert rt.store.sessions.get(sid).status == state
    (here / "hold").unlink()
    rt.close()


async def test_fan_out_progress_counts_a_cancelled_fork_as_cancelled(env):
    _, _, agents = env
    progress = []
    rt = _runtime(env, on_fork_progress=progress.append)
    rt.progress_interval_s = 0.05
    here = agents.workdir("holder")
    for p in here.glob("held-*"):
        p.unlink()
    agent = _mine(agents, "fan_holder", rt)
    source = await agent.run("go", session_id="s-fan-held")
    (here / "hold").write_text("")
    fork = asyncio.create_task(agent.fork("s-fan-held", from_checkpoint=source.checkpoint_id, prompts=["a", "b"]))
    await _until(lambda: len(list(here.glob("held-*"))) >= 2, timeout=BOUND_S, what="both forks holding")
    first = progress[-1]["sessions"][0]
    await agent.cancel(first)
    (here / "hold").unlink()

    forks = await asyncio.wait_for(fork, BOUND_S)
    assert [f.stop_reason for f in forks] == ["cancelled", "completed"]
    last = progress[-1]
    assert (last["completed"], last["cancelled"], last["failed"], last["done"]) == (1, 1, 0, True), last
    assert (await rt.session(first))["status"] == "cancelled" == rt.store.sessions.get(first).status
    rt.close()
