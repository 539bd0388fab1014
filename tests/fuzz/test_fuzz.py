"""The hostile-bucket fuzzer, a bounded set of seeds in the suite (``make fuzz SEEDS=N`` runs more).

Every seed mutates a copy of a small store of real sessions (``fuzz_world``) with one to three hostile
mutations (``fuzz_mutations``) and runs every read loomray makes of a store against it (``fuzz_targets``): each
must end within the stated bounds in a documented error or a logged skip, import and execute nothing, touch
nothing outside the store root and return no other session's data.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from collections import Counter

import pytest
from fuzz_mutations import mutate
from fuzz_targets import READ_PEAK_BYTES, READ_SECONDS, Recorder, reads, run_read
from fuzz_world import OTHER_USER_MARK, world
from run import backend_of, report, run_seeds

from loomray.storage import open_store

#: Seeds ``make test`` runs: one per backend (``make fuzz`` runs thousands, ``make fuzz BACKEND=s3`` the S3 ones).
#: Seed 7 (memory) flips bytes of a checkpoint, so reads end in typed errors and logged skips; seed 5 runs on a
#: local directory (its canary beside the store root) with a foreign control request and a flipped run record and
#: table partition.
SUITE_SEEDS = (7, 5)


@pytest.fixture(scope="module")
def suite_run():
    began = time.monotonic()
    results, warnings = run_seeds(list(SUITE_SEEDS), None)
    return results, warnings, time.monotonic() - began


def test_no_read_of_a_hostile_store_breaks_a_rule(suite_run):
    results, warnings, seconds = suite_run
    failing = [r for r in results if r.violations]
    assert not failing, "\n".join(report(results, warnings, seconds))
    assert {r.backend for r in results} == {"memory", "local"}
    assert all(len(r.outcomes) == len(reads(open_store("memory://"), ["c1", "c2"])) for r in results)
    worst = max(o.seconds for r in results for o in r.outcomes)
    assert worst < READ_SECONDS and max(o.peak for r in results for o in r.outcomes) < READ_PEAK_BYTES


def test_the_seeds_reach_hostile_paths(suite_run):
    """Not every read just succeeds: the mutations make reads end in typed errors and logged skips."""
    results, warnings, _ = suite_run
    ends = Counter(o.ended for r in results for o in r.outcomes)
    assert ends["ok"] and sum(n for e, n in ends.items() if e != "ok") >= 3 and warnings >= 10


def test_mutations_cover_every_kind_of_object_and_every_kind_of_mutation(monkeypatch):
    """Over many seeds (mutations alone, no reads: quick), every kind of stored object and of mutation occurs.
    Oversize bodies are made small here: two thirds of the time went into random megabytes no check looks at."""
    import fuzz_mutations

    monkeypatch.setattr(fuzz_mutations, "OVERSIZE", 64)
    w = world()
    made = [m for seed in range(400) for m in mutate(random.Random(seed), w, dict(w.objects))]
    kinds = {m.kind for m in made}
    assert kinds == {"truncate", "flip bytes", "delete", "oversize", "deep nesting", "wrong type", "huge number",
                     "other ids", "foreign key", "hostile chain"}
    assert {m.target for m in made} == {
        "checkpoint 1.0", "checkpoint 2.0", "journal entry", "run record", "lease", "lease copy", "epoch marker",
        "pin", "control request", "active mark", "checkpoint index file", "session index file",
        "table partition", "table manifest"}
    assert {m.target for m in made if m.kind == "hostile chain"} >= {"checkpoint 2.0", "checkpoint index file"}


def test_the_same_seed_makes_the_same_mutations():
    w = world()
    first, second = dict(w.objects), dict(w.objects)
    assert mutate(random.Random(7), w, first) == mutate(random.Random(7), w, second) and first == second
    assert backend_of(5, None) == "local" and backend_of(7, None) == "memory" and backend_of(5, "memory") == "memory"


# -- the checks themselves catch what they are for -------------------------------------------------------------------
@pytest.fixture
def recorder():
    store = open_store("memory://")
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    yield Recorder(store), store
    store.close()


def test_an_untyped_error_is_a_violation(recorder):
    rec, _ = recorder
    assert run_read("r", False, lambda: {}["x"], rec, set()).violations[0].startswith("r: untyped KeyError")
    assert run_read("r", False, lambda: int("x"), rec, set()).violations


def test_returning_another_users_content_is_a_violation(recorder):
    rec, _ = recorder
    out = run_read("r", False, lambda: f"... {OTHER_USER_MARK} ...", rec, set())
    assert out.violations == [f"r: returned another session's content ({OTHER_USER_MARK})"]
    assert not run_read("r", False, lambda: OTHER_USER_MARK, rec, {OTHER_USER_MARK}).violations


def test_fetching_outside_the_users_prefixes_is_a_violation(recorder):
    rec, store = recorder
    out = run_read("r", True, lambda: store.objects.get(key="sessions/bob/s-b/lease.json"), rec, set())
    assert out.violations == ["r: fetched 'sessions/bob/s-b/lease.json'"]
    assert not run_read("r", True, lambda: store.objects.get(key="sessions/alice/x"), rec, set()).violations


def test_importing_executing_or_unpickling_during_a_read_is_a_violation(recorder):
    rec, _ = recorder

    def hostile():
        import pickle

        exec("x = 1")  # noqa: S102 - what the audit hook must see
        try:
            __import__("loomray_fuzz_module_named_by_the_bucket")
        except ImportError:
            pass
        return pickle.loads(pickle.dumps(Counter()))

    found = run_read("r", False, hostile, rec, set()).violations
    assert any("exec" in v for v in found) and any("pickle.find_class" in v for v in found)
    assert any("import loomray_fuzz_module_named_by_the_bucket" in v for v in found)


def test_a_read_that_does_not_end_is_a_violation(recorder, monkeypatch):
    import threading

    import fuzz_targets

    rec, _ = recorder
    monkeypatch.setattr(fuzz_targets, "READ_SECONDS", 0.2)
    release = threading.Event()
    out = run_read("r", False, lambda: release.wait(30), rec, set())
    release.set()
    assert out.ended == "hang" and out.violations == ["r: still running after 0.2 s"]


def test_every_read_is_run(recorder):
    _, store = recorder
    names = [name for name, _, _ in reads(store, ["c1"])]
    assert names[:4] == ["list checkpoints", "load latest", "get latest bytes", "load c1"]
    assert {"journal replay", "run records", "control consume", "pins", "query", "list_sessions", "active marks",
            "lease take", "compact", "resume"} <= set(names)


def test_returning_a_table_arrow_rejects_is_a_violation_not_a_fuzzer_error(recorder):
    """Text that is not UTF-8 (a Parquet file's flipped bytes) is judged, and searched for markers as bytes."""
    import pyarrow as pa

    rec, _ = recorder
    data = f"\xff{OTHER_USER_MARK}".encode("latin-1")
    text = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(b"\0\0\0\0" + len(data).to_bytes(4, "little")),
                                                  pa.py_buffer(data)])
    out = run_read("r", False, lambda: pa.table({"t": text}), rec, set())
    assert out.violations[0].startswith("r: returned a table its caller cannot read: ")
    assert out.violations[1:] == [f"r: returned another session's content ({OTHER_USER_MARK})"]
