"""The storage benchmark's smoke run works end to end (numbers are for bench/, never asserted as speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_writes_results(tmp_path):
    out = tmp_path / "storage.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "storage_bench.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["quick"] is True
    assert {(w["backend"], w["payload_bytes"]) for w in result["writes"]} == {
        (b, s) for b in ("local", "s3") for s in (10_000, 100_000, 1_000_000)}
    assert all(w["bytes_written_per_payload_byte"] >= 1.0 for w in result["writes"])
    for q in result["query"]:
        assert q["files_after"] < q["files_before"]
        assert q["before"]["all_rows"] == q["after"]["all_rows"] > 0
    assert "cross-session query" in proc.stdout
