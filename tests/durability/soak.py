"""Soak the durability checker: many seeded scenarios, one summary line, and a replay command per failure.

    python tests/durability/soak.py --seeds 200                      # seeds 0..199 (make soak SEEDS=200)
    python tests/durability/soak.py --seed 1234 --scenario zombie    # replay one, with its call trace
    python tests/durability/soak.py --seeds 2000 --backends memory,local,s3 --jobs 2

Each seed picks its scenario kind (in turn) and backend (drawn from
``--backends``); ``--scenario``/``--backend`` force them. Exit status 1 when
any invariant was violated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parents[1])):
    if p not in sys.path:
        sys.path.insert(0, p)

from durability_scenarios import BACKENDS, KINDS, pick, run_scenario  # noqa: E402

_server = None


def _s3():
    global _server
    if _server is None:
        from loomray.storage.testing import MotoS3Server

        _server = MotoS3Server().start()
    return _server


def _one(args: tuple[int, str | None, str | None, tuple[str, ...]]):
    seed, kind, backend, backends = args
    k, b = pick(seed, backends)
    kind, backend = kind or k, backend or b
    return run_scenario(seed, kind, backend, s3_server=_s3() if backend == "s3" else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=200, help="run seeds 0..N-1 (default 200)")
    ap.add_argument("--first", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--seed", type=int, default=None, help="run this one seed, verbosely")
    ap.add_argument("--scenario", choices=KINDS, default=None, help="force the scenario kind")
    ap.add_argument("--backend", choices=BACKENDS, default=None, help="force the backend")
    ap.add_argument("--backends", default="memory,local,s3", help="backends seeds draw from (default all three)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--verbose", action="store_true", help="print every scenario's summary and call trace")
    args = ap.parse_args(argv)
    backends = tuple(b for b in args.backends.split(",") if b)
    for b in backends:
        if b not in BACKENDS:
            ap.error(f"unknown backend {b!r}")
    if args.seed is not None:
        result = _one((args.seed, args.scenario, args.backend, backends))
        print(result.report(verbose=True))
        return 0 if result.ok else 1

    t0 = time.monotonic()
    work = [(s, args.scenario, args.backend, backends) for s in range(args.first, args.first + args.seeds)]
    kinds: Counter[str] = Counter()
    by_backend: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    invariants: Counter[str] = Counter()
    calls = 0
    failed = []
    excused: Counter[str] = Counter()
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            results = pool.map(_one, work, chunksize=4)
            for r in results:
                calls, failed = _tally(r, kinds, by_backend, faults, invariants, calls, failed, args.verbose)
                excused["steps"] += len(r.excused)
    else:
        for w in work:
            r = _one(w)
            calls, failed = _tally(r, kinds, by_backend, faults, invariants, calls, failed, args.verbose)
            excused["steps"] += len(r.excused)
    n = sum(kinds.values())
    violations = sum(invariants.values())
    print(f"soak: {n} scenarios ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}; "
          f"{', '.join(f'{b} {v}' for b, v in sorted(by_backend.items()))}), {calls} storage calls, "
          f"fault kinds covered: {', '.join(f'{k}={v}' for k, v in sorted(faults.items()))}; "
          f"{violations} invariant violations in {len(failed)} scenarios"
          f"{' (' + ', '.join(f'{k}={v}' for k, v in sorted(invariants.items())) + ')' if invariants else ''}; "
          f"{excused['steps']} re-executions excused (journaled inside a takeover's listing window); "
          f"{time.monotonic() - t0:.0f}s")
    if _server is not None:
        _server.stop()
    return 1 if failed else 0


def _tally(r, kinds, by_backend, faults, invariants, calls, failed, verbose):
    kinds[r.kind] += 1
    by_backend[r.backend] += 1
    faults.update(r.injected)
    for v in r.violations:
        invariants[v.invariant] += 1
    if not r.ok:
        failed.append(r)
        print(r.report(verbose=verbose), flush=True)
    elif verbose:
        print(r.report(verbose=True), flush=True)
    return calls + r.calls, failed


if __name__ == "__main__":
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    sys.exit(main())
