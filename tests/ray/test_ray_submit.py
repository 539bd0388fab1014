"""Starting sessions with actor placement: ``submit`` returns at once whatever the cluster has free.

A session actor asks for what its ``actor_options`` say (here one unit of a
custom resource that one node has once); the supervisor creates it and
returns, and Ray starts it when the unit is free. Nothing loomray keeps
holds such a unit between sessions: once a session ends, the next one gets
it. Each session, fork included, runs in an actor of its own, named after it.
"""

import asyncio
import os
import time
from pathlib import Path

import pytest

from loomray.testing import wait_for

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

#: "At once": the supervisor exists already, so a submit is a store write and an actor creation. A submit
#: that waits for the unit to free waits for a gated session that holds it for up to 120 s.
SUBMIT_S = 20.0


@pytest.fixture(scope="module")
def env(shared_cluster):
    """The shared cluster plus one node with the only unit of ``scarce`` (the module's reset removes it);
    ``root`` is the workers' LOOMRAY_FANOUT_TEST_DIR."""
    from loomray.runtime import RayRuntime

    lc, root = shared_cluster.lc, shared_cluster.fanout
    lc.add_node(resources={"scarce": 1})
    runtime = RayRuntime(root / "store", actor_options={"resources": {"scarce": 1}})
    yield lc, runtime, root
    runtime.close()


def _agent(replies, tools=(), runtime=None):
    from loomray import Agent, Tuning
    from loomray.models import ScriptedModel

    return Agent("submit", model=ScriptedModel(list(replies)), tools=list(tools), tuning=Tuning(checkpoint=True),
                 runtime=runtime, name="submit")


def gated_step() -> str:
    """Waits until the test opens the gate (a file), after saying it waits."""
    root = Path(os.environ["LOOMRAY_FANOUT_TEST_DIR"])
    (root / "waiting").write_text(str(os.getpid()))
    deadline = time.monotonic() + 120
    while not (root / "gate").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return "through"


async def _submit(runtime, agent, session_id):
    """``runtime.submit``, which must return within ``SUBMIT_S``."""
    return await asyncio.wait_for(runtime.submit(agent, "go", session_id=session_id), SUBMIT_S)


async def test_submit_returns_at_once_whatever_is_free_and_the_session_runs_once_its_resource_frees(env):
    _, runtime, root = env
    from loomray.runtime import RayRuntime

    # Two sets of options that ask for the same unit (as `--actor-options` with a runtime env and `--resources`).
    other = RayRuntime(runtime.config.store_url, actor_options={
        "resources": {"scarce": 1}, "runtime_env": {"env_vars": {"LOOMRAY_SUBMIT_TEST": "1"}}})
    await _submit(runtime, _agent(["first done"]), "s-first")
    assert (await runtime.wait("s-first")).output == "first done"

    # Once a session with the unit ended, a session of other options gets it: nothing loomray keeps holds it.
    await _submit(other, _agent([{"tool": "gated_step", "args": {}}, "held done"], [gated_step]), "s-held")
    await asyncio.to_thread(wait_for, lambda: (root / "waiting").exists(), timeout=90, what="s-held to hold the unit")

    # While s-held holds the only unit, more sessions of either options return at once, and wait for it.
    await _submit(runtime, _agent(["again done"]), "s-again")
    await _submit(other, _agent(["other done"]), "s-other")
    store = runtime.store
    assert store.checkpoints.list("s-again") == [] and store.checkpoints.list("s-other") == []
    # A session still waiting for the unit is known, and a cancel of it returns at once too.
    await _submit(runtime, _agent(["never said"]), "s-cancelled")
    await asyncio.wait_for(runtime.cancel("s-cancelled"), SUBMIT_S)

    (root / "gate").write_text("")
    results = await asyncio.wait_for(asyncio.gather(other.wait("s-held"), runtime.wait("s-again"),
                                                    other.wait("s-other")), 120)
    assert [r.output for r in results] == ["held done", "again done", "other done"]
    assert (await asyncio.wait_for(runtime.wait("s-cancelled"), 120)).stop_reason == "cancelled"
    assert store.checkpoints.list("s-cancelled") == [] and store.sessions.get("s-cancelled").status == "cancelled"
    # Each ran only once the one before it let the unit go: their checkpoints do not interleave.
    spans = sorted((min(c.created_at for c in cs), max(c.created_at for c in cs)) for cs in (
        store.checkpoints.list(s, limit=50) for s in ("s-held", "s-again", "s-other")))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False)), spans
    other.close()


