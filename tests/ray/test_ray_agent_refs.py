"""Path 8: the store does not choose what the supervisor imports or which session a request runs in.

No cluster: the supervisor's adoption pass runs against a local store, with
Ray's actor lookup and the session watcher stubbed out (a watched session is
one the supervisor would restart). Its behaviour on a cluster is in
test_ray_runtime.py.
"""

import asyncio
import json
import sys
from datetime import datetime, timezone

import pytest

ray = pytest.importorskip("ray")

from loomray.errors import LoomrayUserError  # noqa: E402
from loomray.runtime.actors import AgentSpec, RuntimeConfig  # noqa: E402
from loomray.runtime.supervisor import Supervisor  # noqa: E402
from loomray.session import RunRequest  # noqa: E402
from loomray.storage import SessionRow  # noqa: E402


@pytest.fixture
def supervisor(tmp_path, monkeypatch):
    """A supervisor on a local store whose adoption restarts nothing: it records what it would watch."""
    def make(*allowed):
        sup = Supervisor(RuntimeConfig(store_url=str(tmp_path / "store")))
        if allowed:
            sup.allow(allowed)  # what `loomray supervise --allow-agent` gives it

        def no_actor(*a, **kw):
            raise ValueError("no such actor")

        async def no_handle(w):
            return None

        async def watch(w):
            sup.watched.append(w)

        monkeypatch.setattr(ray, "get_actor", no_actor)
        monkeypatch.setattr(sup._watcher, "attach", no_handle)
        monkeypatch.setattr(sup._watcher, "watch", watch)
        sup.watched = []
        return sup

    return make


def _running_row(session_id, agent_ref, spec_json=None, run_id="r1"):
    return SessionRow(session_id, None, "running", datetime.now(timezone.utc), run_id=run_id, agent_ref=agent_ref,
                      spec_json=spec_json, epoch=1, node_id="node-of-a-lost-cluster")


async def _adopt(sup):
    adopted = await sup._adopt(foreign=True)
    await asyncio.sleep(0)  # let the (stub) watcher tasks run
    return adopted


async def test_path08_a_reference_nobody_allowed_is_never_imported(supervisor):
    sup = supervisor()  # the operator allowed nothing, and nothing was submitted here
    store = sup._store
    spec = RunRequest(prompt="go", session_id="s-evil").model_dump_json()
    store.sessions.put(_running_row("s-evil", "evil_mod_path08:agent", spec_json=spec))  # as rows were written
    assert await _adopt(sup) == [] and sup.watched == []
    refused = store.sessions.get("s-evil")
    assert refused.status == "failed" and "evil_mod_path08:agent" in refused.error and "not allowed" in refused.error
    assert "evil_mod_path08" not in sys.modules
    assert await _adopt(sup) == []  # refused once, not again every pass


async def test_path08_adoption_imports_only_allowed_agent_references(supervisor):
    sup = supervisor("okpkg.*:agent")
    store = sup._store
    for sid, ref in (("s-ok", "okpkg.agents:agent"), ("s-evil", "evil_mod_path08:agent")):
        spec = RunRequest(prompt="go", session_id=sid).model_dump_json()
        store.sessions.put(_running_row(sid, ref, spec_json=spec))
    assert await _adopt(sup) == ["s-ok"]
    assert [w.agent.ref for w in sup.watched] == ["okpkg.agents:agent"]
    assert store.sessions.get("s-evil").status == "failed"


async def test_path08_request_for_another_session_is_refused(supervisor):
    sup = supervisor()
    store = sup._store
    forged = RunRequest(prompt="transfer everything", session_id="s-other", user_id="bob").model_dump_json()
    store.sessions.put(_running_row("s-victim", None, spec_json=forged))
    assert await _adopt(sup) == [] and sup.watched == []
    row = store.sessions.get("s-victim")
    assert row.status == "failed" and "'s-other'" in row.error
    assert store.sessions.get("s-other", user_id="bob") is None


async def test_path08_adoption_reads_the_request_from_the_run_record(supervisor):
    sup = supervisor("okpkg.*:agent")
    store = sup._store
    good = RunRequest(prompt="go", session_id="s-rec", metadata={"token": "t"})
    store.runs.create("s-rec", run_id="r1", request=json.loads(good.model_dump_json()))
    store.sessions.put(_running_row("s-rec", "okpkg.agents:agent"))  # no request in the index row
    other = RunRequest(prompt="go", session_id="s-elsewhere")
    store.runs.create("s-bad", run_id="r1", request=json.loads(other.model_dump_json()))
    store.sessions.put(_running_row("s-bad", "okpkg.agents:agent"))
    assert await _adopt(sup) == ["s-rec"]
    assert RunRequest.model_validate_json(sup.watched[0].request_json) == good
    assert store.sessions.get("s-bad").status == "failed"


async def test_path08_submitted_and_operator_allowed_references(tmp_path):
    from loomray.runtime import RayRuntime
    from loomray.runtime.actors import agent_ref_allowed, check_pattern

    assert agent_ref_allowed("examples.demo_agent:agent", ["examples.*:agent"])
    assert not agent_ref_allowed("examples.demo_agent:agent()", ["examples.*"])
    assert not agent_ref_allowed("other:agent", ["examples.*:agent"])
    for bad in ("examples", "a:b:c", "", "a b:c"):
        with pytest.raises(LoomrayUserError, match="allowed agent pattern"):
            check_pattern(bad)
    with pytest.raises(TypeError):
        RuntimeConfig(store_url="x", allowed_agents="pkg:agent")
    # A runtime adds what it submits, so a supervisor it (re)creates may adopt those sessions.
    rt = RayRuntime(tmp_path / "store", allowed_agents=["ops.*:agent"])
    rt._allow(AgentSpec(ref="mine.agents:agent"))
    rt._allow(AgentSpec(ref="ops.x:agent"))  # already covered by a pattern
    assert rt.config.allowed_agents == ("ops.*:agent", "mine.agents:agent")
    sup = Supervisor(rt.config)
    assert sup._adoption.allows("mine.agents:agent") and not sup._adoption.allows("evil:agent")
    sup.allow(["evil:agent"])  # what ready(allow=...) does for `loomray supervise --allow-agent`
    assert sup._adoption.allows("evil:agent")
    rt.close()
