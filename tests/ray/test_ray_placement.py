"""Dense placement and the supervisor's periodic pass, without a cluster.

The placement rule (which host, which nodes, how many hosts) is pure and
tested on made-up nodes; the periodic pass runs against a local-directory
store wrapped to count object reads, with Ray's node list and the session
watchers stubbed. Their behaviour on a cluster is in test_ray_runtime.py.
"""

import asyncio
import json
from datetime import datetime, timedelta, timezone

import pytest

ray = pytest.importorskip("ray")

from loomray.runtime.actors import RuntimeConfig  # noqa: E402
from loomray.runtime.placement_rules import (  # noqa: E402
    HostRecord,
    demand_of,
    eligible,
    host_options,
    hosts_wanted,
    pick,
)
from loomray.runtime.ray_runtime import check_placement  # noqa: E402
from loomray.runtime.supervisor import Supervisor  # noqa: E402
from loomray.session import RunRequest  # noqa: E402
from loomray.storage import ObjectStore, SessionRow, Store  # noqa: E402
from loomray.storage.localdir import LocalObjectStore  # noqa: E402


def _node(node_id, cpus=2, alive=True, **resources):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": float(cpus), **resources}}


def _hosts(layout):
    """HostRecords from ``{node_id: hosts on it}``."""
    return [HostRecord(name=f"{n}-h{i}", pool_key="k", handle=None, node_id=n)
            for n, count in layout.items() for i in range(count)]


def test_placement_spreads_by_load_over_hosts_and_nodes():
    hosts = _hosts({"a": 2, "b": 2})
    for _ in range(100):
        pick(hosts, capacity=1000).load += 1
    assert [h.load for h in hosts] == [25, 25, 25, 25]
    # A host that already carries more gets the next sessions only once the others caught up.
    hosts[0].load += 10
    chosen = [pick(hosts, capacity=1000) for _ in range(3)]
    for h in chosen:
        h.load += 1
    assert hosts[0] not in chosen


def test_placement_avoids_the_lost_node_and_full_or_dead_hosts():
    hosts = _hosts({"a": 1, "b": 1})
    assert pick(hosts, capacity=10, avoid_node="a").node_id == "b"
    hosts[1].alive = False
    assert pick(hosts, capacity=10, avoid_node="a").node_id == "a"  # soft: better there than nowhere
    hosts[0].load = 10
    assert pick(hosts, capacity=10) is None  # full: the pool opens another host
    hosts[0].load = 0
    assert pick(hosts, capacity=10, exclude={"a-h0"}) is None


def test_hosts_follow_actor_options_resources_and_cpus():
    cfg = RuntimeConfig(store_url="/tmp/x", placement="dense", actor_options={"resources": {"loomray_session": 1}})
    key, options = host_options(cfg)
    assert options == {"num_cpus": 0, "resources": {"loomray_session": 1}}
    demand = demand_of(options)
    assert demand == {"loomray_session": 1.0}
    head, worker, dead = _node("head", 2), _node("w", 4, loomray_session=100), _node("d", 4, False, loomray_session=1)
    assert [eligible(n, demand) for n in (head, worker, dead)] == [False, True, False]
    assert hosts_wanted(worker, cfg) == 4  # one per CPU by default
    assert hosts_wanted(_node("z", 0), cfg) == 1
    assert hosts_wanted(worker, RuntimeConfig(store_url="/tmp/x", hosts_per_node=2)) == 2
    # Never more hosts than the node's totals fit: the extra one would wait for, then hold, a unit.
    assert hosts_wanted(_node("one", 4, loomray_session=1), cfg, demand) == 1
    assert hosts_wanted(worker, cfg, demand) == 4
    gpu = demand_of(host_options(RuntimeConfig(store_url="/tmp/x", actor_options={"num_gpus": 1}))[1])
    assert not eligible(worker, gpu) and eligible(_node("g", 2, GPU=1.0), gpu)
    # Same options, same pool; other resources, another pool.
    assert host_options(RuntimeConfig(store_url="/tmp/y", actor_options={"resources": {"loomray_session": 1}}))[0] == key
    assert host_options(RuntimeConfig(store_url="/tmp/x"))[0] != key


def test_placement_options_are_checked():
    check_placement("dense", 2, 10)
    for bad in (("nowhere",), ("dense", 0), ("dense", None, 0), ("dense", True)):
        with pytest.raises(ValueError):
            check_placement(*bad)


