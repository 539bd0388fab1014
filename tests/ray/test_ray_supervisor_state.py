"""The supervisor's in-memory bookkeeping, without a cluster: bounded memory and the event buffer.

(Its behaviour on a cluster is in test_ray_runtime.py.)
"""

import asyncio
import time

import pytest

pytest.importorskip("ray")

from loomray.errors import LoomrayUserError  # noqa: E402
from loomray.runtime.actors import AgentSpec, RuntimeConfig, check_ref, set_agent_ref, store_key  # noqa: E402
from loomray.runtime.event_relay import EVENT_BUFFER, EventLog  # noqa: E402
from loomray.runtime.supervisor import Supervisor  # noqa: E402
from loomray.runtime.watcher import WatchedSession  # noqa: E402


def _watched(sid, finished_at=None):
    w = WatchedSession(sid, None, "{}", AgentSpec(ref="m:a"), done=asyncio.get_running_loop().create_future())
    if finished_at is not None:
        w.finished_at = finished_at
        w.done.set_result(None)
    return w


async def test_finished_sessions_are_forgotten_after_a_while(tmp_path):
    sup = Supervisor(RuntimeConfig(store_url=str(tmp_path), forget_after_s=60.0))
    now = time.monotonic()
    for sid, at in (("old", now - 61), ("recent", now - 1), ("running", None)):
        sup._sessions[(None, sid)] = _watched(sid, at)
        sup._events.logs[(None, sid)] = EventLog()
    sup._forget()
    assert set(k[1] for k in sup._sessions) == {"recent", "running"}
    assert set(k[1] for k in sup._events.logs) == {"recent", "running"}


async def test_event_log_is_bounded_and_reports_what_was_dropped():
    log = EventLog()
    log.extend([str(i) for i in range(EVENT_BUFFER + 5)])
    events, cursor, dropped = log.since(0)
    assert dropped == 5 and events[0] == "5" and cursor == EVENT_BUFFER + 5
    assert log.since(cursor) == ([], cursor, 0)


def test_agent_references_are_checked_before_anything_is_imported():
    assert check_ref("pkg.mod:agent.inner") == "pkg.mod:agent.inner"
    for bad in ("pkg.mod", ":agent", "pkg/mod:agent", "pkg.mod:agent()", "", None, "a b:c"):
        with pytest.raises(LoomrayUserError, match="must look like"):
            check_ref(bad)

    class Thing:
        pass

    assert set_agent_ref(Thing(), "m:a").loomray_ref == "m:a"
    with pytest.raises(LoomrayUserError):
        set_agent_ref(Thing(), "nope")
    with pytest.raises(TypeError, match="extra_tools"):
        AgentSpec.of("m:a", extra_tools=[print])
    assert AgentSpec.of("m:a") == AgentSpec(ref="m:a", payload=None)


def test_session_actor_options_default_to_zero_cpus_and_a_name_with_the_session():
    from loomray.runtime.actors import session_actor_options

    cfg = RuntimeConfig(store_url="/tmp/x")
    opts = session_actor_options(cfg, "sess-42", "alice")
    assert "sess-42" in opts["name"] and "alice" in opts["name"]
    assert (opts["num_cpus"], opts["lifetime"], opts["max_restarts"], opts["namespace"]) == (0, "detached", 0, "loomray")
    custom = RuntimeConfig(store_url="/tmp/x", actor_options={"num_cpus": 1, "resources": {"gpu_box": 1}})
    opts = session_actor_options(custom, "sess-42", None)
    assert opts["num_cpus"] == 1 and opts["resources"] == {"gpu_box": 1}
    assert opts["name"] == f"loomray:{store_key('/tmp/x')}:_:sess-42"


def test_actor_names_carry_the_store_so_two_stores_share_a_cluster():
    from loomray.runtime.actors import session_actor_name, supervisor_name
    from loomray.runtime.hosts import host_actor_name

    a, b = "file:///tmp/store-a", "file:///tmp/store-b"
    assert supervisor_name(a) != supervisor_name(b) and supervisor_name(a) == supervisor_name(a)
    assert session_actor_name(a, "s1") != session_actor_name(b, "s1")
    assert host_actor_name(b).startswith(f"loomray/host/{store_key(b)}/")


@pytest.mark.parametrize("options, match", [
    ("not a dict", "must be a dict"),
    ({"name": "mine"}, "may not set name"),
    ({"lifetime": "detached", "max_restarts": 3}, "may not set lifetime, max_restarts"),
    ({"bogus": 1}, "Invalid option keyword bogus"),
    ({"num_cpus": -1}, "cannot be negative"),
    ({"resources": {"CPU": 1}}, "num_cpus"),
    ({"runtime_env": "pip"}, "runtime_env"),
])
def test_bad_actor_options_fail_when_the_config_is_built(options, match):
    with pytest.raises(LoomrayUserError, match=match):
        RuntimeConfig(store_url="/tmp/x", actor_options=options)


def test_only_json_options_are_stored_with_a_session():
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from loomray.runtime.stored_options import storable_options

    opts = {"resources": {"loomray_session": 1}, "runtime_env": {"env_vars": {"A": "1"}}, "num_cpus": 0.5,
            "scheduling_strategy": NodeAffinitySchedulingStrategy("ab" * 28, soft=True)}
    assert storable_options(opts) == {"resources": {"loomray_session": 1}, "runtime_env": {"env_vars": {"A": "1"}},
                                      "num_cpus": 0.5}
