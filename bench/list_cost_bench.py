"""What one ``checkpoints.list`` of a leased session costs, cold and warm, by checkpoint size.

Run: ``PYTHONPATH=$PWD .venv/bin/python bench/list_cost_bench.py`` (about a minute). One session, leased
(``lease.json``, its kept copies), 20 checkpoints written through a checkpoint log, for 10 KB, 100 KB and
1 MB payloads, on a local directory and on S3 (moto on loopback, in this process). Cold: ``drop_caches()``
before each call, as a new process; warm: the same store again. Prints the median wall milliseconds of
``--reps`` calls and the requests one call makes. Run it against two trees (``PYTHONPATH``) to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomray.storage import CheckpointInfo, Store, open_store  # noqa: E402
from loomray.storage.testing import T0, MotoS3Server, write_checkpoint  # noqa: E402


def counted(store: Store) -> dict[str, int]:
    """Count the object store's GET and LIST requests from now on (the returned dict)."""
    counts: dict[str, int] = {}
    for op in ("get", "list"):
        real = getattr(store.objects, op)

        def call(*a, _real=real, _op=op, **kw):
            counts[_op] = counts.get(_op, 0) + 1
            out = _real(*a, **kw)
            return list(out) if _op == "list" else out
        setattr(store.objects, op, call)
    return counts


def measure(store: Store, size: int, reps: int) -> dict[str, object]:
    sid = f"s{size}"
    lease = store.leases.acquire(sid, owner="bench")
    for j in range(20):
        write_checkpoint(store, b'{"x": "' + b"x" * size + b'"}', CheckpointInfo(session_id=sid, checkpoint_id=f"c{j:04d}", turn=j,
                                                            created_at=T0, position="after_tools",
                                                            execution_status="active", message_count=j),
                         lease=lease, keep=0)
    counts = counted(store)
    out: dict[str, object] = {"payload": size}
    for mode in ("cold", "warm"):
        lat = []
        for _ in range(reps):
            if mode == "cold":
                store.drop_caches()
            counts.clear()
            t = time.perf_counter()
            assert len(store.checkpoints.list(sid)) == 20
            lat.append(time.perf_counter() - t)
        out[mode] = (round(1e3 * statistics.median(lat), 2), dict(sorted(counts.items())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=31)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, MotoS3Server(own_process=True) as server:
        for name, store in (("local", open_store(Path(tmp) / "store")), ("s3", server.open_store())):
            for size in (10_000, 100_000, 1_000_000):
                r = measure(store, size, args.reps)
                print(f"{name:6} {size:>9,} B  cold {r['cold'][0]:7.2f} ms {r['cold'][1]}   "
                      f"warm {r['warm'][0]:7.2f} ms {r['warm'][1]}", flush=True)
            store.close()


if __name__ == "__main__":
    main()
