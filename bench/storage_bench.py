"""Storage benchmark: checkpoint writes, write amplification, session listing, cross-session queries.

Run: ``.venv/bin/python bench/storage_bench.py`` (full: 15-30 minutes on 2 cores) or with
``--quick`` (seconds, for a smoke test). Prints a table and writes JSON to
``bench/results/storage.json`` (or ``--out``). Ratios are measured in one run
because these machines are noisy:

- write latency/throughput of a checkpoint log (``store.checkpoints.log``,
  keep=20: one PUT per checkpoint, rows and the lease proof in batches; and
  with a batch of one, each write acknowledged) for 10 KB / 100 KB / 1 MB payloads on the local
  directory and on S3 (moto on loopback), against the physical floor: one raw
  PUT of the same bytes through the same object store;
- bytes written per checkpoint / payload bytes (object + index row + the
  retention tombstones, counted at the object-store boundary);
- ``list_checkpoints`` latency for one session among N sessions (100,000
  locally, 1,000 on S3), compared with the same call among 10 sessions;
- cross-session queries, cold (a fresh ``Store`` per run, so no cached
  manifest, partition or file), over 1,000,000 index rows locally (10,000
  files: 1,000 sessions x 10 files x 100 rows, 100 users, 2% of the rows
  tombstones) and 100,000 on S3 (1,000 files): one user + 30 days + a minimum
  cost, all users + 30 days + status + minimum cost, and every row; each before
  compaction (all of it uncompacted tail), after a full ``compact()`` (the
  compacted table), and after 1,000 (S3: 200) more checkpoint writes
  (table + tail); with the GET / LIST / PUT / DELETE requests each one made;
- compaction: the full one (per-session merges + building the table), the
  incremental one after those new checkpoints, and a no-op one, with wall and
  CPU seconds, requests and the 1-minute load average when each started (the
  machine may be shared: compare the CPU seconds and the load, not only the
  wall time). Only this part: ``--parts query --backends local``. The index rows are generated as Arrow tables and
  written through the index writer checkpoint logs use
  (``ParquetIndex.write``), so the files have the shape a long run produces,
  only with more rows per file than one write makes. On S3 the CPU seconds
  include moto's, which runs in this process.
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

from loomray.storage import CheckpointInfo, Store, open_store  # noqa: E402
from loomray.storage.layout import CHECKPOINT_INDEX, checkpoint_key, index_partition  # noqa: E402
from loomray.storage.rows import CHECKPOINT_SCHEMA, CheckpointRow, checkpoint_rows_table  # noqa: E402
from loomray.storage.table import staleness  # noqa: E402
from loomray.storage.testing import MotoS3Server, write_checkpoint, write_index_file  # noqa: E402

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
        log = store.checkpoints.log(store.leases.acquire(f"w{size}", owner="bench"), keep=20)
        for i in range(n):
            t = time.perf_counter()
            log.put(payload, CheckpointInfo(session_id=f"w{size}", checkpoint_id=f"c{i:06d}", turn=i, created_at=T0,
                                            position="after_tools", execution_status="active", message_count=i))
            lat.append(time.perf_counter() - t)
        log.flush()
        total = time.perf_counter() - t_all
        written, puts = counter.bytes, counter.puts
        fenced = []
        lease_session = f"f{size}"
        acked = store.checkpoints.log(store.leases.acquire(lease_session, owner="bench"), keep=20, batch=1)
        for i in range(n):
            t = time.perf_counter()
            acked.put(payload, CheckpointInfo(session_id=lease_session, checkpoint_id=f"c{i:06d}", turn=i,
                                              created_at=T0, position="after_tools", execution_status="active",
                                              message_count=i))
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
    """``list_checkpoints`` of one session, cold, among 10 and among ``sessions`` sessions.

    The first 10 sessions are written through checkpoint logs; the rest (only
    there to be listed past) get one checkpoint object and one index file each,
    written straight through the object store in the layout of an index row,
    which fills 100,000 sessions in a minute instead of ten.
    """
    def fill(i):
        for j in range(per_session):
            write_checkpoint(store, b'{"x": 1}', CheckpointInfo(session_id=f"s{i:06d}", checkpoint_id=f"c{j:04d}",
                                                               turn=j, created_at=T0, position="after_tools",
                                                               execution_status="active", message_count=j), keep=0)

    def fill_fast(i):
        sid = f"s{i:06d}"
        row = CheckpointRow(session_id=sid, checkpoint_id="c0000", turn=0, created_at=T0, position="after_tools",
                            execution_status="active", message_count=0, epoch=0,
                            key=checkpoint_key(sid, None, "c0000"), size=8, sha256="0" * 64)
        store.objects.put(key=row.key, data=b'{"x": 1}')
        write_index_file(store, index_partition(CHECKPOINT_INDEX, sid, None),
                         checkpoint_rows_table([row], tombstone=False, written_at=T0))

    def measure(sid, reps=5 if sessions < 1000 else 20):
        lat = []
        for _ in range(reps):
            store.drop_caches()  # a cold reader: LISTs, GETs and parses every time
            t = time.perf_counter()
            rows = store.checkpoints.list(sid)
            lat.append(time.perf_counter() - t)
            assert len(rows) == per_session
        return 1e3 * statistics.median(lat)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(10)))
    few = measure("s000005")
    progress(f"  filling {sessions:,} sessions")
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill_fast, range(10, sessions)))
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
    tomb = [(i % 50) == 49 for i in idx]  # 2%: retire the row written just before (a tombstone copies its row)
    target = [i - 1 if t else i for i, t in zip(idx, tomb, strict=False)]
    cids = [f"c{i:06d}" for i in target]
    ts = [T0 + timedelta(seconds=session * 10_000 + i) for i in target]
    return pa.Table.from_pydict({
        "session_id": [sid] * n, "user_id": [user] * n, "checkpoint_id": cids, "turn": target,
        "created_at": ts, "position": ["after_tools"] * n,
        "execution_status": ["completed" if i % 10 == 9 else "active" for i in target],
        "message_count": [2 * i for i in target], "input_tokens": [100 * i for i in target], "output_tokens": target,
        "cost_usd": [0.001 * (i % 100) for i in target], "spend_usd": [0.001] * n, "parent_checkpoint_id": [None] * n,
        "forked_from": [None] * n, "agent_id": ["bench"] * n, "chain": [None] * n, "epoch": [1] * n,
        "key": [f"sessions/{user}/{sid}/checkpoints/{c}.json" for c in cids], "size": [10_000] * n,
        "sha256": ["0" * 64] * n, "tombstone": tomb,
        "written_at": [T0 + timedelta(seconds=session * 10_000 + i) for i in idx],
        "tomb_epoch": [None] * n, "tomb_mark": [None] * n,  # tombstones of prune or delete: no lease
    }, schema=CHECKPOINT_SCHEMA)


class RequestCounter:
    """Counts GET / LIST / PUT / DELETE calls at the object-store boundary (wraps the instance's methods)."""

    def __init__(self, objects):
        self.objects, self.counts = objects, {"GET": 0, "LIST": 0, "PUT": 0, "DELETE": 0}
        self.real = {name: getattr(objects, name) for name in ("get", "list", "put", "delete")}
        for name, op in (("get", "GET"), ("list", "LIST"), ("put", "PUT"), ("delete", "DELETE")):
            setattr(objects, name, self._wrap(self.real[name], op))

    def _wrap(self, fn, op):
        def call(**kw):
            self.counts[op] += 1
            return fn(**kw)
        return call

    def reset(self):
        self.counts = dict.fromkeys(self.counts, 0)

    def restore(self):
        for name, fn in self.real.items():
            setattr(self.objects, name, fn)


def bench_query(store, backend, sessions, files_per_session, rows_per_file, users, threads, new_checkpoints):
    """Cross-session queries before and after compaction, full and incremental compaction, requests per query."""
    t = time.perf_counter()

    def fill(s):
        for f in range(files_per_session):
            table = _rows_table(s, files_per_session, rows_per_file, f, users)
            write_index_file(store, index_partition(CHECKPOINT_INDEX, f"s{s:06d}", f"u{s % users:03d}"), table)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, range(sessions)))
    gen_s = time.perf_counter() - t
    total_rows = sessions * files_per_session * rows_per_file
    user = f"u{7 % users:03d}"
    span = timedelta(days=30)
    counter = RequestCounter(store.objects)

    def cold(fn):
        """``fn(store)`` on a fresh Store over the same objects (no cached manifest, partition or file): seconds,
        result, requests."""
        fresh = Store(store.objects, store.url)
        counter.reset()
        t, c = time.perf_counter(), time.process_time()
        out = fn(fresh)
        took, cpu = time.perf_counter() - t, time.process_time() - c
        requests = dict(counter.counts)
        fresh.close(keep_objects=True)
        return took, out, requests, cpu

    def run_query(reps):
        res = {}
        for name, fn in (
            ("user", lambda st: st.query(user_id=user, since=T0, until=T0 + span, min_cost=0.05)),
            ("filtered", lambda st: st.query(status="completed", min_cost=0.05, since=T0 + timedelta(days=1),
                                             until=T0 + timedelta(days=31))),
            ("all", lambda st: st.query(columns=["session_id", "checkpoint_id", "cost_usd"])),
        ):
            runs = [cold(fn) for _ in range(reps if name != "all" else 1)]
            took = statistics.median(r[0] for r in runs)
            res[f"{name}_s"], res[f"{name}_rows"], res[f"{name}_requests"] = took, runs[0][1].num_rows, runs[0][2]
            res[f"{name}_cpu_s"] = statistics.median(r[3] for r in runs)
            stale = staleness(runs[0][1])
            res[f"{name}_tail_files"] = stale.tail_files if stale else None
        return res

    progress(f"  generated {total_rows:,} rows in {gen_s:.1f}s; querying")
    files_before = len(store.index_files())
    before = run_query(1)
    progress("  full compaction")
    load_full = os.getloadavg()[0]  # the machine is shared: what else ran shows in the figures
    counter.reset()
    t, c = time.perf_counter(), time.process_time()
    report = store.compact()
    compact_s, compact_cpu = time.perf_counter() - t, time.process_time() - c
    compact_requests = dict(counter.counts)
    files_after = len(store.index_files())
    table_files = len(store.index_files("table"))
    after = run_query(5)
    assert before["all_rows"] == after["all_rows"] and before["filtered_rows"] == after["filtered_rows"]
    assert before["user_rows"] == after["user_rows"]

    progress(f"  {new_checkpoints:,} new checkpoints, then incremental compaction")
    # The newest 100 sessions (several users) get the new checkpoints, on the newest day: what a live system does.
    targets = [(s, f"u{s % users:03d}") for s in range(max(0, sessions - 100), sessions)]
    t_new = T0 + timedelta(seconds=sessions * 10_000)
    t = time.perf_counter()
    for i in range(new_checkpoints):
        s, u = targets[i % len(targets)]
        write_checkpoint(store, b'{"x": 1}', CheckpointInfo(
            session_id=f"s{s:06d}", user_id=u, checkpoint_id=f"n{i:06d}", turn=i, created_at=t_new + timedelta(seconds=i),
            position="after_tools", execution_status="active", message_count=i, cost_usd=0.07), keep=1_000_000)
    write_s = time.perf_counter() - t
    with_tail = run_query(3)
    load_inc = os.getloadavg()[0]
    counter.reset()
    t, c = time.perf_counter(), time.process_time()
    inc = store.compact()
    inc_s, inc_cpu = time.perf_counter() - t, time.process_time() - c
    inc_requests = dict(counter.counts)
    t = time.perf_counter()
    noop = store.compact()
    noop_s = time.perf_counter() - t
    counter.restore()
    return {"backend": backend, "index_rows": total_rows, "sessions": sessions, "users": users,
            "files_per_session": files_per_session, "rows_per_file": rows_per_file,
            "generate_seconds": gen_s, "files_before": files_before, "files_after": files_after,
            "table_files": table_files, "compact_seconds": compact_s, "compact_cpu_seconds": compact_cpu,
            "compact_requests": compact_requests, "compact_loadavg": load_full, "incremental_loadavg": load_inc,
            "tombstones_dropped": report.tombstones_dropped, "table_partitions_written": report.table_partitions,
            "before": before, "after": after,
            "new_checkpoints": new_checkpoints, "new_checkpoint_write_seconds": write_s, "with_tail": with_tail,
            "incremental_compact_seconds": inc_s, "incremental_compact_cpu_seconds": inc_cpu,
            "incremental_requests": inc_requests,
            "incremental_table_partitions": inc.table_partitions, "noop_compact_seconds": noop_s,
            "noop_table_partitions": noop.table_partitions,
            "speedup_all": before["all_s"] / after["all_s"], "speedup_filtered": before["filtered_s"] / after["filtered_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of a few seconds")
    ap.add_argument("--parts", default="writes,listing,query", help="comma-separated: writes, listing, query")
    ap.add_argument("--backends", default="local,s3", help="comma-separated: local, s3")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "storage.json"))
    args = ap.parse_args(argv)
    q = args.quick
    parts, only = set(args.parts.split(",")), set(args.backends.split(","))
    cfg = {
        "sizes": [10_000, 100_000, 1_000_000], "writes": 3 if q else 40,
        "list_sessions_local": 60 if q else 100_000, "list_sessions_s3": 30 if q else 1_000, "per_session": 2,
        # 1,000,000 rows in 10,000 files locally; 100,000 rows in 1,000 files on S3
        "query_sessions": 20 if q else 1_000, "files_per_session": 3 if q else 10, "rows_per_file": 10 if q else 100,
        "query_users": 10 if q else 100, "query_sessions_s3": 10 if q else 100,
        "new_checkpoints": 20 if q else 1_000, "new_checkpoints_s3": 10 if q else 200,
    }
    results = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
                           "loadavg_at_start": os.getloadavg()},
               "config": cfg, "quick": q, "writes": [], "listing": [], "query": []}
    with tempfile.TemporaryDirectory(prefix="loomray-bench-") as tmp, MotoS3Server() as s3:
        backends = {"local": lambda: open_store(Path(tmp) / f"d{time.time_ns()}"), "s3": s3.open_store}
        backends = {k: v for k, v in backends.items() if k in only}
        if "writes" in parts:
            for name, make in backends.items():
                progress(f"writes on {name}")
                store = make()
                results["writes"] += bench_writes(store, name, cfg["sizes"], cfg["writes"])
                store.close()
        if "listing" in parts:
            for name, make in backends.items():
                progress(f"listing on {name}")
                store = make()
                n = cfg["list_sessions_local"] if name == "local" else cfg["list_sessions_s3"]
                results["listing"].append(bench_listing(store, name, n, cfg["per_session"], 2 if name == "local" else 8))
                store.close()
        if "query" in parts:
            for name, make in backends.items():
                progress(f"query on {name}")
                store = make()
                if name == "local":
                    results["query"].append(bench_query(store, "local", cfg["query_sessions"], cfg["files_per_session"],
                                                        cfg["rows_per_file"], cfg["query_users"], 4,
                                                        cfg["new_checkpoints"]))
                else:
                    results["query"].append(bench_query(store, "s3", cfg["query_sessions_s3"], cfg["files_per_session"],
                                                        cfg["rows_per_file"],
                                                        min(cfg["query_users"], cfg["query_sessions_s3"]), 8,
                                                        cfg["new_checkpoints_s3"]))
                store.close()
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    report(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {args.out}")
    return 0


def report(r) -> None:
    print("\ncheckpoint writes (a checkpoint log, keep=20; fenced = a batch of one; floor = one raw PUT of the same bytes)")
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
    print("\ncross-session query timings, cold (a fresh Store each run); user = one user, 30 days, min cost; filtered = all "
          "users, 30 days, status, min cost; all = every live row")
    for x in r["query"]:
        print(f"{x['backend']:8} {x['index_rows']:,} rows in {x['sessions']:,} sessions, {x['users']} users: per-session "
              f"files {x['files_before']:,} -> {x['files_after']:,}, table files {x['table_files']:,}")
        print(f"{'':8} compaction: full {x['compact_seconds']:.2f}s (cpu {x['compact_cpu_seconds']:.2f}s, load "
              f"{x['compact_loadavg']:.1f}) {_req(x['compact_requests'])}; after {x['new_checkpoints']:,} new "
              f"checkpoints incremental {x['incremental_compact_seconds']:.2f}s (cpu "
              f"{x['incremental_compact_cpu_seconds']:.2f}s, load {x['incremental_loadavg']:.1f}) "
              f"({x['incremental_table_partitions']} partitions) {_req(x['incremental_requests'])}; "
              f"no-op {x['noop_compact_seconds']:.2f}s")
        for label, key in (("before (uncompacted)", "before"), ("after compaction", "after"),
                           ("after + tail", "with_tail")):
            b = x[key]
            print(f"{'':8} {label:20} user {b['user_s'] * 1e3:8.1f} ms (cpu {b['user_cpu_s'] * 1e3:.1f}; "
                  f"{b['user_rows']:,} rows, "
                  f"{_req(b['user_requests'])})  filtered {b['filtered_s'] * 1e3:8.1f} ms ({b['filtered_rows']:,}, "
                  f"{_req(b['filtered_requests'])})  all {b['all_s']:.2f}s ({b['all_rows']:,})")


def _req(c: dict) -> str:
    return " ".join(f"{k} {v}" for k, v in c.items() if v)


if __name__ == "__main__":
    raise SystemExit(main())
