"""Hostile checkpoint objects, one PUT each: a chain range no writer wrote, and intact JSON of the wrong shape.

Each ends at once in :class:`CheckpointException` naming the checkpoint, in bounded time and memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

from loomray import CheckpointConfig, CheckpointException
from loomray.checkpoint_format import ChainEncoder, load_checkpoint
from loomray.storage import CheckpointInfo, chains, envelope, layout, open_store
from loomray.storage.testing import land_row

ROOT = Path(__file__).resolve().parents[2]
SEGMENT = "ckpt" + "0" * 19 + "1"
HUGE_RANGE = f"{SEGMENT}000000..{SEGMENT}ffffff"  # 16,777,216 links in 63 bytes


def put_tail(store, session_id: str, checkpoint_id: str, body: dict, **header) -> None:
    """One self-describing checkpoint object with an intact digest, as a writer's tail (no index row)."""
    head = {"session_id": session_id, "checkpoint_id": checkpoint_id, "turn": 0, "position": "after_tools",
            "created_at": "2026-07-04T00:00:00+00:00", "execution_status": "active", "message_count": 0,
            "epoch": 0, **header}
    key = layout.checkpoint_key(session_id, None, checkpoint_id)
    store.objects.put(key=key, data=envelope.wrap(json.dumps(body).encode(), head))


CHILD = textwrap.dedent("""
    import json, sys, time, tracemalloc
    sys.path.insert(0, sys.argv[1])
    from test_hostile_checkpoints import HUGE_RANGE, SEGMENT, put_tail
    from loomray import CheckpointException
    from loomray.checkpoint_format import load_checkpoint
    from loomray.storage import open_store

    store = open_store(sys.argv[2])
    put_tail(store, "s", SEGMENT + "000001", {"schema_version": "2.0", "base": SEGMENT + "000000", "keep": 0,
                                              "messages": []}, chain=[HUGE_RANGE])
    tracemalloc.start()
    began = time.monotonic()
    try:
        load_checkpoint(store, "s")
        error = None
    except CheckpointException as e:
        error = str(e)
    print(json.dumps({"error": error, "seconds": time.monotonic() - began,
                      "peak": tracemalloc.get_traced_memory()[1]}))
""")


@pytest.mark.parametrize("backend", ["memory", "local"])
def test_a_chain_range_of_16_million_links_is_refused_at_once_in_bounded_memory(tmp_path, backend):
    """Before the bound, "latest" expanded the range and prefetched every link (268 s, 4.5 GB measured)."""
    url = "memory://" if backend == "memory" else str(tmp_path / "store")
    try:  # a child process: the unbounded read must not take this test process's memory with it
        done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent), url], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("reading 'latest' did not end within 60 s")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["error"] is not None and "more than any writer writes" in out["error"]
    assert "'latest' of session 's'" in out["error"]
    assert out["seconds"] < 5.0  # generous for a busy machine: it takes milliseconds
    assert out["peak"] < 20 * 2**20


def test_a_chain_of_as_many_links_as_a_writer_writes_still_expands():
    chain = [f"{SEGMENT}000000..{SEGMENT}{chains.MAX_LINKS - 1:06x}"]
    assert len(chains.expand(chain, "s")) == chains.MAX_LINKS
    with pytest.raises(ValueError, match="more than any writer writes"):
        chains.expand([*chain, "ckpt-other"], "s")
    with pytest.raises(ValueError, match="more than any writer writes"):
        chains.expand([f"{SEGMENT}000000..{SEGMENT}{chains.MAX_LINKS:06x}"], "s")


def test_no_configuration_writes_a_chain_a_reader_refuses():
    from loomray import config

    assert config.MAX_LINKS == chains.MAX_LINKS
    MAX_LINKS = chains.MAX_LINKS
    assert CheckpointConfig(full_every=MAX_LINKS).full_every == chains.MAX_LINKS
    with pytest.raises(ValueError, match="full_every"):
        CheckpointConfig(full_every=MAX_LINKS + 1)
    with pytest.raises(ValueError, match="full_every"):
        ChainEncoder(None, full_every=MAX_LINKS + 1)


def _v2(**fields) -> dict:
    return {"schema_version": "2.0", "base": None, "keep": 0, "messages": [], **fields}


MALFORMED = {
    "messages is a number": _v2(messages=5),
    "keep is a string": _v2(keep="x"),
    "keep is a list": _v2(keep=[]),
    "keep beyond the base": _v2(keep=3),
    "a message is a number": _v2(messages=[1]),
    "a message of the wrong shape": _v2(messages=[{"role": 7}]),
    "usage is a list": _v2(cumulative_usage=[1]),
    "pending approvals is a number": _v2(pending_approvals=7),
    "base of the wrong type": _v2(base={"a": 1}),
    "base names a bad id": _v2(base="../x"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
@pytest.mark.parametrize("checkpoint_id", ["latest", "c1"])
def test_intact_but_malformed_checkpoint_objects_are_checkpoint_exceptions(name, checkpoint_id):
    store = open_store("memory://")
    put_tail(store, "s", "c1", MALFORMED[name])
    with pytest.raises(CheckpointException) as info:
        load_checkpoint(store, "s", checkpoint_id)
    assert f"checkpoint {checkpoint_id!r} of session 's'" in str(info.value)


def test_a_checkpoint_of_another_session_copied_under_this_one_is_refused():
    store = open_store("memory://")
    body = {"schema_version": "1.0", "session_id": "other", "checkpoint_id": "c1", "turn": 0,
            "created_at": "2026-07-04T00:00:00+00:00", "position": "after_tools", "execution_status": "active",
            "messages": [{"role": "user", "content": "the other session's words"}]}
    land_row(store, json.dumps(body).encode(), CheckpointInfo(  # a format 1.0 object, as an older writer stored it
        session_id="s", checkpoint_id="c1", turn=0, position="after_tools", created_at=datetime.now(timezone.utc),
        execution_status="active", message_count=1), epoch=0)
    with pytest.raises(CheckpointException, match="holds session 'other'"):
        load_checkpoint(store, "s", "c1")
