"""The bounded durability run: a fixed set of seeded fault-injection scenarios on every backend.

Each case is one ``(seed, scenario, backend)`` of ``durability_scenarios``;
a failure prints the violated invariants and the command that replays the
case (``make soak SEED=... SCENARIO=... BACKEND=...``, with the full call
trace). ``make soak SEEDS=N`` runs many more.
"""

from __future__ import annotations

import re

import pytest
from durability_scenarios import KINDS, run_scenario
from soak import main as soak_main

#: Seeds 0-41 on memory, 42-62 on a local directory, 63-71 on S3: every scenario kind on every backend.
BOUNDED = ([(s, KINDS[s % len(KINDS)], "memory") for s in range(42)]
           + [(s, KINDS[s % len(KINDS)], "local") for s in range(42, 63)]
           + [(s, KINDS[s % len(KINDS)], "s3") for s in range(63, 72)])

#: Soak finds pinned as regression cases (replay any with ``make soak SEED=.. SCENARIO=.. BACKEND=..``).
PINNED = [(89, "lease-storm", "local"), (146, "compaction", "local"), (627, "chaos", "memory"), (88, "chaos", "memory"),
          (532, "zombie", "memory"), (1021, "lease-loss", "memory"),
          # A checkpoint whose PUT landed though its writer saw it fail was taken for the writer's tail and
          # indexed by the next takeover, its chain's base long collected (chain-intact).
          (366, "chaos", "memory"), (335, "compaction", "local")]

#: Cases that show a known, still-open violation: (seed, kind, backend) -> why. Strict: once the bug is
#: fixed the case passes, the xfail turns into a failure, and its line here must go (the case stays).
KNOWN: dict[tuple[int, str, str], str] = {}


def _cases():
    for seed, kind, backend in BOUNDED + PINNED:
        marks = [pytest.mark.s3] if backend == "s3" else []
        reason = KNOWN.get((seed, kind, backend))
        if reason:
            marks.append(pytest.mark.xfail(reason=reason, strict=True))
        yield pytest.param(seed, kind, backend, marks=marks, id=f"{backend}-{kind}-{seed}")


@pytest.mark.parametrize("seed,kind,backend", list(_cases()))
def test_scenario_keeps_every_invariant(seed, kind, backend, request):
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    result = run_scenario(seed, kind, backend, s3_server=s3)
    assert result.calls > 0
    assert result.ok, result.report()


def _signature(seed: int, kind: str) -> list[str]:
    result = run_scenario(seed, kind, "memory")
    # Ids and index file names carry the time; everything else must repeat exactly.
    return [re.sub(r"(ckpt|run)[0-9a-f]{26}|\d{19}-[0-9a-f]{8}", "*", line) for line in result.trace]


def test_a_seed_replays_the_same_interleaving_and_faults():
    first = _signature(27, "chaos")
    assert len(first) > 50 and any("[" in line for line in first)  # faults were injected
    assert _signature(27, "chaos") == first


def test_soak_prints_a_summary_line(capsys):
    code = soak_main(["--seeds", "2", "--first", "0", "--backends", "memory"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("soak: "))
    assert re.search(r"soak: 2 scenarios \(.*\), \d+ storage calls, fault kinds covered: .*; \d+ invariant violations", line)
    assert code == (0 if " 0 invariant violations" in line else 1)
