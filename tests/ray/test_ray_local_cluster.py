"""loomray.testing.cluster.local_cluster: loopback nodes, pinning, node removal, clean teardown.

On the 3-node cluster tests/ray/conftest.py shares between modules (a start costs ~5 s on CI's 2 cores):
its reset gives this module a head and two live workers, and its teardown, at the end of the session,
checks that stopping it left nothing running.
"""

import os

import pytest

from loomray.testing import pid_alive, wait_for
from loomray.testing.cluster import node_resource, wait_until_dead

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray


@ray.remote(num_cpus=0)
class Probe:
    """Reports where it runs; ``hang`` stands for a long agent loop in flight."""

    def where(self):
        return os.getpid(), ray.get_runtime_context().get_node_id()

    async def hang(self):
        import asyncio

        await asyncio.Event().wait()


@pytest.fixture(scope="module")
def lc(shared_cluster):
    return shared_cluster.lc




def test_three_nodes_on_loopback(lc):
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    assert lc.alive_node_ids() == set(lc.node_ids())
    assert lc.address.startswith("127.0.0.1:")


def test_killed_node_takes_its_actor_down(lc):
    victim = lc.workers[0]
    actor = Probe.options(scheduling_strategy=lc.pin(victim)).remote()
    pid, node_id = ray.get(actor.where.remote(), timeout=60)
    assert node_id == victim.node_id
    in_flight = actor.hang.remote()

    lc.remove_node(victim)  # SIGKILL the raylet: a machine vanishing

    err = wait_until_dead(actor, timeout=15)
    assert isinstance(err, ray.exceptions.ActorDiedError)
    with pytest.raises(ray.exceptions.ActorDiedError):
        ray.get(in_flight, timeout=15)
    wait_for(lambda: not pid_alive(pid), timeout=15, what=f"actor process {pid} to exit")
    wait_for(lambda: victim.node_id not in lc.alive_node_ids(), timeout=15, what="GCS to mark the node dead")


def test_custom_resource_pin_and_graceful_removal(lc):
    node = lc.add_node()
    # Numbered by add order, never reused: one past every node added before it, removed ones included.
    index = lc.node_index(node.node_id)
    assert index == 1 + max(lc.node_index(n.node_id) for n in lc.nodes[:-1] + lc.removed)
    assert lc.resource_of(node) == node_resource(index)
    actor = Probe.options(resources={lc.resource_of(node): 0.01}).remote()
    pid, node_id = ray.get(actor.where.remote(), timeout=60)
    assert node_id == node.node_id

    lc.remove_node(node, graceful=True)

    # A draining raylet reports its actors dead at once and takes their processes down.
    wait_until_dead(actor, timeout=10)
    wait_for(lambda: not pid_alive(pid), timeout=10, what=f"actor process {pid} to exit")


def test_head_node_cannot_be_removed(lc):
    with pytest.raises(ValueError, match="head node"):
        lc.remove_node(lc.head)


def test_adding_a_node_off_the_main_thread_is_a_clear_error(lc):
    # Ray's node start sets signal handlers; from a worker thread it used to fail halfway with a bare
    # ValueError about signals, which the chaos checker took for a fault that found nothing to break.
    import threading

    before = list(lc.workers)
    raised = []
    t = threading.Thread(target=lambda: _capture(lc.add_node, raised))
    t.start()
    t.join(timeout=60)
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError), raised
    assert "main thread" in str(raised[0])
    assert lc.workers == before


def _capture(fn, into):
    try:
        fn()
    except BaseException as e:
        into.append(e)
