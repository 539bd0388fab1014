"""Storage benchmark: checkpoint writes, write amplification, session listing, cross-session queries.

Run: ``.venv/bin/python bench/storage_bench.py`` (full, a few minutes) or with
``--quick`` (seconds, for a smoke test). Prints a table and writes JSON to
``bench/results/storage.json`` (or ``--out``). Ratios are measured in one run
because these machines are noisy:

- write latency/throughput of ``put_checkpoint`` (keep=20, lease-fenced, one
  index row per write) for 10 KB / 100 KB / 1 MB payloads on the local
  directory and on S3 (moto on loopback), against the physical floor: one raw
  PUT of the same bytes through the same object store;
- bytes written per checkpoint / payload bytes (object + index row + the
  retention tombstones, counted at the object-store boundary);
- ``list_checkpoints`` latency for one session among N sessions, compared with
  the same call when only a few sessions exist;
- a cross-session query over 1,000,000 index rows before and after
  ``compact()``, with index file counts. The rows are generated as Arrow
  tables and written in bulk through the index writer ``put_checkpoint`` uses
  (``ParquetIndex.write``: 50 rows per file, 20 files per session, 2% of the
  rows tombstones), so the files are the same shape a long run produces, only
  with more rows per file than one write makes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pyarrow as pa  # noqa: E402

from storage import open_store  # noqa: E402
from storage.layout import CHECKPOINT_INDEX, index_partition  # noqa: E402
from storage.rows import CHECKPOINT_SCHEMA  # noqa: E402
from storage.testing import MotoS3Server  # noqa: E402

T0 = datetime(2026, 7, 1, tzinfo=timezone.utc)


class ByteCounter:
    """Counts bytes and requests crossing the object-store boundary (wraps ``put``)."""

    def __init__(self, objects):
        self.objects, self.real, self.bytes, self.puts = objects, objects.put, 0, 0
        objects.put = self._put

    def _put(self, *, key, data, **kw):
        self.bytes += len(data)
        self.puts += 1
        return self.real(key=key, data=data, **kw)

    def reset(self):
        self.bytes = self.puts = 0


_START = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_writes(store, backend, sizes, n):
    out = []
    counter = ByteCounter(store.objects)
    for size in sizes:
        payload = (b'{"messages": "' + b"x" * (size - 17) + b'"}')[:size]
        floor = []
        for i in range(n):  # the physical floor: one raw PUT of the same bytes
            t = time.perf_counter()
            store.objects.put(key=f"floor/{size}/{i}.json", data=payload)
            floor.append(time.perf_counter() - t)
        counter.reset()
        lat = []
        t_all = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            store.put_checkpoint(payload, session_id=f"w{size}", checkpoint_id=f"c{i:06d}", turn=i,
                                 created_at=T0, position="after_tools", execution_status="active",
                                 message_count=i, keep=20)
            lat.append(time.perf_counter() - t)
        total = time.perf_counter() - t_all
        written, puts = counter.bytes, counter.puts
        fenced = []
        lease_session = f"f{size}"
        lease = store.acquire_lease(lease_session, owner="bench")
        for i in range(n):
            t = time.perf_counter()
            store.put_checkpoint(payload, session_id=lease_session, checkpoint_id=f"c{i:06d}", turn=i,
                                 created_at=T0, position="after_tools", execution_status="active",
                                 message_count=i, lease=lease, keep=20)
            fenced.append(time.perf_counter() - t)
        out.append({
            "backend": backend, "payload_bytes": size, "writes": n,
            "p50_ms": 1e3 * statistics.median(lat), "p95_ms": 1e3 * _pct(lat, 0.95),
            "fenced_p50_ms": 1e3 * statistics.median(fenced),
            "floor_p50_ms": 1e3 * statistics.median(floor),
            "ratio_to_floor": statistics.median(lat) / statistics.median(floor),
            "writes_per_s": n / total, "payload_mb_per_s": n * size / total / 1e6,
            "bytes_written_per_payload_byte": written / (n * size), "requests_per_write_put": puts / n,
        })
    store.objects.put = counter.real
    return out


def bench_listing(store, backend, sessions, per_session, threads):
    def fill(i):
        for j in range(per_session):
            store.put_checkpoint(b'{"x": 1}', session_id=f"s{i:06d}", checkpoint_id=f"c{j:04d}", turn=j,
                                 created_at=T0, position="after_tools", execution_status="active",
                                 message_count=j, keep=0)

    def measure(sid, reps=5 if sessions < 1000 else 20):
        lat = []
        for _ in range(reps):
            store.index._cache.clear()  # a cold reader: LISTs, GETs and parses every time
            store._rows.clear()
            t = time.perf_counter()
            rows = store.list_checkpoints(sid)
            lat.append(time.perf_counter() - t)
            assert len(rows) == per_session
        return 1e3 * statistics.median(lat)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(10)))
    few = measure("s000005")
    progress(f"  filling {sessions:,} sessions")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(10, sessions)))
    fill_s = time.perf_counter() - t
    many = measure("s000005")
    return {"backend": backend, "sessions": sessions, "checkpoints_per_session": per_session,
            "list_ms_among_10_sessions": few, f"list_ms_among_{sessions}_sessions": many,
            "list_ms_many": many, "ratio_many_to_few": many / few, "fill_seconds": fill_s}


def _rows_table(session: int, n_files: int, rows_per_file: int, file_no: int, users: int) -> pa.Table:
    n = rows_per_file
    base = file_no * n
    user = f"u{session % users:03d}"
    sid = f"s{session:06d}"
    idx = list(range(base, base + n))
    tomb = [(i % 50) == 49 for i in idx]  # 2%: retire the row written just before
    cids = [f"c{(i - 1 if t else i):06d}" for i, t in zip(idx, tomb)]
    ts = [T0 + timedelta(seconds=session * 10_000 + i) for i in idx]
    return pa.Table.from_pydict({
        "session_id": [sid] * n, "user_id": [user] * n, "checkpoint_id": cids, "turn": idx,
        "created_at": ts, "position": ["after_tools"] * n,
        "execution_status": ["completed" if i % 10 == 9 else "active" for i in idx],
        "message_count": [2 * i for i in idx], "input_tokens": [100 * i for i in idx], "output_tokens": idx,
        "cost_usd": [0.001 * (i % 100) for i in idx], "spend_usd": [0.001] * n, "parent_checkpoint_id": [None] * n, "forked_from": [None] * n,
        "agent_id": ["bench"] * n, "epoch": [1] * n,
        "key": [f"sessions/{user}/{sid}/checkpoints/{c}.json" for c in cids], "size": [10_000] * n,
        "sha256": ["0" * 64] * n, "tombstone": tomb, "written_at": ts,
    }, schema=CHECKPOINT_SCHEMA)


def bench_query(store, backend, sessions, files_per_session, rows_per_file, users, threads):
    t = time.perf_counter()

    def fill(s):
        for f in range(files_per_session):
            table = _rows_table(s, files_per_session, rows_per_file, f, users)
            store.index.write(index_partition(CHECKPOINT_INDEX, f"s{s:06d}", f"u{s % users:03d}"), table)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(sessions)))
    store.index._cache.clear()
    gen_s = time.perf_counter() - t
    total_rows = sessions * files_per_session * rows_per_file

    def run_query():
        t = time.perf_counter()
        everything = store.query(columns=["session_id", "checkpoint_id", "cost_usd"])
        q_all = time.perf_counter() - t
        t = time.perf_counter()
        filtered = store.query(status="completed", min_cost=0.05, since=T0 + timedelta(days=1))
        q_filtered = time.perf_counter() - t
        t = time.perf_counter()
        one_user = store.query(user_id="u007", min_cost=0.05)
        q_user = time.perf_counter() - t
        return {"all_rows": everything.num_rows, "all_s": q_all, "filtered_rows": filtered.num_rows,
                "filtered_s": q_filtered, "one_user_rows": one_user.num_rows, "one_user_s": q_user}

    progress(f"  generated {total_rows:,} rows in {gen_s:.1f}s; querying")
    files_before = len(store.index_files())
    before = run_query()
    progress("  compacting")
    t = time.perf_counter()
    report = store.compact()
    compact_s = time.perf_counter() - t
    files_after = len(store.index_files())
    after = run_query()
    assert before["all_rows"] == after["all_rows"] and before["filtered_rows"] == after["filtered_rows"]
    return {"backend": backend, "index_rows": total_rows, "sessions": sessions, "users": users,
            "generate_seconds": gen_s, "files_before": files_before, "files_after": files_after,
            "compact_seconds": compact_s, "tombstones_dropped": report.tombstones_dropped,
            "before": before, "after": after,
            "speedup_all": before["all_s"] / after["all_s"], "speedup_filtered": before["filtered_s"] / after["filtered_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "storage.json"))
    args = ap.parse_args(argv)
    q = args.quick
    cfg = {
        "sizes": [10_000, 100_000, 1_000_000], "writes": 3 if q else 40,
        "list_sessions_local": 60 if q else 10_000, "list_sessions_s3": 30 if q else 1_000, "per_session": 2,
        "query_sessions": 20 if q else 1_000, "files_per_session": 3 if q else 20, "rows_per_file": 10 if q else 50,
        "query_users": 10 if q else 100, "query_sessions_s3": 10 if q else 100,
    }
    results = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
               "config": cfg, "quick": q, "writes": [], "listing": [], "query": []}
    with tempfile.TemporaryDirectory(prefix="loomray-bench-") as tmp, MotoS3Server() as s3:
        backends = {"local": lambda: open_store(Path(tmp) / f"d{time.time_ns()}"), "s3": s3.open_store}
        for name, make in backends.items():
            progress(f"writes on {name}")
            store = make()
            results["writes"] += bench_writes(store, name, cfg["sizes"], cfg["writes"])
            store.close()
        progress("listing on local")
        store = backends["local"]()
        results["listing"].append(bench_listing(store, "local", cfg["list_sessions_local"], cfg["per_session"], 2))
        store.close()
        progress("listing on s3")
        store = backends["s3"]()
        results["listing"].append(bench_listing(store, "s3", cfg["list_sessions_s3"], cfg["per_session"], 8))
        store.close()
        progress("query on local")
        store = backends["local"]()
        results["query"].append(bench_query(store, "local", cfg["query_sessions"], cfg["files_per_session"],
                                            cfg["rows_per_file"], cfg["query_users"], 4))
        store.close()
        progress("query on s3")
        store = backends["s3"]()
        results["query"].append(bench_query(store, "s3", cfg["query_sessions_s3"], cfg["files_per_session"],
                                            cfg["rows_per_file"], min(cfg["query_users"], cfg["query_sessions_s3"]), 8))
        store.close()
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {args.out}")
    return 0


def report(r) -> None:
    print("\ncheckpoint writes (put_checkpoint, keep=20; floor = one raw PUT of the same bytes)")
    print(f"{'backend':8} {'payload':>9} {'p50 ms':>8} {'p95 ms':>8} {'fenced':>8} {'floor':>8} {'x floor':>8} "
          f"{'writes/s':>9} {'MB/s':>7} {'bytes/payload':>13} {'PUTs':>5}")
    for w in r["writes"]:
        print(f"{w['backend']:8} {w['payload_bytes']:>9,} {w['p50_ms']:8.2f} {w['p95_ms']:8.2f} {w['fenced_p50_ms']:8.2f} "
              f"{w['floor_p50_ms']:8.2f} {w['ratio_to_floor']:8.2f} {w['writes_per_s']:9.1f} "
              f"{w['payload_mb_per_s']:7.1f} {w['bytes_written_per_payload_byte']:13.3f} {w['requests_per_write_put']:5.1f}")
    print("\nlist_checkpoints of one session (cold cache, median of 20)")
    for x in r["listing"]:
        print(f"{x['backend']:8} among 10: {x['list_ms_among_10_sessions']:7.2f} ms   among {x['sessions']:,}: "
              f"{x['list_ms_many']:7.2f} ms   ratio {x['ratio_many_to_few']:.2f}   (fill {x['fill_seconds']:.1f}s)")
    print("\ncross-session query (all rows / filtered / one user) before and after compact()")
    for x in r["query"]:
        b, a = x["before"], x["after"]
        print(f"{x['backend']:8} {x['index_rows']:,} rows in {x['sessions']:,} sessions: files {x['files_before']:,} -> "
              f"{x['files_after']:,} (compact {x['compact_seconds']:.1f}s, {x['tombstones_dropped']:,} tombstones applied)")
        print(f"{'':8} before: all {b['all_s']:.2f}s ({b['all_rows']:,} rows)  filtered {b['filtered_s']:.2f}s "
              f"({b['filtered_rows']:,})  one user {b['one_user_s']:.2f}s ({b['one_user_rows']:,})")
        print(f"{'':8} after:  all {a['all_s']:.2f}s  filtered {a['filtered_s']:.2f}s  one user {a['one_user_s']:.2f}s  "
              f"speedup {x['speedup_all']:.1f}x / {x['speedup_filtered']:.1f}x")


if __name__ == "__main__":
    raise SystemExit(main())
