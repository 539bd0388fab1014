"""The cluster-side command line against one real local Ray cluster (subprocesses of ``loomray``).

The cluster (head + one worker, 127.0.0.1) lives in this test process; every
command is a separate ``loomray`` process that joins it with ``--address``, as
a user's shell would (forked from a process that imported loomray, ``tests/forked.py``;
``supervise``, which a Ctrl-C stops, runs the console script itself). The agent is ``examples.demo_agent:agent`` (offline
research model, 8 passes, 0.8 s per model call here), imported by reference on the
workers (``PYTHONPATH`` = the repository, as the README asks of a cluster).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forked import run_loomray

from loomray.runtime.actors import session_actor_name, supervisor_name
from loomray.runtime.connection import normalize_store_url
from loomray.testing import wait_for
from loomray.testing.cluster import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
LOOMRAY = Path(sys.executable).with_name("loomray")
CMD = [str(LOOMRAY)] if LOOMRAY.exists() else [sys.executable, "-m", "loomray.cli"]
REF = "examples.demo_agent:agent"
TURNS = 9  # 8 research passes + the report


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    store = tmp_path_factory.mktemp("cli-ray") / "store"
    agents_dir = tmp_path_factory.mktemp("cli-ray-agents")
    pythonpath = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "ray"), os.environ.get("PYTHONPATH"))
                                 if p)
    # The delay reaches the workers (through the raylets' environment) and the CLI processes alike.
    # The worker (not the head) has the loomray_session resource, as on a real cluster; and Ray's token
    # authentication is on, as the cluster configs set it up: every command below passes it.
    env = {"PYTHONPATH": pythonpath, "LOOMRAY_DEMO_DELAY": "0.8", "LOOMRAY_RAY_TEST_DIR": str(agents_dir),
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with local_cluster(num_nodes=2, connect=False, env=env, worker_resources={"loomray_session": 100}) as lc:
        yield lc.address, store, lc, agents_dir
    assert lc.leftover == []


def cli(cluster, *args: str, address: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    addr, store = cluster[:2]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(LOOMRAY_STORE=str(store), COLUMNS="200")
    extra = ["--address", addr] if address else []
    return run_loomray([*args, *extra], env=env, cwd=REPO, timeout=timeout)


def ok_json(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    return json.loads(out.stdout)


def store_of(cluster):
    from loomray.storage import open_store

    return open_store(cluster[1])


def test_submit_returns_at_once_and_the_run_goes_on_without_it(cluster):
    from datetime import datetime, timezone

    info = ok_json(cli(cluster, "submit", REF, "Durable agents", "--session", "s-sub", "--json"))
    exited_at = datetime.now(timezone.utc)
    assert info["session_id"] == "s-sub" and info["agent_ref"] == REF
    store = store_of(cluster)
    wait_for(lambda: (store.sessions.get("s-sub") or None) and store.sessions.get("s-sub").status == "completed",
             timeout=90, interval=0.2, what="the submitted run to complete")
    rows = store.checkpoints.list("s-sub", limit=50)
    assert rows[0].turn == TURNS and rows[0].execution_status == "completed"
    # The run (9 model calls x 0.8 s) finished after the submitting process had exited: nobody waited for it.
    assert rows[0].created_at > exited_at, (rows[0].created_at, exited_at)
    assert any(r.created_at > exited_at for r in rows[1:])  # and it was still mid-run then
    row = store.sessions.get("s-sub")
    assert row.agent_ref == REF and row.node_id  # run by a Ray actor, restartable by reference


def test_the_cluster_refuses_a_client_without_its_token(cluster):
    script = (f"import ray\nray.init(address={cluster[0]!r}, logging_level='ERROR')\n"
              "print(len(ray.nodes()))")
    for token in ("0" * 64, None):  # a wrong token, and none at all
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
        env["HOME"] = str(cluster[3])  # no ~/.ray/auth_token to fall back on
        # ray.init retries a refused connection 20 times, a second apart: the first refusal is the answer.
        env["RAY_NUM_REDIS_GET_RETRIES"] = "2"
        if token:
            env["RAY_AUTH_TOKEN"] = token
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                             cwd=REPO)
        assert out.returncode != 0, out.stdout
        assert "auth" in out.stderr.lower(), out.stderr[-2000:]


def test_submit_twice_while_running_is_a_one_line_error(cluster):
    ok_json(cli(cluster, "submit", REF, "Busy", "--session", "s-busy", "--json"))
    again = cli(cluster, "submit", REF, "Busy", "--session", "s-busy")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    lines = [ln for ln in again.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "already running" in lines[0], again.stderr


def test_status_from_the_supervisor_and_from_the_index(cluster):
    live = ok_json(cli(cluster, "status", "--json"))
    assert live["source"] == "supervisor+index"
    by_id = {s["session_id"]: s for s in live["sessions"]}
    assert by_id["s-sub"]["status"] == "completed" and by_id["s-sub"]["supervised"] is True
    assert by_id["s-sub"]["turn"] == TURNS and by_id["s-sub"]["incarnation"] == 1
    offline = ok_json(cli(cluster, "status", "--json", address=False))
    assert offline["source"] == "index"
    assert {s["session_id"]: s["status"] for s in offline["sessions"]}["s-sub"] == "completed"
    table = cli(cluster, "status")
    assert table.returncode == 0 and "s-sub" in table.stdout and "completed" in table.stdout


def test_fork_on_the_cluster_shows_progress(cluster):
    store = store_of(cluster)
    base = next(r for r in store.checkpoints.list("s-sub", limit=50) if r.turn == 3)
    out = cli(cluster, "fork", "s-sub", "--from", base.checkpoint_id, "--prompt", "Costs?", "--prompt", "Risks?",
              "--json")
    forks = ok_json(out)
    assert "fork 1: Costs?" in out.stderr and "fork 2: Risks?" in out.stderr  # the progress display
    assert [f["prompt"] for f in forks] == ["Costs?", "Risks?"]
    for f in forks:
        assert f["model_calls"] == TURNS - 3  # only what comes after the fork point
        row = store.sessions.get(f["session_id"])
        assert row.node_id and row.agent_ref == REF  # ran in a Ray actor, by the stored reference
        assert store.checkpoints.list(f["session_id"], limit=1)[0].forked_from == "s-sub"


def test_dense_placement_from_the_cli_and_status_shows_the_host(cluster):
    store = store_of(cluster)
    base = next(r for r in store.checkpoints.list("s-sub", limit=50) if r.turn == 6)
    forks = ok_json(cli(cluster, "fork", "s-sub", "--from", base.checkpoint_id, "--prompt", "Dense?",
                        "--placement", "dense", "--json"))
    sid = forks[0]["session_id"]
    live = {s["session_id"]: s for s in ok_json(cli(cluster, "status", "--json"))["sessions"]}
    assert live[sid]["placement"] == "dense" and live[sid]["host"].startswith("loomray/host/")
    assert live[sid]["node_id"] == store.sessions.get(sid).node_id
    assert live["s-sub"]["placement"] == "actor"
    assert live["s-sub"]["host"] == session_actor_name(normalize_store_url(str(cluster[1])), "s-sub")
    table = cli(cluster, "status")
    assert table.returncode == 0 and "host/" in table.stdout


def test_resume_on_the_cluster_continues_in_place(cluster):
    res = ok_json(cli(cluster, "resume", "s-sub", "Add a section on costs.", "--json"))
    assert res["session_id"] == "s-sub" and res["resumed_from_checkpoint"] is True
    assert res["turns"] == TURNS + 4 and res["model_calls"] == 4
    row = store_of(cluster).sessions.get("s-sub")
    assert row.status == "completed" and row.node_id


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_supervise_runs_in_the_foreground_until_ctrl_c(cluster, stop_signal):
    """It stops on Ctrl-C or SIGTERM, even when started by a parent that ignores SIGINT (a shell's background
    job), where Python's own Ctrl-C handling is off."""
    addr, store = cluster[:2]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([*CMD, "supervise", "--store", str(store), "--address", addr, "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "supervisor ready" in line:
                break
        assert any("supervisor ready" in ln for ln in seen), seen
        proc.send_signal(stop_signal)
        try:
            rest, _ = proc.communicate(timeout=90)  # a clean exit, however loaded the machine
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the output below
            time.sleep(2)
            proc.kill()
            rest, _ = proc.communicate()
            pytest.fail(f"supervise did not exit within 90 s of Ctrl-C; its output after it:\n{rest}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert "stopped" in rest and "Traceback" not in rest


def in_ray(cluster, code: str) -> str:
    """Run ``code`` in a fresh Python process joined to the cluster (namespace ``loomray``); its stdout."""
    script = f"import ray\nray.init(address={cluster[0]!r}, namespace='loomray', logging_level='ERROR')\n{code}"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_two_stores_get_two_supervisors_and_stored_resources_survive_node_loss_and_adoption(cluster):
    """Two stores on one cluster, each session submitted with --resources: node loss restarts both on the
    one node that still has the resource, and a new supervisor adopting one restarts it there too, though
    nothing but the store tells it the session's resources."""
    from loomray.storage import open_store

    addr, store_a, lc, agents = cluster
    stores = {"placed_a": normalize_store_url(str(store_a)), "placed_b": normalize_store_url(str(store_a.parent / "b"))}
    worker = lc.workers[0]
    for name in stores:
        (agents / name).mkdir(exist_ok=True)
        (agents / name / "hold").write_text("")  # every incarnation holds in its first tool step until released
    for name, url in stores.items():
        info = ok_json(cli(cluster, "submit", f"ray_agents:{name}", "go", "--session", f"s-{name}", "--store", url,
                           "--resources", '{"loomray_session": 1}', "--json"))
        assert info["actor_options"] == {"resources": {"loomray_session": 1}}
    opened = {name: open_store(url) for name, url in stores.items()}

    def placed(name: str, epoch: int) -> str | None:
        """The node of the session's incarnation ``epoch`` once it holds in its first step, else None."""
        row = opened[name].sessions.get(f"s-{name}")
        holding = list((agents / name).glob("holding-*"))
        return row.node_id if row is not None and row.epoch == epoch and len(holding) == epoch else None

    wait_for(lambda: all(placed(n, 1) for n in stores), timeout=90, what="both sessions to start")
    assert {placed(n, 1) for n in stores} == {worker.node_id}  # the head has no loomray_session
    live = ok_json(cli(cluster, "status", "--json", "--store", stores["placed_a"]))
    by_store = {s["store"]: s for s in live["supervisors"]}
    assert set(stores.values()) <= set(by_store)  # one supervisor per store, both listed
    assert {by_store[u]["name"] for u in stores.values()} == {supervisor_name(u) for u in stores.values()}

    spare = lc.add_node()  # the only other node with loomray_session
    lc.remove_node(worker)
    wait_for(lambda: all(placed(n, 2) for n in stores), timeout=90, what="both sessions restarted")
    assert {placed(n, 2) for n in stores} == {spare.node_id}

    # A new supervisor for store a, started without --resources, adopts the session with its own.
    host = {s["session_id"]: s for s in ok_json(cli(cluster, "status", "--json", "--store", stores["placed_a"]))[
        "sessions"]}["s-placed_a"]["host"]
    in_ray(cluster, f"ray.kill(ray.get_actor({supervisor_name(stores['placed_a'])!r}))\n"
                    f"ray.kill(ray.get_actor({host!r}))")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    keeper = subprocess.Popen([*CMD, "supervise", "--store", stores["placed_a"], "--address", addr, "--interval",
                               "0.5", "--allow-agent", "ray_agents:*"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        wait_for(lambda: placed("placed_a", 3), timeout=90, what="the adopted session to restart")
        assert placed("placed_a", 3) == spare.node_id  # not the head, which soft affinity would have chosen
        for name in stores:
            (agents / name / "hold").unlink()
        for name in stores:
            wait_for(lambda n=name: opened[n].sessions.get(f"s-{n}").status == "completed", timeout=90,
                     what=f"{name} to complete")
            calls = [int(x) for x in (agents / name / "model-calls").read_text().split()]
            assert sorted(calls) == list(range(9))  # every model reply served once across all incarnations
    finally:
        keeper.send_signal(signal.SIGINT)
        try:
            keeper.wait(timeout=60)
        except subprocess.TimeoutExpired:
            keeper.kill()
            keeper.wait()