class CountingObjects(ObjectStore):
    """A local-directory object store that counts reads (GET and LIST) by key prefix."""

    backend = "file"

    def __init__(self, root):
        self.inner = LocalObjectStore(root)
        self.gets, self.lists = [], []

    def put(self, **kw):
        return self.inner.put(**kw)

    def get(self, *, key):
        self.gets.append(key)
        return self.inner.get(key=key)

    def list(self, *, prefix):
        self.lists.append(prefix)
        return self.inner.list(prefix=prefix)

    def list_dirs(self, *, prefix):
        self.lists.append(prefix)
        return self.inner.list_dirs(prefix=prefix)

    def delete(self, *, keys):
        return self.inner.delete(keys=keys)

    def describe(self, key=None):
        return self.inner.describe(key)

    def reset(self):
        self.gets.clear()
        self.lists.clear()


@pytest.mark.timeout(120)
async def test_periodic_pass_reads_only_active_sessions(tmp_path, monkeypatch):
    """10,000 finished sessions in the index and 10 active ones: a pass does < 100 object reads."""
    root = tmp_path / "store"
    objects = CountingObjects(root)
    store = Store(objects, f"file://{objects.inner.root}")
    now = datetime.now(timezone.utc)
    for i in range(10_000):
        store.sessions.put(SessionRow(f"done-{i:05d}", None, "completed", now, run_id="r1", agent_ref="m.agents:a",
                                     epoch=1, node_id="node-1"))
    active = [f"live-{i}" for i in range(10)]
    for sid in active:
        # What a supervisor's submit and the session's actor write: a mark, then a running row.
        store.active.put(sid, data=json.dumps({"placement": "dense",
                                               "since": (now - timedelta(seconds=5)).isoformat()}).encode())
        spec = RunRequest(prompt="go", session_id=sid).model_dump_json()
        store.sessions.put(SessionRow(sid, None, "running", now, run_id="r1", agent_ref="m.agents:a", spec_json=spec,
                                     epoch=1, node_id="node-1"))
        store.leases.acquire(sid, owner="test")
    # A stale mark: its session finished after it was marked (a supervisor died before clearing it).
    store.active.put("done-00001", data=json.dumps({"since": (now - timedelta(hours=1)).isoformat()}).encode())

    monkeypatch.setattr(RuntimeConfig, "open_store", lambda self: store)
    sup = Supervisor(RuntimeConfig(store_url=str(root), allowed_agents=("m.agents:*",)))
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "node-1", "Alive": True}])
    watched = []

    async def no_handle(w):
        return None  # gone: the watcher would restart it

    async def watch(w):
        watched.append(w)  # the session stays watched: its done future never resolves here

    monkeypatch.setattr(sup._watcher, "attach", no_handle)
    monkeypatch.setattr(sup._watcher, "watch", watch)

    objects.reset()
    adopted = await sup._adopt()
    await asyncio.sleep(0)
    assert sorted(adopted) == active
    assert {w.config.placement for w in watched} == {"dense"}  # restarted the way they ran
    assert len(objects.gets) < 100, f"{len(objects.gets)} GETs: {sorted(set(k.split('/')[0] for k in objects.gets))}"
    assert len(objects.lists) < 100
    assert not any(k.startswith("index/sessions/user=_/session=done-") and "done-00001" not in k
                   for k in objects.gets + objects.lists)
    assert (None, "done-00001") not in store.active.list()  # the stale mark is gone

    # The next pass: every active session is watched here, so it is one LIST and nothing else.
    objects.reset()
    assert await sup._adopt() == []
    assert (len(objects.gets), len(objects.lists)) == (0, 1)


async def test_placement_prefers_warm_hosts_until_they_are_much_busier():
    from loomray.runtime.placement_rules import STARTING_PENALTY

    hosts = _hosts({"a": 1, "b": 1})
    warm, starting = hosts
    warm.ready = asyncio.get_running_loop().create_future()
    warm.ready.set_result(None)
    starting.ready = asyncio.get_running_loop().create_future()  # its process is still starting
    for _ in range(STARTING_PENALTY):
        pick(hosts, capacity=1000).load += 1
    assert (warm.load, starting.load) == (STARTING_PENALTY, 0)  # no fork waits for a process start
    pick(hosts, capacity=1000).load += 1
    pick(hosts, capacity=1000).load += 1
    assert starting.load >= 1  # then it shares the load
    starting.ready.cancel()


