"""The hostile-bucket fuzzer from the command line: ``make fuzz SEEDS=5000``, or replay one seed.

    PYTHONPATH=$PWD python tests/fuzz/run.py --seeds 5000 [--jobs 2] [--start 10000]
    PYTHONPATH=$PWD python tests/fuzz/run.py --seed 1234 [--backend local]

Seed ``k`` runs on a local directory when ``k % 4 == 1`` and on the memory store otherwise (``--backend`` forces
one): the local store costs twice the time per seed, and its own risk (a path outside the root) needs fewer.
``--backend s3`` runs every seed on moto's S3 server (in a process of its own, started once per worker): each
request is a round trip, so a seed there costs ten times one in memory or more. The report names the kinds of
mutation made, the kinds of object mutated, every read's worst time and peak memory against the bounds, and for
each failing seed the command that replays it. Exit status 1 when any read broke a rule (see ``fuzz_targets``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_targets import COSTLY, READ_PEAK_BYTES, READ_SECONDS, SeedResult, run_seed  # noqa: E402


class _Count(logging.Handler):
    """Counts warnings instead of printing them (a skip is logged as one)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def backend_of(seed: int, forced: str | None) -> str:
    """The backend seed ``seed`` runs on."""
    return forced or ("local" if seed % 4 == 1 else "memory")


def run_seeds(seeds: list[int], forced: str | None, progress: bool = False,
              costly_every: int = 1) -> tuple[list[SeedResult], int]:
    """Run ``seeds`` in this process; their results and the warnings logged (``progress``: a line on stderr per
    100 seeds and per failing seed; ``costly_every``: the costly reads on every k-th seed only)."""
    counter = _Count()
    logging.getLogger().addHandler(counter)  # also keeps Python's last-resort handler from printing each one
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    out = []
    try:
        with tempfile.TemporaryDirectory(prefix="loomray-fuzz-") as tmp, contextlib.ExitStack() as stack:
            opener = None
            if forced == "s3":
                from loomray.storage.testing import MotoS3Server

                opener = stack.enter_context(MotoS3Server(own_process=True)).open_store
            for seed in seeds:
                backend = backend_of(seed, forced)
                try:
                    out.append(run_seed(seed, backend, Path(tmp) / f"{backend}-{seed}",
                                        costly=seed % costly_every == 0, opener=opener))
                except Exception as e:  # noqa: BLE001 - a fuzzer bug fails its seed, not the whole run
                    out.append(SeedResult(seed, backend, [], [], [f"fuzzer error: {type(e).__name__}: {e}"]))
                if progress and (out[-1].violations or len(out) % 100 == 0):
                    print(f"[{len(out)}/{len(seeds)}] seed {seed} ({backend}): {out[-1].violations[:3]}",
                          file=sys.stderr, flush=True)
    finally:
        logging.getLogger().removeHandler(counter)
    return out, counter.count


def _work(args: tuple[list[int], str | None, int]) -> tuple[list[SeedResult], int]:
    return run_seeds(args[0], args[1], progress=True, costly_every=args[2])


def report(results: list[SeedResult], warnings: int, seconds: float) -> list[str]:
    """The summary lines; replay commands for failing seeds."""
    mutations = Counter(m.kind for r in results for m in r.mutations)
    targets = Counter(m.target for r in results for m in r.mutations)
    worst: dict[str, tuple[float, int]] = {}
    ends: Counter[str] = Counter()
    for r in results:
        for o in r.outcomes:
            name = o.read.split(" ckpt")[0]
            t, p = worst.get(name, (0.0, 0))
            worst[name] = (max(t, o.seconds), max(p, o.peak))
            ends[o.ended if o.ended in ("ok", "hang") else "typed error" if not o.violations else "other"] += 1
    failing = [r for r in results if r.violations]
    lines = [f"fuzz: {len(results)} seeds, {sum(len(r.outcomes) for r in results)} reads in {seconds:.0f} s; "
             f"{sum(len(r.violations) for r in failing)} violations in {len(failing)} seeds",
             f"bounds per read: {READ_SECONDS:g} s wall clock, {READ_PEAK_BYTES // 2**20} MiB peak (tracemalloc)",
             f"reads ended: {dict(ends)}; warnings logged (skips): {warnings}",
             "mutations: " + ", ".join(f"{k} {n}" for k, n in sorted(mutations.items())),
             "objects mutated: " + ", ".join(f"{k} {n}" for k, n in sorted(targets.items())),
             "worst read (seconds, peak MiB): " + ", ".join(
                 f"{k} {t:.2f} s {p / 2**20:.1f}" for k, (t, p) in worst.items())]
    for r in failing:
        lines.append(f"seed {r.seed} ({r.backend}): " + "; ".join(f"{m.kind} of {m.key}" for m in r.mutations))
        lines += [f"    {v}" for v in r.violations]
        lines.append(f"    replay: make fuzz SEED={r.seed} BACKEND={r.backend}   (or: PYTHONPATH=$PWD python "
                     f"tests/fuzz/run.py --seed {r.seed} --backend {r.backend})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="run seeds START..START+N-1")
    parser.add_argument("--start", type=int, default=0, help="the first seed (split a long run into parts)")
    parser.add_argument("--seed", type=int, help="replay one seed (prints its tracebacks)")
    parser.add_argument("--backend", choices=["memory", "local", "s3"], help="force one backend")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--costly-every", type=int, default=1,
                        help=f"run the costly reads ({', '.join(COSTLY)}) on every k-th seed only")
    args = parser.parse_args(argv)
    began = time.monotonic()
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.seeds))
    if args.jobs > 1 and len(seeds) > 1:
        mixed = sorted(seeds, key=lambda s: (s * 2654435761) % 2**32)  # every worker a like mix of backends and reads
        chunks = [(mixed[i::args.jobs], args.backend, args.costly_every) for i in range(args.jobs)]
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            parts = pool.map(_work, chunks)
        results = sorted((r for rs, _ in parts for r in rs), key=lambda r: r.seed)
        warnings = sum(w for _, w in parts)
    else:
        results, warnings = run_seeds(seeds, args.backend, costly_every=args.costly_every)
    print("\n".join(report(results, warnings, time.monotonic() - began)))
    if args.seed is not None:
        for o in results[0].outcomes:
            print(f"  {o.read}: {o.ended} in {o.seconds:.3f} s, peak {o.peak / 2**20:.1f} MiB")
            if o.trace:
                print(o.trace)
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
