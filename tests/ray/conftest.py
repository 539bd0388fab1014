"""One 3-node Ray cluster shared by the test modules that can share it (``shared_cluster``).

Starting a cluster costs ~6 s on CI's 2 cores and stopping it ~1.5 s; test_ray_submit,
test_ray_local_cluster, test_ray_runtime and test_ray_steering each used to start their own, all of
the same shape: a head and two workers that alone have the ``loomray_session`` resource (so removing
a worker really takes a session down), on 127.0.0.1, with tuned failure detection. Now they share
one, and between modules ``LocalCluster.reset`` makes it look freshly started: every loomray actor
(supervisors, hosts, sessions) killed and two live workers again, whatever the module's
node removals and additions left. Each module keeps a store of its own.

Modules that need a cluster of another kind keep their own: token authentication (test_ray_jobs,
tests/cli/test_cli_ray), the dashboard (test_ray_jobs), job-level runtime_env and metrics settings
(test_ray_metrics), a cluster in a subprocess (test_ray_local_sh, the bench and example smokes).
Those that connect this process to Ray cannot run while the shared cluster is connected, so the
modules that share it run last (``pytest_collection_modifyitems``), and the cluster stops at the end
of the session, where its teardown checks that every process it started exited by itself.

The workers' environment is the union of what the modules set: ``tests/ray`` on ``PYTHONPATH``
(``ray_agents`` by reference), ``LOOMRAY_RAY_TEST_DIR`` (``ray_agents``' marker files),
``LOOMRAY_FANOUT_TEST_DIR`` (test_ray_submit's gated step), and ``LOOMRAY_CANCEL_POLL_S=60`` (only
``RayRuntime.cancel``'s direct path can stop a run within test_ray_steering's deadline; no other
module cancels).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
#: Workers of the shared cluster (besides its head): what every module using it starts from.
WORKERS = 2


@dataclass
class Shared:
    """The shared cluster and the directories its workers' environment names."""

    lc: object  # loomray.testing.cluster.LocalCluster (imported lazily: importing it imports Ray)
    agents: Path
    fanout: Path


def pytest_collection_modifyitems(session, config, items):
    """Modules that use the shared cluster run last, in their usual order (whole modules move)."""
    shared = {getattr(i, "module", None) for i in items if "shared_cluster" in getattr(i, "fixturenames", ())}
    shared.discard(None)
    if shared:
        last = [i for i in items if getattr(i, "module", None) in shared]
        items[:] = [i for i in items if getattr(i, "module", None) not in shared] + last


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    from loomray.testing.cluster import local_cluster

    root = tmp_path_factory.mktemp("ray-shared")
    agents, fanout = root / "agents", root / "fanout"
    fanout.mkdir()
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": pythonpath, "LOOMRAY_RAY_TEST_DIR": str(agents), "LOOMRAY_FANOUT_TEST_DIR": str(fanout),
           "LOOMRAY_CANCEL_POLL_S": "60"}
    cluster = local_cluster(num_nodes=1 + WORKERS, namespace="loomray", worker_resources={"loomray_session": 100},
                            env=env)
    lc = cluster.__enter__()
    yield Shared(lc, agents, fanout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cluster.__exit__(None, None, None)
    # Teardown left nothing running: every raylet, GCS and worker exited by itself.
    assert lc.leftover == [], f"processes had to be killed: {lc.leftover}"
    assert not lc.any_started_alive()
    assert not [w for w in caught if "leftover" in str(w.message)]


@pytest.fixture(scope="module")
def shared_cluster(ray_cluster):
    """The shared cluster as a module finds it: no loomray actor, a head and two live workers."""
    yield ray_cluster
    ray_cluster.lc.reset(WORKERS)


@pytest.fixture(autouse=True)
def _workers_topped_up(request):
    """After each test of a module on the shared cluster, two workers again even if the test failed
    before adding back the node it removed (one failure must not starve every later test of nodes)."""
    lc = request.getfixturevalue("ray_cluster").lc if "shared_cluster" in request.fixturenames else None
    yield
    if lc is not None:
        while len(lc.workers) < WORKERS:
            lc.add_node()
