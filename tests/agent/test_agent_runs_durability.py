"""Runs and the journal under faults: prune, fencing, secrets, resume(None), run order.

Each test names the path it closes: 2 (``prune(before=T)`` never breaks
recovery of an unfinished run), 5 (replay never uses a journal entry of a
fenced writer; appends do not read the lease), 7 (run requests stay out of
the Parquet index; S3 server-side encryption on every PUT), 15
(``resume(None)`` on an unfinished run continues it, each turn billed once)
and 18 (the store, not a node's clock, orders a session's runs).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from agent_helpers import Crash, crash_at, lookup, tool_calls

import loomray.session as session_mod
from loomray import Agent, CheckpointConfig, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage import SessionRow
from loomray.storage.errors import TransientStorageError
from loomray.storage.rows import JournalEntry

CHILD = Path(__file__).with_name("crash_child.py")
REPO = Path(__file__).resolve().parents[2]
PASSES = 4  # tool passes; one more pass gives the final answer


def scripted(final: str = "report: done") -> ScriptedModel:
    return ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(PASSES)] + [final])


def agent_for(runtime, model, checkpoint=True) -> Agent:
    ckpt = CheckpointConfig(position="after_tools") if checkpoint else False
    return Agent("You look things up.", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=ckpt))


def each_once() -> dict[str, int]:
    return {f"k{i}": 1 for i in range(PASSES)}


# -- path 2: prune(before=T) keeps what an unfinished run needs --------------------------------
async def test_path02_prune_before_never_breaks_recovery_of_an_unfinished_run(runtime):
    model = scripted()
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):  # three passes done and checkpointed, then the process "dies"
        await agent.run("task", session_id="s", emit=crash_at("model_call", 4))
    store = runtime.store
    run_id = store.sessions.get("s").run_id
    assert model.calls == 3 and len(store.checkpoints.list("s")) == 3

    report = store.prune(before=datetime.now(timezone.utc) + timedelta(hours=1), session_id="s")  # all is older
    result = await agent.run("task", session_id="s")  # what every restart does: re-issue the run
    assert result.run_id == run_id and result.output == "report: done"
    assert model.calls == PASSES + 1 and tool_calls == each_once()  # nothing re-run
    # The older checkpoints went; the run's journal and its latest checkpoint had stayed.
    assert report.checkpoints == 2 and report.journal_entries == 0


async def test_path02_prune_before_still_deletes_a_finished_run(runtime):
    agent = agent_for(runtime, ScriptedModel([*scripted().responses, "again: done"]))
    await agent.run("task", session_id="s")
    await agent.run("again", session_id="s")  # continues the conversation: answered from the script's end
    store = runtime.store
    report = store.prune(before=datetime.now(timezone.utc) + timedelta(hours=1), session_id="s")
    assert store.checkpoints.list("s") == [] and report.checkpoints > 0
    # Every journal entry goes but the last run's run_end: without it the finished run would read as
    # unfinished, and a restart would run it again.
    last = store.runs.last("s").run_id
    assert [(r, e.kind) for r in store.journal.runs("s") for e in store.journal.list("s", r)] == [(last, "run_end")]
    # The records the last run is chosen among stay (so prune never changes which run is last; the newest also
    # anchors the store's run order): here both.
    assert report.run_records == 0 and [r.n for r in store.runs.list("s")] == [0, 1]


# -- path 5: journal fencing -------------------------------------------------------------------
@pytest.mark.parametrize("when", ["after_the_seal", "during_the_takeover", "after_a_takeover_that_never_sealed"])
async def test_path05_fenced_journal_entry_never_replayed(runtime, when):
    """An old incarnation (epoch 1) appends the model answer of turn 2 after a newer one (epoch 2) took
    the session: after the newer one sealed the run, or between its listing and its lease swap.
    The next incarnation must call the model for turn 2 instead of replaying the fenced answer."""
    model = scripted()
    agent = agent_for(runtime, model, checkpoint=False)  # journal only: replay is all there is
    with pytest.raises(Crash):  # epoch 1 journals the model answer of turn 2, then "freezes"
        await agent.run("task", session_id="s", emit=crash_at("model_response", 3))
    store = runtime.store
    run_id = store.sessions.get("s").run_id
    late = next(e for e in store.journal.list("s", run_id) if e.step_key == "t0002-model")
    key = f"sessions/_/s/journal/{run_id}/{late.seq:08d}-{late.step_key}.json"
    store.objects.delete(keys=[key])  # ... so its write lands only later (same inputs, same hash)
    response = json.loads(json.dumps(late.output["response"]))
    response["message"].update(content="ZOMBIE ANSWER", tool_calls=[])
    zombie = late.model_copy(update={"output": {"response": response}, "epoch": 1})
    assert zombie.epoch < store.leases.current_epoch("s") + 1

    def zombie_append():
        store.journal.append(zombie)  # no lease given: the check-then-put race, already lost

    if when == "during_the_takeover":
        real_put = store.objects.put

        def put(*, key, data, **kw):
            if key.endswith("/lease.json") and not zombie_done:  # the takeover's lease swap
                zombie_done.append(key)
                zombie_append()
            return real_put(key=key, data=data, **kw)

        zombie_done: list[str] = []
        store.objects.put = put  # instance attribute: this store only
        try:
            with pytest.raises(Crash):  # epoch 2 takes over (and seals), then dies at once
                await agent.run("task", session_id="s", emit=crash_at("run_start"))
        finally:
            del store.objects.put
        assert zombie_done
    elif when == "after_a_takeover_that_never_sealed":
        real_put = store.objects.put

        def put(*, key, data, **kw):
            if "-seal-e" in key:  # epoch 2 took the lease, then could not write its seal
                raise TransientStorageError(f"{key}: injected failure")
            return real_put(key=key, data=data, **kw)

        store.objects.put = put
        try:
            with pytest.raises(TransientStorageError):
                await agent.run("task", session_id="s")
        finally:
            del store.objects.put
        assert store.leases.current_epoch("s") == 2
        zombie_append()  # epoch 3 must fence it on epoch 2's behalf: the lease swap recorded the listing
    else:
        with pytest.raises(Crash):
            await agent.run("task", session_id="s", emit=crash_at("run_start"))
        zombie_append()
    assert b"ZOMBIE ANSWER" in store.objects.get(key=key).data  # the fenced writer's entry is there

    calls_before = model.calls
    result = await agent.run("task", session_id="s")  # epoch 3
    assert result.run_id == run_id
    assert all("ZOMBIE" not in (m.content or "") for m in result.messages)
    assert result.output == "report: done"
    assert model.calls == calls_before + PASSES + 1 - 2  # turns 2..4 asked again, 0..1 replayed
    assert all(e.step_key != "t0002-model" or e.epoch == 3 for e in store.journal.list("s", run_id))


def test_path05_journal_appends_do_not_read_the_lease(tmp_path):
    """A step costs one PUT: the lease is read when it is taken (and at most once per pass, see
    ``test_review_r2_lease_reads_per_pass``), not once per journal append."""

    def lease_reads(calls: int, name: str) -> int:
        runtime = LocalRuntime(tmp_path / name)
        real_get = runtime.store.objects.get
        reads = []

        def get(*, key):
            if key.endswith("lease.json"):
                reads.append(key)
            return real_get(key=key)

        runtime.store.objects.get = get
        batch = {"tool_calls": [{"name": "lookup", "arguments": {"key": f"k{i}"}} for i in range(calls)]}
        model = ScriptedModel([batch, "done"])  # one pass with ``calls`` tool calls (and appends)
        agent = Agent("", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=False))
        agent.run_sync("task", session_id="s")
        runtime.close()
        return len(reads)

    assert lease_reads(12, "long") == lease_reads(1, "short")


def test_path05_seal_fences_later_and_racing_entries(store):
    """Storage-level rule: an entry of epoch e is used only below every seal of a higher epoch, and an
    older-epoch entry that appeared between the pre-lease listing and the seal is excluded by name."""
    def entry(seq, step, epoch):
        return JournalEntry(session_id="s", run_id="r", seq=seq, step_key=step, kind="model", epoch=epoch)

    assert store.leases.acquire("s", owner="old").epoch == 1
    store.journal.append(entry(0, "a", 1))
    seen = store.journal.keys("s", "r")  # the new owner lists before taking the lease ...
    store.journal.append(entry(1, "b", 1))  # ... the old writer appends during the takeover ...
    lease = store.leases.acquire("s", owner="new")
    assert lease.epoch == 2
    run = store.journal.seal("s", "r", lease=lease, seen_before=seen)  # ... and the seal names it
    seal = [e for e in run.all if e.kind == "seal"][0]
    assert seal.seq == 2 and seal.output["excluded"] == ["00000001-b"]
    store.journal.append(entry(2, "c", 1))  # after the seal, same seq: fenced
    store.journal.append(entry(3, "d", 2))  # the new owner's own entry
    assert [e.step_key for e in store.journal.list("s", "r") if e.kind != "seal"] == ["a", "d"]
    assert [e.step_key for e in store.journal.list("s", "r", include_fenced=True)] == ["a", "b", "c", "seal-e2", "d"]


# -- path 7: run requests stay out of the index; SSE ------------------------------------------
async def test_path07_run_request_secrets_never_reach_the_index(tmp_path):
    runtime = LocalRuntime(tmp_path / "d")
    agent = Agent("", model=ScriptedModel(["done"]), runtime=runtime)
    result = await agent.run("task", session_id="s", context={"api_key": "sk-SECRET-ctx"},
                             metadata={"token": "tok-SECRET-meta"})
    for path in (tmp_path / "d" / "index").rglob("*.parquet"):
        raw = path.read_bytes()
        assert b"SECRET" not in raw, path
        table = pq.read_table(io.BytesIO(raw))
        if "spec_json" in table.column_names:
            assert table["spec_json"].null_count == table.num_rows
    # The request lives beside the session's own objects, in the run's record ...
    record = runtime.store.runs.last("s")
    assert record.run_id == result.run_id and record.request["context"] == {"api_key": "sk-SECRET-ctx"}
    assert list((tmp_path / "d" / "sessions" / "_" / "s" / "runs").iterdir())
    # ... and prune removes it with the rest of the session.
    runtime.store.prune(session_id="s")
    assert runtime.store.runs.last("s") is None
    assert not any(b"SECRET" in p.read_bytes() for p in (tmp_path / "d").rglob("*") if p.is_file())
    runtime.close()


@pytest.mark.parametrize("sse", [{"sse": "AES256"}, {"sse": "aws:kms", "sse_kms_key_id": "alias/loomray-test"}])
async def test_path07_s3_server_side_encryption_on_every_put(s3_server, sse):
    bucket = s3_server.new_bucket("sse")
    runtime = LocalRuntime(f"s3://{bucket}/root", **s3_server.options, **sse)
    agent = agent_for(runtime, scripted())
    await agent.run("task", session_id="s", metadata={"k": "v"})
    client = s3_server.client()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="root/")["Contents"]]
    kinds = {k.split("/")[1] if k.split("/")[1] == "index" else k.split("/")[4].split(".")[0] for k in keys}
    assert {"index", "checkpoints", "journal", "runs", "lease"} <= kinds
    for key in keys:
        head = client.head_object(Bucket=bucket, Key=key)
        assert head.get("ServerSideEncryption") == sse["sse"], key
        if "sse_kms_key_id" in sse:
            assert sse["sse_kms_key_id"].split("/")[-1] in head.get("SSEKMSKeyId", ""), key
    runtime.close()


def test_path07_sse_options_are_validated():
    from loomray.storage.s3 import S3ObjectStore

    with pytest.raises(ValueError, match="sse must be one of"):
        S3ObjectStore("bucket", sse="rot13", client=object())
    with pytest.raises(ValueError, match="needs sse='aws:kms'"):
        S3ObjectStore("bucket", sse="AES256", sse_kms_key_id="k", client=object())


def test_path08_session_rows_that_name_another_partition_are_ignored(tmp_path):
    """A row file copied into session s-a's partition that speaks for s-b is not s-b's state."""
    from loomray.storage import open_store
    from loomray.storage.rows import session_rows_table

    store = open_store(tmp_path / "d")
    store.sessions.put(SessionRow("s-b", None, "completed", datetime.now(timezone.utc)))
    forged = session_rows_table([SessionRow("s-b", None, "running", datetime.now(timezone.utc) + timedelta(hours=1),
                                            run_id="r", agent_ref="evil:agent", node_id="n1")])
    sink = io.BytesIO()
    pq.write_table(forged, sink)
    store.objects.put(key="index/sessions/user=_/session=s-a/0000000000000000001-forged.parquet", data=sink.getvalue())
    assert store.sessions.get("s-b").status == "completed"
    assert [(r.session_id, r.status) for r in store.sessions.list()] == [("s-b", "completed")]
    store.close()


# -- path 15: resume(None) continues an unfinished run --------------------------------------------
async def test_path15_resume_none_continues_the_unfinished_run_billing_each_turn_once(runtime):
    model = scripted()
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):  # the model answered turn 2 (journaled) and the process died mid-pass
        await agent.run("task", session_id="s", emit=crash_at("model_response", 3))
    run_id = runtime.store.sessions.get("s").run_id
    assert model.calls == 3 and (await agent.get_checkpoint("s")).turn == 2

    result = await agent.resume(session_id="s")  # prompt=None
    assert result.run_id == run_id and result.session_id == "s" and result.output == "report: done"
    assert model.calls == PASSES + 1  # every reply served once across both attempts
    assert result.model_calls == 2 and tool_calls == each_once()
    assert not any(m.content == "Continue the interrupted task." for m in result.messages)


def test_path15_resume_none_after_sigkill_mid_pass_in_another_process(tmp_path):
    """The issue's case with a real process: SIGKILL right after the turn-2 model answer, then
    ``resume(None)`` in a fresh process. The file-backed counter shows each reply served once."""
    env = {**os.environ, "CRASH_POSITION": "after_tools", "PYTHONPATH": str(REPO)}

    def child(out, kill="", resume=False):
        return subprocess.run([sys.executable, str(CHILD), str(tmp_path), "sess-crash", str(out), kill],
                              env={**env, **({"CRASH_RESUME": "1"} if resume else {})},
                              capture_output=True, text=True, timeout=120)

    first = child(tmp_path / "first.json", "event:model_response:3")
    assert first.returncode == -9, first.stderr[-2000:]
    second = child(tmp_path / "second.json", resume=True)
    assert second.returncode == 0, second.stderr[-2000:]
    calls = [int(x) for x in (tmp_path / "model_calls").read_text().split()]
    assert sorted(calls) == list(range(6)), calls  # 5 tool passes + the final answer, each once
    effects = (tmp_path / "effects").read_text().split()
    assert effects == [f"ray-{i}" for i in range(5)]
    out = json.loads((tmp_path / "second.json").read_text())
    assert out["output"] == "report: done" and out["model_calls"] == 3


# -- path 18: store-sequenced run order --------------------------------------------------------
async def test_path18_last_run_is_the_one_the_store_sequenced_last(runtime, monkeypatch):
    """Two nodes with skewed clocks: the second run's id sorts *before* the first's. The second run is
    interrupted; re-issuing it must continue it, not take the finished first run as "the last"."""
    ids = iter(["run-z-node-with-fast-clock", "run-a-node-with-slow-clock", "run-m-unexpected"])
    real_new_id = session_mod.new_id
    monkeypatch.setattr(session_mod, "new_id", lambda prefix: next(ids) if prefix == "run" else real_new_id(prefix))
    first = await agent_for(runtime, ScriptedModel(["first done"])).run("first task", session_id="s")
    assert first.run_id == "run-z-node-with-fast-clock"

    model = ScriptedModel(["first done", *scripted().responses])  # the second run continues the first's conversation
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):
        await agent.run("second task", session_id="s", emit=crash_at("model_call", 3))
    assert runtime.store.sessions.get("s").run_id == "run-a-node-with-slow-clock"
    result = await agent.run("second task", session_id="s")
    assert result.run_id == "run-a-node-with-slow-clock"
    assert model.calls == PASSES + 1 and tool_calls == each_once()
    assert [r.run_id for r in runtime.store.runs.list("s")] == ["run-z-node-with-fast-clock",
                                                                "run-a-node-with-slow-clock"]


async def test_path18_sessions_without_run_records_fall_back_to_journal_order(runtime):
    """Data written before run records existed: no ``runs/``; the sorted journal run ids order the runs."""
    model = scripted()
    agent = agent_for(runtime, model)
    with pytest.raises(Crash):
        await agent.run("task", session_id="s", emit=crash_at("model_call", 3))
    store = runtime.store
    run_id = store.sessions.get("s").run_id
    store.objects.delete(keys=[o.key for o in store.objects.list(prefix="sessions/_/s/runs/")])
    assert store.runs.last("s") is None
    result = await agent.run("task", session_id="s")
    assert result.run_id == run_id and model.calls == PASSES + 1 and tool_calls == each_once()
    # It is sequenced from now on.
    assert [r.run_id for r in store.runs.list("s")] == [run_id]


async def test_old_session_rows_with_the_request_still_load(tmp_path):
    """Index rows written before this release carry the request in ``spec_json``: still readable."""
    from loomray.storage import open_store

    store = open_store(tmp_path / "d")
    old = SessionRow("s", None, "running", datetime.now(timezone.utc), run_id="r1", agent_ref="m:a",
                     spec_json='{"kind": "run", "prompt": "x", "session_id": "s"}', epoch=1, node_id="n1")
    store.sessions.put(old)
    row = store.sessions.get("s")
    assert row.spec_json == old.spec_json and row.status == "running"
    assert pa.__version__  # pyarrow reads the same files (hive partitions) as before
    store.close()


# -- review findings -------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["sealed_above_the_listing", "fence_completed_from_the_lease_note",
                                 "sealed_after_a_fresh_listing"])
def test_review_r1_seal_fences_a_late_entry_below_the_listed_max(store, how):
    """Concurrent tool appends land out of seq order: seq 3 lands while seq 2's PUT is still in flight.
    The new owner lists (max 3) and seals at 4; then the fenced writer's seq-2 entry lands. Replay must
    not use it: the seal names the seqs its listing was missing below the max."""
    from loomray.storage.journal import FenceNote

    def entry(seq, step, kind="tool", epoch=1):
        return JournalEntry(session_id="s", run_id="r", seq=seq, step_key=step, kind=kind, epoch=epoch)

    old = store.leases.acquire("s", owner="old")
    store.runs.create("s", run_id="r", epoch=old.epoch)
    for e in (entry(0, "run-start", "run_start"), entry(1, "t0001-model", "model"), entry(3, "t0001-tool-b")):
        store.journal.append(e)
    if how == "sealed_above_the_listing":  # what execute_request does: list in the swap, seal right after
        fence = FenceNote(lambda: store.journal.listing("s", run_id="r"))
        new = store.leases.acquire("s", owner="new", note=fence)
        for run_id, keys in fence.listing.runs.items():
            store.journal.seal_listed("s", run_id, lease=new, listed=keys)
    elif how == "fence_completed_from_the_lease_note":  # the new owner dies before its seal ...
        store.leases.acquire("s", owner="dies", note=FenceNote(lambda: store.journal.listing("s", run_id="r")))
    else:
        seen = store.journal.keys("s", "r")
        new = store.leases.acquire("s", owner="new")
        store.journal.seal("s", "r", lease=new, seen_before=seen)
    store.journal.append(entry(2, "t0001-tool-a"))  # the fenced writer's in-flight PUT lands now
    if how == "fence_completed_from_the_lease_note":  # ... and the next one writes its seal for it
        fence = FenceNote(lambda: store.journal.listing("s", run_id="r"))
        newer = store.leases.acquire("s", owner="newer", note=fence)
        store.journal.complete_fences("s", chain=fence.chain, listed=dict(fence.listing.runs))
        for run_id, keys in fence.listing.runs.items():
            store.journal.seal_listed("s", run_id, lease=newer, listed=keys)
    used = [(e.seq, e.step_key) for e in store.journal.list("s", "r") if e.kind != "seal"]
    assert used == [(0, "run-start"), (1, "t0001-model"), (3, "t0001-tool-b")]
    seal = next(e for e in store.journal.list("s", "r", include_fenced=True) if e.kind == "seal" and e.epoch == 2)
    assert seal.seq == 4 and seal.output["missing"] == [[2, 2]]


async def test_review_r1_concurrent_tool_appends_a_late_one_is_never_replayed(tmp_path):
    """The same race through the loop: a pass's two tool results are appended concurrently; the second
    lands, a new owner lists, takes the lease and seals; then the first lands, written by a fenced writer.
    The next incarnation runs that tool again instead of replaying the fenced entry."""
    import threading

    from loomray.storage.errors import LeaseLostError
    from loomray.storage.journal import FenceNote

    runtime = LocalRuntime(tmp_path / "d")
    store = runtime.store
    batch = {"tool_calls": [{"name": "lookup", "arguments": {"key": "a"}}, {"name": "lookup", "arguments": {"key": "b"}}]}
    agent = Agent("", model=ScriptedModel([batch, "done"]), tools=[lookup], runtime=runtime,
                  tuning=Tuning(checkpoint=False))
    real_put = store.objects.put
    sealed = threading.Event()
    late: list[str] = []

    def put(*, key, data, **kw):
        name = key.rsplit("/", 1)[-1]
        if "/journal/" in key and name.startswith("00000002-"):  # the first tool result: still in flight ...
            assert sealed.wait(10)  # ... until the new owner has sealed the run
            late.append(name)
            return real_put(key=key, data=data, **kw)
        out = real_put(key=key, data=data, **kw)
        if "/journal/" in key and name.startswith("00000003-"):  # the second landed: take over (as a new
            run_id = key.split("/")[-2]  # incarnation's execute_request does: list in the swap, then seal)
            fence = FenceNote(lambda: store.journal.listing("s", run_id=run_id))
            lease = store.leases.acquire("s", owner="taker", note=fence)
            for rid, keys in fence.listing.runs.items():
                store.journal.seal_listed("s", rid, lease=lease, listed=keys)
            sealed.set()
        return out

    store.objects.put = put  # instance attribute: this store only
    try:
        with pytest.raises(LeaseLostError):
            await agent.run("task", session_id="s")
    finally:
        del store.objects.put
    assert late and tool_calls == {"a": 1, "b": 1}
    run_id = store.sessions.get("s").run_id
    zombie = next(e for e in store.journal.list("s", run_id, include_fenced=True) if e.seq == 2)
    rerun = zombie.output["message"]["content"].removeprefix("value of ")
    assert zombie.epoch == 1 and zombie.step_key not in {e.step_key for e in store.journal.list("s", run_id)}

    result = await agent.run("task", session_id="s")  # epoch 3 continues the run
    assert result.run_id == run_id and result.output == "done"
    assert tool_calls == {"a": 1, "b": 1, rerun: 2}  # the fenced entry's tool ran again; the other replayed
    runtime.close()


@pytest.mark.parametrize(("check_writes", "calls"), [(2, 2), (4, 2), (6, 3)])
async def test_review_r2_a_fenced_zombie_stops_within_its_lease_check_bound(tmp_path, monkeypatch, check_writes,
                                                                           calls):
    """Journal on, checkpoints off: appends do not read the lease. A writer fenced during pass 0 still stops:
    before a model call or a pass's tools, once it has made ``LEASE_CHECK_WRITES`` writes since it last proved
    its lease (here run_start, then a model answer and a tool result per pass), it reads the lease and learns it
    was fenced. (With 2, the proof before pass 0's tools came right before the takeover: pass 1's model call
    starts 1 write after it, and its tools 2 writes after it.)"""
    from loomray import run_writes
    from loomray.storage.errors import LeaseLostError

    monkeypatch.setattr(run_writes, "LEASE_CHECK_WRITES", check_writes)
    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 3600.0)  # only the write count, whatever the machine's speed
    runtime = LocalRuntime(tmp_path / "d")
    model = ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(20)] + ["done"])
    agent = agent_for(runtime, model, checkpoint=False)
    taken = []

    def take_over(event):
        if event.type == "tool_result" and not taken:  # pass 0's tool ran and was journaled: a takeover now
            taken.append(runtime.store.leases.acquire("s", owner="taker"))

    with pytest.raises(LeaseLostError):
        await agent.run("task", session_id="s", emit=take_over)
    assert taken and model.calls == calls  # then its count of writes reached the bound
    assert runtime.store.sessions.get("s").status == "running"  # never reported as anything else
    runtime.close()


def test_review_r2_lease_reads_per_pass(tmp_path, monkeypatch):
    """What bounding a fenced writer by writes costs: about one lease read per LEASE_CHECK_WRITES writes, and a
    LIST of the epoch markers per batch of checkpoints, instead of one or two reads per pass."""
    from loomray import run_writes
    from loomray.storage.checkpoint_log import INDEX_BATCH

    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 3600.0)

    def lease_reads(passes: int, name: str, checkpoint: bool) -> int:
        runtime = LocalRuntime(tmp_path / name)
        real_get = runtime.store.objects.get
        reads = []

        def get(*, key):
            if key.endswith("lease.json"):
                reads.append(key)
            return real_get(key=key)

        real_list = runtime.store.objects.list

        def list_(*, prefix, **kw):
            if prefix.endswith("/epochs/"):
                reads.append(prefix)  # a batch's proof: the epoch claims
            return real_list(prefix=prefix, **kw)

        runtime.store.objects.get = get
        runtime.store.objects.list = list_
        model = ScriptedModel([{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(passes)] + ["done"])
        ckpt = CheckpointConfig(position="after_tools") if checkpoint else False
        agent = Agent("", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=ckpt))
        agent.run_sync("task", session_id="s")
        runtime.close()
        return len(reads)

    extra = 40 - 1  # within the default max_turns
    with_checkpoints = lease_reads(40, "ckpt-long", True) - lease_reads(1, "ckpt-short", True)
    # Two writes a pass (the model answer, the checkpoint holding the tool result); a batch's proof also counts.
    assert 1 <= with_checkpoints <= 2 * extra // run_writes.LEASE_CHECK_WRITES + extra // INDEX_BATCH + 1
    without = lease_reads(40, "long", False) - lease_reads(1, "short", False)
    assert 1 <= without <= 2 * extra // run_writes.LEASE_CHECK_WRITES + 1  # was one read per pass


@pytest.mark.parametrize("lease_json", ["kept", "deleted", "corrupt"])
def test_a_fence_a_dead_taker_recorded_survives_a_deleted_lease_json(store, lease_json):
    """A zombie's run is recorded after a takeover's listing but before its swap, and the zombie journals on
    (it proves its lease only every few writes). The taker dies before sealing; then lease.json goes (a bucket
    rule, an operator). The next owner still writes the dead taker's seal from the copy of its lease body, so
    the zombie's entries are never replayed. (The fault-injection soak found this with lease.json deleted.)"""
    from loomray.storage.journal import FenceNote

    def entry(seq, step, kind="model", epoch=1):
        return JournalEntry(session_id="s", run_id="r", seq=seq, step_key=step, kind=kind, epoch=epoch)

    store.leases.acquire("s", owner="zombie")

    def listing_then_the_zombie_records_its_run():
        listing = store.journal.listing("s")
        store.runs.create("s", run_id="r", epoch=1)  # after the listing, before the swap
        return listing

    store.leases.acquire("s", owner="dies before sealing", note=FenceNote(listing_then_the_zombie_records_its_run))
    for e in (entry(0, "run-start", "run_start"), entry(1, "t0000-model"), entry(2, "t0001-model")):
        store.journal.append(e)  # after epoch 2 was taken
    if lease_json == "deleted":
        store.objects.delete(keys=["sessions/_/s/lease.json"])
    elif lease_json == "corrupt":
        store.objects.put(key="sessions/_/s/lease.json", data=b"{not json")
    fence = FenceNote(lambda: store.journal.listing("s", run_id="r"))
    if lease_json == "corrupt":
        newer = store.leases.repair("s", owner="next")
        fence.chain = []  # a repair takes no note; the next acquire completes the fences
        newer = store.leases.acquire("s", owner="next", note=fence)
    else:
        newer = store.leases.acquire("s", owner="next", note=fence)
    assert any(item["epoch"] == 2 for item in fence.chain), fence.chain
    store.journal.complete_fences("s", chain=fence.chain, listed=dict(fence.listing.runs))
    for run_id, keys in fence.listing.runs.items():
        store.journal.seal_listed("s", run_id, lease=newer, listed=keys)
    assert [e for e in store.journal.list("s", "r") if e.kind != "seal"] == []  # nothing the zombie wrote
