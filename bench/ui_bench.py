"""Session browser: server time to render the sessions list's first page over a store of 100,000 sessions.

The store is built straight through the storage API, no agent runs: each
session's status rows (written by a run as it starts and ends: status, turn,
running cost, for some an exploration id) as one index file per session,
spread over the 30 days before now, then compacted (the session-status table
the list reads, one file per user), then a tail the table does not hold
yet: sessions started, finished and cancelled after the compaction
(``--tail``), through ``store.sessions.put`` as runs write them, and
checkpoints for the running ones. Then each page is requested in a fresh
Python process (a new server and a new ``Store``: nothing parsed, nothing
cached) through Starlette's test client (no network in the figure): the
first request ("cold") and the median of the next ``--reps`` ("warm").

    python bench/ui_bench.py                 # 100,000 sessions (a few minutes to build)
    python bench/ui_bench.py --sessions 2000 # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loomray.storage import CheckpointInfo, SessionRow, open_store  # noqa: E402
from loomray.storage.layout import SESSION_INDEX, index_partition  # noqa: E402
from loomray.storage.rows import session_rows_table  # noqa: E402
from loomray.storage.testing import write_checkpoint, write_index_file

GOAL_MS = 300.0
PAGES = {"first page": "/", "second page": "/?page=2", "filtered": "/?status=completed&min_spend=1.5",
         "one user": "/?user=u007", "search": "/?q=s00099", "exploration": "/?exploration=x0042"}
_STATUSES = ("completed",) * 6 + ("awaiting_approval", "paused", "failed", "cancelled")


def _row(s: int, users: int, at: datetime, status: str) -> SessionRow:
    return SessionRow(session_id=f"s{s:06d}", user_id=f"u{s % users:03d}", status=status, updated_at=at,
                      run_id=f"r{s}", agent_ref="bench:agent", epoch=1, turn=1 + s % 12, cost_usd=0.001 * (s % 2000),
                      exploration_id=f"x{s // 8 % 5000:04d}" if s % 4 == 0 else None)


def build(root: str, sessions: int, users: int, tail: int, threads: int) -> dict[str, float]:
    """Status rows of ``sessions`` sessions (one file each), compacted, then ``tail`` changes after it."""
    store = open_store(root)
    start = datetime.now(timezone.utc) - timedelta(days=30)
    step = timedelta(days=29) / sessions
    t = time.perf_counter()

    def fill(s: int) -> None:
        at = start + s * step
        rows = [_row(s, users, at - timedelta(minutes=5), "running"), _row(s, users, at, _STATUSES[s % 10])]
        write_index_file(store, index_partition(SESSION_INDEX, f"s{s:06d}", f"u{s % users:03d}"),
                         session_rows_table(rows))

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(sessions)))
    written = time.perf_counter() - t
    store.compact()
    compacted = time.perf_counter() - t - written
    now = datetime.now(timezone.utc)
    for i in range(tail):  # after the compaction: new sessions (some still running) and changes to old ones
        s = sessions + i if i % 4 else i * 7 % sessions
        status = "running" if i % 10 == 1 else "cancelled" if i % 4 == 0 else "completed"
        store.sessions.put(_row(s, users, now - timedelta(seconds=tail - i), status))
        if status == "running":
            write_checkpoint(store, b"{}", CheckpointInfo(
                session_id=f"s{s:06d}", user_id=f"u{s % users:03d}", checkpoint_id="c1", turn=3,
                created_at=now - timedelta(seconds=tail - i), position="after_tools", execution_status="active",
                message_count=6, cost_usd=0.25))
    store.close()
    return {"write_s": written, "compact_s": compacted}


def measure_here(root: str, path: str, reps: int) -> dict[str, float]:
    """In this (fresh) process: the first request of a new server, then the median of ``reps`` more."""
    from starlette.testclient import TestClient

    from loomray.ui.server import build_app

    client = TestClient(build_app(root), base_url="http://127.0.0.1")  # no lifespan: nothing read ahead

    def get_ms() -> tuple[float, float]:
        cpu = time.process_time()
        res = client.get(path)
        cpu = (time.process_time() - cpu) * 1000
        assert res.status_code == 200 and "<tr data-session=" in res.text, res.text[:300]
        return float(res.headers["server-timing"].split("dur=")[1]), cpu

    cold, cold_cpu = get_ms()
    warm = [get_ms() for _ in range(reps)]
    return {"cold_ms": cold, "warm_ms": statistics.median(s for s, _ in warm), "cold_cpu_ms": cold_cpu,
            "warm_cpu_ms": statistics.median(c for _, c in warm)}


def measure(root: str, reps: int) -> dict[str, dict[str, float]]:
    """Per page: :func:`measure_here` in a new Python process."""
    out = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    for name, path in PAGES.items():
        res = subprocess.run([sys.executable, __file__, "--measure", root, path, "--reps", str(reps)],
                             check=True, capture_output=True, text=True, env=env)
        out[name] = json.loads(res.stdout)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--tail", type=int, default=400, help="status changes after the compaction")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--root", type=Path, default=None,
                    help="build the store here and keep it (a store built there before is measured again as it is)")
    ap.add_argument("--measure", nargs=2, metavar=("ROOT", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure_here(*args.measure, args.reps)))
        return 0
    with tempfile.TemporaryDirectory(prefix="loomray-ui-bench-") as tmp:
        root = str(args.root or tmp)
        done = Path(root) / "built.json"
        if done.exists():
            built = json.loads(done.read_text())
        else:
            print(f"building {args.sessions:,} sessions and a tail of {args.tail} ...", file=sys.stderr)
            built = build(root, args.sessions, args.users, args.tail, args.threads)
            done.write_text(json.dumps(built))
        load = os.getloadavg()
        figures = measure(root, args.reps)
    print(f"sessions list over {args.sessions:,} sessions of {args.users} users + {args.tail} status changes "
          f"after the last compaction (rows written in {built['write_s']:.0f} s, compacted in "
          f"{built['compact_s']:.0f} s); load average {load[0]:.1f}; goal: first page cold <= {GOAL_MS:.0f} ms")
    print("server time (the page's Server-Timing, wall clock) and, in brackets, the CPU time the process spent on "
          "the request (test client included; what a busy machine does not stretch)")
    print(f"{'page':<12} {'cold ms':>16} {'warm ms':>16} {'cold/warm':>10}")
    for name, f in figures.items():
        print(f"{name:<12} {f['cold_ms']:>7.0f} ({f['cold_cpu_ms']:>6.0f}) {f['warm_ms']:>7.0f} "
              f"({f['warm_cpu_ms']:>6.0f}) {f['cold_ms'] / f['warm_ms']:>10.1f}")
    if args.json:
        args.json.write_text(json.dumps({"sessions": args.sessions, "tail": args.tail, "build": built,
                                         "load_average": load[0], "pages": figures}, indent=2))
    return 0 if figures["first page"]["cold_ms"] <= GOAL_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
