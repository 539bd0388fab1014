"""bench/ray_bench.py --quick still runs end to end (numbers are not asserted: speed lives in bench/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]


def test_ray_bench_quick(tmp_path):
    out_file = tmp_path / "ray.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ray_bench.py"), "--quick", "--out", str(out_file)],
                         capture_output=True, text=True, timeout=220, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Ray detection" in out.stdout and "checkpoints/s" in out.stdout
    data = json.loads(out_file.read_text())
    loss = data["node_loss"][0]
    # What the bench measures must have happened: the session recovered without repeating a model call.
    assert loss["model_calls"] == loss["distinct_replies"] == loss["turns"]
    assert loss["kill_to_node_dead_s"] is not None and loss["kill_to_next_model_call_s"] is not None
    assert data["fan_out"][0]["completed"] == 8
    assert data["throughput"]["completed"] == data["throughput"]["sessions"] == 10
    assert data["throughput"]["checkpoints"] == 10 * 21
