"""bench/ray_bench.py --smoke still runs end to end, both placements, and what it measures happened (numbers
are not asserted: speed lives in bench/, where ``make bench`` runs it in full; ``--quick`` is the mid size).

``--smoke`` is every phase of ``--quick`` at the smallest sizes that still make it happen, both
placements on one cluster: a fraction of ``--quick``'s cost, which starts a cluster per placement.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]


def test_ray_bench_smoke(tmp_path):
    out_file = tmp_path / "ray.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ray_bench.py"), "--smoke", "--out", str(out_file)],
                         capture_output=True, text=True, timeout=220, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Ray detection" in out.stdout and "checkpoints/s" in out.stdout
    data = json.loads(out_file.read_text())
    assert data["smoke"] and data["runs"] == ["dense", "actor"]
    for placement in data["runs"]:
        d = data[placement]
        [loss] = d["node_loss"]
        # What the bench measures must have happened: sessions recovered without repeating a model call.
        assert loss["completed"] == loss["sessions"], (placement, loss)
        # "repeats": each repeated call, when it was served (s after the kill) and whether by the lost process.
        assert loss["model_calls_repeated"] == 0, (placement, loss["repeats"])
        assert loss["recovered"] == loss["lost_sessions"] >= 1, (placement, loss)
        assert loss["kill_to_node_dead_s"] is not None and loss["kill_to_next_model_call_s_max"] is not None
        [fan] = d["fan_out"]
        assert fan["completed"] == fan["forks"] >= 2 and fan["all_started_s"] is not None
        tp = d["throughput"]
        assert tp["completed"] == tp["sessions"] >= 2
        assert tp["checkpoints"] == tp["sessions"] * (tp["passes"] + 1)  # one per pass, the final answer's too
        assert d["peak_memory_mb"] > 0 and d["leftover_processes"] == []
    scale = data["dense"]["scale"]
    assert scale["completed"] == scale["sessions"] and scale["failed"] == 0
