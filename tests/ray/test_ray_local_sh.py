"""cluster/local.sh: start, status and stop a loopback cluster, leaving nothing behind."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loomray.testing import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[2] / "cluster" / "local.sh"



def _ours(run_dir):
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(run_dir) in line]


@pytest.fixture
def run_dir():
    # Short on purpose: Ray's unix socket paths live under it (limit ~107 bytes).
    path = Path(tempfile.mkdtemp(prefix="lr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_start_status_stop(run_dir):
    env = {**os.environ, "LOOMRAY_RUN_DIR": str(run_dir), "LOOMRAY_RAY_PORT": str(free_port()),
           "PYTHON": sys.executable}
    env.pop("LOOMRAY_STORE", None)

    def sh(*args):
        return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=150)

    try:
        started = sh("start", "2")
        assert started.returncode == 0, started.stderr + started.stdout
        address = (run_dir / "address").read_text().strip()
        assert address == f"127.0.0.1:{env['LOOMRAY_RAY_PORT']}"
        again = sh("start", "2")
        assert again.returncode != 0 and "already running" in again.stderr

        status = sh("status")
        assert status.returncode == 0, status.stderr
        alive = [line for line in status.stdout.splitlines() if line.strip().startswith("alive")]
        assert len(alive) == 2 and all("127.0.0.1" in line for line in alive)
    finally:
        stopped = sh("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "leftover" not in stopped.stderr  # the daemon's own teardown got everything
    assert _ours(run_dir) == []
    assert sh("status").returncode != 0
    assert sh("bogus").returncode == 2
