"""Loop benchmark: what checkpointing costs per pass of a scripted agent loop.

Run: ``.venv/bin/python bench/loop_bench.py`` (10/100/1000 passes, a few
minutes) or ``--quick`` (10/100 passes, seconds). Prints a table and writes
``bench/results/loop.json`` (or ``--out``).

Each case runs ``Agent.run`` with a ``ScriptedModel`` (no model latency: the
loop's own overhead is what is measured) whose every pass calls one tool that
returns a 2 KB payload, so the transcript grows by ~2.2 KB per pass. Cases:

- ``bare``: checkpoint off, journal off (the loop alone);
- ``off``: checkpoint off, journal on (the default);
- ``sync`` / ``async``: ``Tuning(checkpoint=True)`` with ``durability`` sync or async;

on a local directory and on S3 (moto's server on loopback, in a process of its
own as a real endpoint is; ``--s3-in-process`` runs it in a thread of the
bench's process instead, where it competes with the loop for the interpreter
lock and an async upload cannot overlap anything). Ratios are taken
against the ``off`` case of the same backend and size, measured in the same
run (the machine is noisy and shared). Bytes are counted at the object-store
boundary (checkpoint objects, journal entries, index files) and compared with
the final transcript size. ``floor_ms`` is one raw PUT of the mean checkpoint
size through the same object store: the least a per-pass snapshot can cost.

A checkpoint holds only what its pass added (checkpoint format 2.0), so bytes
written per pass stay flat however long the session grows; ``KB/pass`` and
``ckpt ms/pass`` at 1000 passes show it in numbers.

Per case it also reports objects and bytes written per pass against a
budget of twice the bytes a pass adds to the transcript plus 1 KB, and what
a cold reader (a new process) pays to read the latest checkpoint back whole:
milliseconds, GETs, LISTs and round trips (calls waited for one after the
other; on S3, where a reader fetches a chain in parallel).

``--loomflow-python PATH`` runs the same loop on loomflow 0.20 (its
``ScriptedModel`` and ``SqliteRuntime`` with ``Tuning(checkpoint=True)``) in
that interpreter -- install loomflow into a separate venv, never this one.
loomflow checkpoints once per *architecture* pass (one per ``run`` for ReAct),
loomray once per *loop* pass; both counts are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loomray import Agent, Tuning  # noqa: E402
from loomray.checkpoint_format import load_checkpoint  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime import LocalRuntime  # noqa: E402
from loomray.storage import Store  # noqa: E402
from loomray.storage.objects import ObjectStore  # noqa: E402

PAYLOAD = 2048


def fetch(i: int) -> str:
    """Return a 2 KB page."""
    head = f"page {i}: "
    return head + ("abcdefghij" * (PAYLOAD // 10 + 1))[: PAYLOAD - len(head)]


class ByteCounter:
    """Counts bytes and PUTs crossing the object-store boundary."""

    def __init__(self, objects) -> None:
        self.objects, self.real, self.bytes, self.puts = objects, objects.put, 0, 0
        objects.put = self._put

    def _put(self, *args, **kw):
        data = kw.get("data", args[1] if len(args) > 1 else b"")
        self.bytes += len(data)
        self.puts += 1
        return self.real(*args, **kw)


def make_runtime(backend: str, name: str, tmp: Path, server) -> LocalRuntime:
    if backend == "local":
        return LocalRuntime(tmp / name)
    # A bucket per case: moto's LIST walks every key of a bucket, so a case sharing one with the cases before it
    # would pay for their objects (the last mode measured, async, paid most).
    return LocalRuntime(f"s3://{server.new_bucket('loopbench')}/{name}", **server.options)


async def run_case(backend: str, passes: int, mode: str, tmp: Path, server, delay_ms: float = 0.0) -> dict:
    name = f"{backend}-{passes}-{mode}-{delay_ms:g}ms"
    runtime = make_runtime(backend, name, tmp, server)
    counter = ByteCounter(runtime.store.objects)
    tuning = Tuning(checkpoint=mode in ("sync", "async"), durability="async" if mode == "async" else "sync",
                    journal=mode != "bare", max_turns=passes + 1)
    model = ScriptedModel([{"tool": "fetch", "args": {"i": i}} for i in range(passes - 1)] + ["done"],
                          delay=delay_ms / 1000)
    agent = Agent("bench", model=model, tools=[fetch], runtime=runtime, tuning=tuning)
    sizes: list[int] = []

    def emit(event) -> None:
        if event.type == "checkpoint" and event.ok:
            sizes.append(event.size)

    t0 = time.perf_counter()
    result = await agent.run("go", session_id="bench", emit=emit)
    wall = time.perf_counter() - t0
    assert result.turns == passes and result.model_calls == passes
    transcript = sum(len(m.model_dump_json()) for m in result.messages)
    start = sum(len(m.model_dump_json()) for m in result.messages[:2])  # the system message and the prompt
    read = read_latest(runtime, result.messages) if tuning.checkpoint else {}
    runtime.close()
    added = (transcript - start) / passes
    return {"backend": backend, "passes": passes, "mode": mode, "model_delay_ms": delay_ms, "wall_s": wall, "ms_per_pass": wall * 1000 / passes,
            "checkpoints": len(sizes), "checkpoint_bytes": sum(sizes),
            "mean_checkpoint_bytes": statistics.mean(sizes) if sizes else 0,
            "bytes_written": counter.bytes, "puts": counter.puts, "bytes_per_pass": counter.bytes / passes,
            "objects_per_pass": counter.puts / passes, "transcript_bytes": transcript,
            "added_bytes_per_pass": added, "written_per_added_byte": counter.bytes / max(1, transcript - start),
            "bytes_budget_per_pass": 2 * added + 1024, **read}


class CallRecorder(ObjectStore):
    """An object store that records when each call started and ended (for round trips) and what it was."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner, self.backend = inner, inner.backend
        self.calls: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def _timed(self, op: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        if op == "list":
            out = list(out)
        with self._lock:
            self.calls.append((op, t0, time.perf_counter()))
        return out

    def put(self, **kw):
        return self._timed("put", self.inner.put, **kw)

    def get(self, **kw):
        return self._timed("get", self.inner.get, **kw)

    def list(self, **kw):
        return iter(self._timed("list", self.inner.list, **kw))

    def list_dirs(self, **kw):
        return self._timed("list", self.inner.list_dirs, **kw)

    def delete(self, **kw):
        return self._timed("delete", self.inner.delete, **kw)

    def describe(self, key=None):
        return self.inner.describe(key)


def round_trips(calls: list[tuple[str, float, float]]) -> int:
    """Round trips a reader waited for: a call starts a new one when nothing it was issued with is in flight any
    more (every call of the round before has answered); calls in flight together are one round trip, however
    many a thread pool or the interpreter lock lets start at once."""
    rounds, end = 0, None
    for _, start, stop in sorted(calls, key=lambda c: c[1]):
        if end is None or start >= end:
            rounds, end = rounds + 1, stop
        else:
            end = max(end, stop)
    return rounds


def read_latest(runtime: LocalRuntime, messages) -> dict:
    """A cold reader (a new process: nothing cached) reads the session's latest checkpoint back whole."""
    recorder = CallRecorder(runtime.store.objects)
    reader = Store(recorder, runtime.store.url)
    t0 = time.perf_counter()
    ckpt = load_checkpoint(reader, "bench")
    ms = (time.perf_counter() - t0) * 1000
    assert ckpt is not None and ckpt.messages == messages
    ops = [op for op, _, _ in recorder.calls]
    reader.close(keep_objects=True)
    return {"read_latest_ms": ms, "read_latest_round_trips": round_trips(recorder.calls),
            "read_latest_gets": ops.count("get"), "read_latest_lists": ops.count("list")}


def floor_ms(backend: str, size: int, tmp: Path, server, reps: int = 10) -> float:
    """One raw PUT of ``size`` bytes through the same object store (median of ``reps``)."""
    runtime = make_runtime(backend, f"floor-{backend}-{size}", tmp, server)
    data = os.urandom(max(size, 1))
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        runtime.store.objects.put(key=f"floor/{i}.json", data=data)
        times.append(time.perf_counter() - t0)
    runtime.close()
    return statistics.median(times) * 1000


LOOMFLOW_SCRIPT = r"""
import asyncio, json, os, sys, tempfile, time
from loomflow import Agent, Tuning, ScriptedModel, ScriptedTurn
from loomflow.core.types import ToolCall
from loomflow.runtime.sqlite import SqliteRuntime

def fetch(i: int) -> str:
    '''Return a 2 KB page.'''
    head = f"page {i}: "
    return head + ("abcdefghij" * 210)[: 2048 - len(head)]

async def case(passes, ckpt):
    d = tempfile.mkdtemp()
    turns = [ScriptedTurn(tool_calls=[ToolCall(tool="fetch", args={"i": i})]) for i in range(passes - 1)]
    turns.append(ScriptedTurn(text="done"))
    agent = Agent("bench", model=ScriptedModel(turns), tools=[fetch], max_turns=passes + 1,
                  runtime=SqliteRuntime(os.path.join(d, "j.db"), max_checkpoints_per_session=0),
                  tuning=Tuning(checkpoint=ckpt))
    t0 = time.perf_counter()
    await agent.run("go", session_id="bench")
    wall = time.perf_counter() - t0
    metas = await agent.list_checkpoints("bench", limit=1000000)
    return {"passes": passes, "mode": "sync" if ckpt else "off", "wall_s": wall, "checkpoints": len(metas),
            "db_bytes": os.path.getsize(os.path.join(d, "j.db"))}

rows = [asyncio.run(case(int(p), c)) for p in sys.argv[1].split(",") for c in (False, True)]
print(json.dumps(rows))
"""


def loomflow_rows(python: str, sizes: list[int]) -> list[dict]:
    """The same scripted loop on loomflow 0.20 (SqliteRuntime), run by ``python`` (a separate venv)."""
    import subprocess

    out = subprocess.run([python, "-c", LOOMFLOW_SCRIPT, ",".join(map(str, sizes))], capture_output=True,
                         text=True, timeout=3600, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    by = {(r["passes"], r["mode"]): r for r in rows}
    for r in rows:
        base = by[(r["passes"], "off")]
        r.update(backend="loomflow", ms_per_pass=r["wall_s"] * 1000 / r["passes"],
                 ratio_to_off=r["wall_s"] / base["wall_s"],
                 ckpt_overhead_ms_per_pass=(r["wall_s"] - base["wall_s"]) * 1000 / r["passes"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 and 100 passes only (a smoke run)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "loop.json"))
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--sizes", default=None, help="comma-separated pass counts (default 10,100,1000; quick 10,100)")
    ap.add_argument("--s3-sizes", default=None, help="pass counts for S3 (default: same as --sizes)")
    ap.add_argument("--latency-ms", type=float, default=None,
                    help="also run off/sync/async with this model latency (default 20; 0 disables; quick: 0)")
    ap.add_argument("--latency-passes", type=int, default=100)
    ap.add_argument("--s3-in-process", action="store_true",
                    help="moto's server in a thread of this process (default: a process of its own)")
    ap.add_argument("--loomflow-python", default=None,
                    help="python of a separate venv with loomflow 0.20 installed: adds its rows side by side")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([10, 100] if args.quick else [10, 100, 1000])
    s3_sizes = [int(x) for x in args.s3_sizes.split(",")] if args.s3_sizes else sizes
    backends = args.backends.split(",")
    if args.latency_ms is None:
        args.latency_ms = 0.0 if args.quick else 20.0
    modes = ["bare", "off", "sync", "async"]

    from loomray.storage.testing import MotoS3Server

    server = MotoS3Server(own_process=not args.s3_in_process).start() if "s3" in backends else None
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        try:
            for backend in backends:
                for passes in (s3_sizes if backend == "s3" else sizes):
                    case_rows = {}
                    for mode in modes:
                        case_rows[mode] = asyncio.run(run_case(backend, passes, mode, tmp, server))
                    base = case_rows["off"]
                    mean_ck = case_rows["sync"]["mean_checkpoint_bytes"]
                    fl = floor_ms(backend, int(mean_ck), tmp, server)
                    for row in case_rows.values():
                        row["ratio_to_off"] = row["wall_s"] / base["wall_s"]
                        row["ckpt_overhead_ms_per_pass"] = (row["wall_s"] - base["wall_s"]) * 1000 / passes
                        row["floor_put_ms"] = fl
                        row["bytes_per_pass_over_transcript"] = row["bytes_per_pass"] / row["transcript_bytes"]
                        rows.append(row)
                    print(f"  done {backend} {passes} passes", file=sys.stderr, flush=True)
                    write_json(args, rows, [], partial=True)  # a long run keeps what it measured so far
        finally:
            if server is not None:
                server.stop()

    latency_rows: list[dict] = []
    if args.latency_ms > 0:
        # With a model that takes time, async durability hides the upload behind the next call.
        server = MotoS3Server(own_process=not args.s3_in_process).start() if "s3" in backends else None
        with tempfile.TemporaryDirectory() as tmpdir:
            try:
                for backend in backends:
                    case = {m: asyncio.run(run_case(backend, args.latency_passes, m, Path(tmpdir), server,
                                                    args.latency_ms)) for m in ("off", "sync", "async")}
                    for _m, row in case.items():
                        row["ratio_to_off"] = row["wall_s"] / case["off"]["wall_s"]
                        row["ckpt_overhead_ms_per_pass"] = (row["wall_s"] - case["off"]["wall_s"]) * 1000 / row["passes"]
                        latency_rows.append(row)
            finally:
                if server is not None:
                    server.stop()
    header = (f"{'backend':7} {'passes':>6} {'mode':6} {'wall s':>8} {'ms/pass':>8} {'x off':>6} "
              f"{'ckpt ms/pass':>12} {'floor ms':>9} {'ckpts':>6} {'obj/pass':>8} {'KB/pass':>8} {'budget KB':>9} "
              f"{'x added':>7} {'read RTs':>8} {'read GETs':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['backend']:7} {r['passes']:>6} {r['mode']:6} {r['wall_s']:>8.3f} {r['ms_per_pass']:>8.2f} "
              f"{r['ratio_to_off']:>6.2f} {r['ckpt_overhead_ms_per_pass']:>12.2f} {r['floor_put_ms']:>9.2f} "
              f"{r['checkpoints']:>6} {r['objects_per_pass']:>8.2f} {r['bytes_per_pass'] / 1024:>8.2f} "
              f"{r['bytes_budget_per_pass'] / 1024:>9.2f} {r['written_per_added_byte']:>7.2f} "
              f"{r.get('read_latest_round_trips', '-'):>8} {r.get('read_latest_gets', '-'):>9}")
    print("(budget: 2 x the bytes a pass adds to the transcript + 1 KB; x added: bytes written per byte added; "
          "read: a cold reader reading the latest checkpoint back whole, round trips counted on S3)")
    if latency_rows:
        print()
        print(f"with {args.latency_ms:g} ms model latency, {args.latency_passes} passes (async overlaps upload and call):")
        print(f"{'backend':7} {'mode':6} {'wall s':>8} {'ms/pass':>8} {'x off':>6} {'ckpt ms/pass':>12}")
        for r in latency_rows:
            print(f"{r['backend']:7} {r['mode']:6} {r['wall_s']:>8.3f} {r['ms_per_pass']:>8.2f} {r['ratio_to_off']:>6.2f} "
                  f"{r['ckpt_overhead_ms_per_pass']:>12.2f}")
        rows.extend(latency_rows)
    lf_rows: list[dict] = []
    if args.loomflow_python:
        lf_rows = loomflow_rows(args.loomflow_python, sizes)
        print()
        print("loomflow 0.20 (SqliteRuntime, Tuning(checkpoint=True)): one checkpoint per architecture pass")
        print(f"{'passes':>6} {'mode':5} {'wall s':>8} {'ms/pass':>8} {'x off':>6} {'ckpt ms/pass':>12} {'ckpts':>6}")
        for r in lf_rows:
            print(f"{r['passes']:>6} {r['mode']:5} {r['wall_s']:>8.3f} {r['ms_per_pass']:>8.2f} {r['ratio_to_off']:>6.2f} "
                  f"{r['ckpt_overhead_ms_per_pass']:>12.2f} {r['checkpoints']:>6}")
        print("loomray (above) writes one checkpoint per loop pass; compare the 'ckpts' columns.")
        ours = {(r["passes"], r["mode"]): r for r in rows if r["backend"] == "local" and not r["model_delay_ms"]}
        for r in lf_rows:
            mine = ours.get((r["passes"], "sync"))
            if r["mode"] == "sync" and mine is not None:
                print(f"local {r['passes']} passes: loomray (a checkpoint every pass) / loomflow (checkpoint on) = "
                      f"{mine['wall_s'] / r['wall_s']:.2f}")
    print(f"wrote {write_json(args, rows, lf_rows, partial=False)}")


def write_json(args, rows: list[dict], lf_rows: list[dict], *, partial: bool) -> Path:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "loop", "quick": args.quick, "partial": partial, "payload_bytes": PAYLOAD,
                               "python": platform.python_version(), "machine": platform.machine(),
                               "cpus": os.cpu_count(), "s3_server": "thread" if args.s3_in_process else "process", "rows": rows, "loomflow_rows": lf_rows}, indent=2))
    return out


if __name__ == "__main__":
    main()