def test_a_frozen_executor_finishes_what_it_took_and_starts_nothing_new():
    """What a host or session actor does when its raylet dies: the writes under way land, no new one starts."""
    import threading

    from loomray.runtime.raylet_watch import DrainableExecutor, raylet_pid

    assert raylet_pid() is None  # this test process was not started by a raylet: no watchdog here
    release, ran = threading.Event(), []
    executor = DrainableExecutor(max_workers=2)
    under_way = executor.submit(lambda: release.wait(10) and ran.append("under way"))
    pending = executor.freeze()
    assert pending == [under_way]
    late = executor.submit(ran.append, "late")
    release.set()
    assert under_way.result(timeout=10) is None and ran == ["under way"]
    assert not late.done()  # never runs: its caller is being stopped
    executor.shutdown(wait=True)



async def test_a_write_is_in_the_executor_before_a_node_loss_freeze_can_run():
    """The watchdog of a lost node freezes the executor from the event loop. A journal write started
    right after a model answer arrived must be in the executor by then (in the same tick), or the record
    is lost and the new incarnation bills the call again: the bench's node-loss run once counted that."""
    from loomray.run_writes import InflightWrites
    from loomray.runtime.raylet_watch import DrainableExecutor

    loop = asyncio.get_running_loop()
    executor = DrainableExecutor(max_workers=2)
    loop.set_default_executor(executor)
    ran: list[str] = []
    loop.call_soon(executor.freeze)  # runs on the loop's next tick, as the watchdog would
    # Awaited in this task (a wait_for would start it in a task of its own, a tick late); a write submitted
    # after the freeze never runs, so a deadline cancels this test instead of letting it hang.
    deadline = loop.call_later(10, asyncio.current_task().cancel)
    await InflightWrites().run(ran.append, "t0000-model")
    deadline.cancel()
    assert ran == ["t0000-model"]
    assert executor.submit(ran.append, "late") is not None and ran == ["t0000-model"]  # frozen from then on
    executor.shutdown(wait=True)


def test_an_actor_that_died_with_its_node_is_told_from_one_that_crashed():
    """A host lost with its node is a node loss, charged as always; one that died with its node up crashed."""
    from ray.exceptions import ActorDiedError

    from loomray.runtime.watcher import died_with_its_node

    lost = ActorDiedError()
    lost.error_msg = "The actor died because its node has died. Node Id: 07f8\\n\\tthe actor's node was terminated"
    assert died_with_its_node(lost)
    assert not died_with_its_node(ActorDiedError())  # died before it started for another reason
    assert not died_with_its_node(RuntimeError("its node has died"))


async def test_a_lease_newer_than_its_row_is_adopted_once_its_owner_stays_silent(tmp_path, monkeypatch):
    """An incarnation took the lease and died before its first status row, with no supervisor to see it (the
    chaos checker's seed 7): the row's epoch stays behind the lease's. A live owner writes its row at once, so
    the supervisor waits ``OWNER_SILENT_S``, then adopts (the new epoch fences a late owner anyway)."""
    from loomray.runtime import adoption
    from loomray.storage import open_store

    store = open_store(str(tmp_path / "store"))
    now = datetime.now(timezone.utc)
    spec = RunRequest(prompt="go", session_id="s-silent").model_dump_json()
    store.sessions.put(SessionRow("s-silent", None, "running", now, run_id="r1", agent_ref="m.agents:a",
                                 spec_json=spec, epoch=1, node_id="node-1"))
    store.leases.acquire("s-silent", owner="first")
    store.leases.acquire("s-silent", owner="second, died before its row")
    assert store.leases.current_epoch("s-silent") == 2
    policy = adoption.AdoptionPolicy(RuntimeConfig(store_url=str(tmp_path / "store"),
                                                   allowed_agents=("m.agents:*",)), store)
    row = store.sessions.get("s-silent")

    assert await policy.review(row, {}, None, None) is None  # its owner may be about to write its row
    monkeypatch.setattr(adoption, "OWNER_SILENT_S", 0.0)
    adopted = await policy.review(row, {}, None, None)
    assert adopted is not None and adopted.session_id == "s-silent"
