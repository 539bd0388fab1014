"""A loomray run submitted through Ray Jobs survives the loss of the node its session runs on.

The documented path: ``ray job submit --address http://HEAD:8265 -- loomray submit --wait ...``.
The job's entrypoint (``loomray submit --wait``, which finds the cluster through the
``RAY_ADDRESS`` Ray Jobs sets) hands the run to the store's supervisor and stays until
the run ends, so the job's status is the run's. The agent comes with the job
(``--runtime-env-json`` ``working_dir``: this directory, so ``ray_agents`` imports in the
entrypoint, the supervisor and the session actors it starts and restarts).

One module cluster: a head with the dashboard (Ray Jobs' HTTP API) on 127.0.0.1 and two
workers that alone have the ``loomray_session`` resource, so the session runs where a
node can be removed. Token authentication is on (as in the cluster configs). Ray Jobs needs ``ray[default]`` (the dashboard's dependencies):
without it this module fails, saying so, rather than skipping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loomray.testing import free_port, wait_for
from loomray.testing.cluster import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
RAY = BIN / "ray"
LOOMRAY = BIN / "loomray"
AGENT = "nodekill"  # ray_agents.make: TURNS slow tool passes, every model call logged to a file
TURNS = 8  # ray_agents.TURNS
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
RAY_AGENT_DEFAULT_PORT = 52365  # a node's dashboard agent, unless told otherwise


def _dashboard_deps_error() -> str | None:
    """Why Ray Jobs cannot run here (the dashboard's dependencies are missing), or None."""
    try:
        import ray.dashboard.optional_deps  # noqa: F401  - what Ray itself imports to decide (ray[default])
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None



@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """``(lc, dashboard url, client, agents dir)``: the cluster and a Ray Jobs client of it."""
    missing = _dashboard_deps_error()
    if missing:
        pytest.fail(f"Ray Jobs needs the dashboard, i.e. ray[default], in this environment ({sys.executable}): "
                    f"{missing}. Install it: pip install 'ray[default]'", pytrace=False)
    for tool in (RAY, LOOMRAY):
        assert tool.exists(), f"{tool} not found: run the tests with the Python of the environment loomray is in"
    from ray.job_submission import JobSubmissionClient

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # The entrypoint is a shell command on the head: `ray` and `loomray` of this environment first on its PATH.
    # Token authentication on, as the cluster configs run it: every process of the cluster, the
    # job's entrypoint and this client (which reads the same variables) use the token.
    env = {"PATH": os.pathsep.join([str(BIN), os.environ.get("PATH", "")]),
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # Another cluster's head on this machine (the other test worker's) holds Ray's default port for its
    # dashboard agent: Ray Jobs, served through this head's agent, must work all the same.
    with _port_held(RAY_AGENT_DEFAULT_PORT), local_cluster(
            num_nodes=3, connect=False, include_dashboard=True, env=env, worker_resources={"loomray_session": 100},
            head_node_args={"dashboard_host": "127.0.0.1", "dashboard_port": port}) as lc:
        # The dashboard is started with the head; its job API may answer a little later.
        client = wait_for(lambda: _client(JobSubmissionClient, url), timeout=30, interval=0.2,
                          what=f"the Ray Jobs API at {url}")
        yield lc, url, client, tmp_path_factory.mktemp("ray-jobs-agents")
    assert lc.leftover == []


@contextlib.contextmanager
def _port_held(port: int):
    """``port`` on 127.0.0.1 listened on for the duration (by this process, or already by another)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):  # in use: held by another process, as wanted
            s.bind(("127.0.0.1", port))
            s.listen()
        yield


def _client(cls, url):
    try:
        client = cls(url)
        client.list_jobs()
        return client
    except Exception:  # not listening yet, or not yet serving the job API
        return None


def _run(*args: str, timeout: float = 120, token: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and (token or not k.startswith("RAY_AUTH_"))}
    env["COLUMNS"] = "200"
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _last_json_object(text: str) -> dict:
    """The last pretty-printed JSON object in ``text`` (a ``--json`` report among a job's other log lines)."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    return json.loads("\n".join(lines[start:end + 1]))


def _latest_turn(store, session_id):
    rows = store.checkpoints.list(session_id, limit=1)
    return rows[0].turn if rows else -1


def test_job_run_survives_losing_its_sessions_node(jobs, tmp_path):
    from loomray.storage import open_store

    lc, url, client, agents_dir = jobs
    store_url = f"file://{tmp_path / 'store'}"
    sid, job_id = "s-job-nodekill", f"loomray-job-{os.getpid()}"
    workdir = agents_dir / AGENT  # ray_agents writes the call log and step markers here
    workdir.mkdir(parents=True)
    runtime_env = {"working_dir": str(HERE), "env_vars": {"LOOMRAY_RAY_TEST_DIR": str(agents_dir)}}

    submitted = _run(RAY, "job", "submit", "--address", url, "--submission-id", job_id, "--no-wait",
                     "--runtime-env-json", json.dumps(runtime_env), "--",
                     "loomray", "submit", "--wait", f"ray_agents:{AGENT}", "go", "--session", sid,
                     "--store", store_url, "--resources", '{"loomray_session": 1}', "--json")
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert job_id in submitted.stdout + submitted.stderr

    def job_status() -> str:
        return client.get_job_status(job_id).value

    def running(done) -> bool:
        status = job_status()
        if status in TERMINAL:
            raise AssertionError(f"job {job_id} ended {status} before its node was removed:\n"
                                 f"{client.get_job_logs(job_id)}")
        return done()

    # The Jobs API of a token cluster refuses a client without the token.
    refused = _run(RAY, "job", "list", "--address", url, token=False, timeout=60)
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and job_id not in refused.stdout and "RAY_AUTH_TOKEN" in said, said

    store = open_store(store_url)
    # Mid-run by the store's account (two passes checkpointed), then park it: every tool step holds
    # while the file `hold` exists, so the node goes while a step is in flight, not after the run.
    wait_for(lambda: running(lambda: _latest_turn(store, sid) >= 2), timeout=60, interval=0.05,
             what="the checkpoint of turn 2")
    (workdir / "hold").write_text("")
    wait_for(lambda: running(lambda: any(workdir.glob("holding-*"))), timeout=30, interval=0.05,
             what="the session to hold in a tool step")
    # Where the session runs, as an operator finds it: `loomray status --json` (the supervisor's view).
    status = _run(LOOMRAY, "status", "--store", store_url, "--address", lc.address, "--json")
    assert status.returncode == 0, status.stderr
    live = {s["session_id"]: s for s in json.loads(status.stdout)["sessions"]}[sid]
    assert live["status"] == "running" and live["epoch"] == 1, live
    victim = lc.node_of(live["node_id"])
    assert victim is not None and victim is not lc.head, (live, lc.node_ids())

    lc.remove_node(victim)  # SIGKILL its raylet: the session actor dies with the node
    (workdir / "hold").unlink()  # the next incarnation runs straight through

    final = wait_for(lambda: (s := job_status()) in TERMINAL and s, timeout=90, interval=0.2,
                     what=f"job {job_id} to end")
    logs = client.get_job_logs(job_id)
    assert final == "SUCCEEDED", logs
    # What Ray's own CLI says of the job (for JobStatus.SUCCEEDED it prints "Job '<id>' succeeded").
    shown = _run(RAY, "job", "status", job_id, "--address", url)
    said = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout + shown.stderr)
    assert shown.returncode == 0 and f"Job '{job_id}' succeeded" in said, said
    # The entrypoint's own report (submit --wait --json): the run completed, all its passes.
    report = _last_json_object(logs)
    assert (report["session_id"], report["status"], report["turns"]) == (sid, "completed", TURNS + 1), report
    assert report["output"] == f"{AGENT} finished"
    assert report["address"] == lc.address  # no --address given: the entrypoint found the cluster in RAY_ADDRESS

    # Restarted once, elsewhere, from the store: a second lease epoch, its checkpoints the newest.
    row = store.sessions.get(sid)
    assert (row.status, row.epoch) == ("completed", 2), row
    assert row.node_id != victim.node_id
    rows = store.checkpoints.list(sid, limit=None)
    assert rows[0].epoch == 2 and rows[0].turn == TURNS + 1, rows[0]
    assert {r.epoch for r in rows} == {1, 2}  # the first incarnation's checkpoints, then the second's
    assert max(r.turn for r in rows if r.epoch == 1) >= 2
    # Every scripted reply served exactly once across both incarnations: no model call repeated.
    calls = [int(x) for x in (workdir / "model-calls").read_text().split()]
    assert sorted(calls) == list(range(TURNS + 1)), calls
    # The first incarnation held in a step on the removed node; the second ran its steps elsewhere.
    assert len({p.name for p in workdir.glob("holding-*")}) == 1
    store.close()
