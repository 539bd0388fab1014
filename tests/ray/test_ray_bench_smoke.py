"""bench/ray_bench.py --quick still runs end to end, both placements (numbers are not asserted: speed lives in
bench/)."""

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
    for placement, lost in (("actor", 1), ("dense", None)):
        d = data[placement]
        loss = d["node_loss"][0]
        # What the bench measures must have happened: sessions recovered without repeating a model call.
        assert loss["completed"] == loss["sessions"], (placement, loss)
        # "repeats": each repeated call, when it was served (s after the kill) and whether by the lost process.
        assert loss["model_calls_repeated"] == 0, (placement, loss["repeats"])
        assert loss["recovered"] == loss["lost_sessions"] >= (lost or 1)
        assert loss["kill_to_node_dead_s"] is not None and loss["kill_to_next_model_call_s_max"] is not None
        assert d["fan_out"][0]["completed"] == 8
        assert d["throughput"]["completed"] == d["throughput"]["sessions"] == 10
        assert d["throughput"]["checkpoints"] == 10 * 21
        assert d["peak_memory_mb"] > 0 and d["leftover_processes"] == []
    assert data["dense"]["scale"]["completed"] == data["dense"]["scale"]["sessions"]
