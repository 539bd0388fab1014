"""Session browser: server time to render the sessions list's first page over a store of 100,000 sessions.

The store's index is built the way ``bench/storage_bench.py`` builds it
(checkpoint index rows written straight through the storage API, one file
per session), with the sessions spread over the 30 days before now (one
compacted partition per user and day), then compacted, as the supervisor or
``loomray compact`` keeps a store. Then the app renders ``/`` (the newest 50
sessions), ``/?status=active&min_spend=0.001`` and ``/?user=u007`` in
process (Starlette's test client: no network in the figure): the first
request on a fresh server (nothing cached) and the median of the next ones.

    python bench/ui_bench.py                 # 100,000 sessions (a few minutes to build)
    python bench/ui_bench.py --sessions 2000 # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402
from storage_bench import _rows_table  # noqa: E402

from loomray.ui.server import build_app  # noqa: E402
from storage import open_store  # noqa: E402
from storage.layout import CHECKPOINT_INDEX, index_partition  # noqa: E402

GOAL_MS = 300.0
PAGES = {"first page": "/", "filtered": "/?status=active&min_spend=0.001", "one user": "/?user=u007"}


def build(root: str, sessions: int, users: int, rows: int, threads: int) -> float:
    """Write each session's index rows (one file each), then compact; returns the seconds it took."""
    store = open_store(root)
    t = time.perf_counter()

    start = datetime.now(timezone.utc) - timedelta(days=30)
    step = timedelta(days=30) / sessions

    def fill(s: int) -> None:
        table = _rows_table(s, 1, rows, 0, users)
        times = pa.array([start + s * step + timedelta(seconds=i) for i in range(table.num_rows)],
                         table.schema.field("created_at").type)
        table = table.set_column(table.schema.get_field_index("created_at"), "created_at", times)
        store.index.write(index_partition(CHECKPOINT_INDEX, f"s{s:06d}", f"u{s % users:03d}"), table, cache=False)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(sessions)))
    store.compact()
    store.close()
    return time.perf_counter() - t


def _get_ms(client: TestClient, path: str) -> float:
    t = time.perf_counter()
    res = client.get(path)
    took = (time.perf_counter() - t) * 1000
    assert res.status_code == 200 and "<tr data-session=" in res.text, res.text[:300]
    return took


def measure(root: str, reps: int) -> dict[str, dict[str, float]]:
    """Per page (milliseconds): the first request of a server that has read nothing yet (the index read in the
    request), the first request after the server warmed its default view at start, and the median of ``reps``
    more."""
    out = {}
    for name, path in PAGES.items():
        cold = _get_ms(TestClient(build_app(root), base_url="http://127.0.0.1"), path)  # no lifespan: no warm-up
        app = build_app(root)
        with TestClient(app, base_url="http://127.0.0.1") as client:
            deadline = time.monotonic() + 600
            while not app.state.ui.snapshots._kept and time.monotonic() < deadline:
                time.sleep(0.05)
            first = _get_ms(client, path)
            times = [_get_ms(client, path) for _ in range(reps)]
        out[name] = {"cold_ms": cold, "first_ms": first, "median_ms": statistics.median(times)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--rows", type=int, default=2, help="checkpoint rows per session")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="loomray-ui-bench-") as root:
        print(f"building {args.sessions:,} sessions ({args.rows} index rows each) ...", file=sys.stderr)
        built = build(root, args.sessions, args.users, args.rows, args.threads)
        figures = measure(root, args.reps)
    print(f"sessions list over {args.sessions:,} sessions (index built and compacted in {built:.0f} s); "
          f"goal: first page <= {GOAL_MS:.0f} ms")
    print(f"{'page':<12} {'cold ms':>9} {'first after warm-up ms':>23} {'median ms':>10}")
    for name, f in figures.items():
        print(f"{name:<12} {f['cold_ms']:>9.0f} {f['first_ms']:>23.0f} {f['median_ms']:>10.0f}")
    if args.json:
        args.json.write_text(json.dumps({"sessions": args.sessions, "rows_per_session": args.rows,
                                         "build_s": built, "pages": figures}, indent=2))
    return 0 if figures["first page"]["first_ms"] <= GOAL_MS else 1


if __name__ == "__main__":
    raise SystemExit(main())