async def test_forks_each_run_in_an_actor_of_their_own(env):
    _, runtime, _ = env
    from loomray.runtime import RayRuntime
    from loomray.runtime.actors import session_actor_name

    plenty = RayRuntime(runtime.config.store_url, actor_options={"resources": {"loomray_session": 1}})
    agent = _agent(["source", "fork"], runtime=plenty)
    source = await agent.run("hi", session_id="s-source")

    forks = await agent.fork("s-source", from_checkpoint=source.checkpoint_id, prompts=["a", "b", "c"])

    assert [f.output for f in forks] == ["fork"] * 3
    status = {s["session_id"]: s for s in await plenty.status()}
    assert [status[f.session_id]["host"] for f in forks] == [
        session_actor_name(plenty.config.store_url, f.session_id) for f in forks]
    plenty.close()


def test_standby_actors_is_ignored_with_a_warning(tmp_path):
    from loomray.runtime import RayRuntime

    with pytest.warns(DeprecationWarning, match="standby_actors"):
        rt = RayRuntime(tmp_path / "store", standby_actors=8)
    assert rt.config.actor_options == {} and rt.store is not None


async def test_an_idle_session_host_gives_up_the_unit_a_session_of_other_options_asks_for(env):
    """Dense hosts stay warm for their own options only: an idle one holding the unit exits when another
    session (actor placement, or dense with other options) needs it, instead of after ``host_idle_s``."""
    _, runtime, _ = env
    from loomray.runtime import RayRuntime

    url = runtime.config.store_url
    dense = RayRuntime(url, placement="dense", actor_options={"resources": {"scarce": 1}})
    dense_other = RayRuntime(url, placement="dense", actor_options={
        "resources": {"scarce": 1}, "runtime_env": {"env_vars": {"LOOMRAY_SUBMIT_TEST": "2"}}})
    assert dense.config.host_idle_s >= 600  # the wait these sessions would otherwise see
    for rt, session_id in ((dense, "d-first"), (runtime, "a-after-dense"), (dense_other, "d-other"),
                           (dense, "d-again"), (runtime, "a-last")):
        await _submit(rt, _agent([f"{session_id} done"]), session_id)
        result = await asyncio.wait_for(rt.wait(session_id), 90)
        assert result.output == f"{session_id} done"
    dense.close()
    dense_other.close()


async def test_wait_answers_for_a_run_that_ended_when_no_supervisor_knows_it(env):
    """A submitted run ends, then its supervisor is lost: the replacement never adopts a session that ended
    (nothing is left to watch), and a later ``wait`` (another driver, ``loomray wait``) answers with that run's
    result from the store, as it does for a cancelled one; a session nobody ran stays an error."""
    from loomray.errors import LoomrayUserError
    from loomray.runtime.actors import NAMESPACE, supervisor_name

    _, runtime, _ = env
    await _submit(runtime, _agent(["ended done"]), "s-ended")
    first = await runtime.wait("s-ended")
    await _submit(runtime, _agent(["never said"]), "s-ended-cancelled")
    await runtime.cancel("s-ended-cancelled")
    assert (await runtime.wait("s-ended-cancelled")).stop_reason == "cancelled"
    ray.kill(ray.get_actor(supervisor_name(runtime.config.store_url), namespace=NAMESPACE))

    again = await asyncio.wait_for(runtime.wait("s-ended"), 120)  # on main: LoomrayUserError "not supervised"
    assert (again.output, again.turns, again.checkpoint_id) == ("ended done", first.turns, first.checkpoint_id)
    assert again.messages == first.messages and again.usage == first.usage
    assert (await runtime.wait("s-ended-cancelled")).stop_reason == "cancelled"
    with pytest.raises(LoomrayUserError, match="not supervised.*does not know it"):
        await runtime.wait("s-never-submitted-here")
