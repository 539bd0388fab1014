"""What a fenced writer (a zombie that lost its lease) can still do, and when a run stops (issue 22, writer side).

Each test names the path it closes: 1 (a zombie's late checkpoint is never
indexed: no reader honours it), 2 (a zombie's retention retires nothing),
6 (a run whose lease became unreadable stops, whatever its timing, and is
never reported completed) and 7 (the proof bound: a run proves its lease
before a pass's tools too, so a zombie whose model call spans the takeover
runs none of that pass's tools once its window elapsed).
"""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import lookup, paused_gate, tool_calls

from loomray import Agent, CheckpointConfig, Tuning
from loomray.errors import DurabilityLost
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime
from loomray.storage import layout, open_store
from loomray.storage.errors import LeaseLostError


def passes(n: int, final: str = "done") -> list:
    """A script of ``n`` passes that each look up one key, then a final answer."""
    return [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(n)] + [final]


def indexed_ids(store, session_id: str = "s") -> set[str]:
    """The checkpoint ids the session's index publishes (what ``Store.query``, the table and ``loomray query``
    read)."""
    return set(store.query(session_id=session_id)["checkpoint_id"].to_pylist())


async def test_path01_a_zombie_paused_in_a_tool_publishes_no_row(tmp_path):
    """A (epoch 1) is paused inside a tool; B takes over on another store, continues the run and finishes. A
    wakes, checkpoints its pass and learns it was fenced: the index gains no row of A's (it proves its lease
    before it indexes), so ``Store.query`` shows exactly what it showed when B finished."""
    gate, paused, release = paused_gate()

    script = [{"tool": "gate", "args": {"key": f"k{i}"}} for i in range(4)] + ["done"]
    tuning = Tuning(checkpoint=CheckpointConfig(position="after_tools"))
    rt_a, rt_b = LocalRuntime(tmp_path / "d"), LocalRuntime(tmp_path / "d")
    a = Agent("", model=ScriptedModel(script), tools=[gate], runtime=rt_a, tuning=tuning)
    b = Agent("", model=ScriptedModel(script), tools=[gate], runtime=rt_b, tuning=tuning)
    zombie = asyncio.ensure_future(a.run("task", session_id="s"))
    await asyncio.wait_for(paused.wait(), 30)
    done = await b.run("task", session_id="s")  # takes the lease (epoch 2) and continues A's run
    assert done.output == "done"
    before = indexed_ids(open_store(tmp_path / "d"))
    latest = (await b.get_checkpoint("s")).checkpoint_id
    release.set()
    with pytest.raises(LeaseLostError):
        await asyncio.wait_for(zombie, 30)
    fresh = open_store(tmp_path / "d")
    assert indexed_ids(fresh) == before  # nothing the zombie wrote after the takeover is indexed
    assert fresh.checkpoints.list("s")[0].checkpoint_id == latest
    rt_a.close()
    rt_b.close()


async def test_path02_a_zombies_retention_retires_no_acknowledged_checkpoint(tmp_path, monkeypatch):
    """keep=2 below a batch of 4: A acknowledges c1..c4 (retention keeps c3, c4), then a takeover claims the
    session. A goes on within its proof window and reaches its next batch (c5..c8): it must not retire c3 and
    c4 (which a new owner would restore from), nor publish c5..c8. On main its batch wrote the tombstones
    before the lease check and the session read as empty."""
    from loomray import run_writes

    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 3600.0)  # only the batch proof, whatever the machine's speed
    store = open_store(tmp_path / "d")
    store.checkpoints.batch = 4  # a batch above keep: retention retires rows of the batch being indexed
    runtime = LocalRuntime(store, max_checkpoints_per_session=2)
    agent = Agent("", model=ScriptedModel(passes(12)), tools=[lookup], runtime=runtime,
                  tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))
    acked: list[str] = []
    taker = open_store(tmp_path / "d")

    def take_over(event):
        if event.type == "checkpoint" and event.ok:
            acked.append(event.checkpoint_id)
            if len(acked) == 4:  # the first batch is acknowledged: a takeover now
                taker.leases.acquire("s", owner="taker")

    with pytest.raises(LeaseLostError):
        await agent.run("task", session_id="s", emit=take_over)
    assert len(acked) == 4 and tool_calls["k7"] == 1  # A went on to its next batch before it learned
    fresh = open_store(tmp_path / "d")
    assert [r.checkpoint_id for r in fresh.checkpoints.list("s")] == acked[:1:-1]  # c4, c3: none retired
    assert indexed_ids(fresh) == set(acked[2:])  # and none of c5..c8 published
    runtime.close()


@pytest.mark.parametrize("tool_s", [0.0, 0.05], ids=["short-tools", "longer-tools"])
async def test_path06_a_lease_that_became_unreadable_stops_the_run(tmp_path, monkeypatch, tool_s):
    """lease.json becomes unreadable after pass 2. Whatever the tools' duration (short: only batch
    acknowledgements prove the lease; longer: the time bound fires too), the run stops with DurabilityLost
    and is never reported completed (no ``completed`` status, no ``run_end``)."""
    from loomray import run_writes

    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", 0.1)

    async def work(key: str) -> str:
        """Do some work for ``key``."""
        await asyncio.sleep(tool_s)  # the tool's own duration, not a synchronisation
        return f"value of {key}"

    runtime = LocalRuntime(tmp_path / "d")
    script = [{"tool": "work", "args": {"key": f"k{i}"}} for i in range(20)] + ["done"]
    agent = Agent("", model=ScriptedModel(script), tools=[work], runtime=runtime,
                  tuning=Tuning(checkpoint=CheckpointConfig(position="after_tools")))
    results = []

    def spoil_the_lease(event):
        if event.type == "tool_result":
            results.append(event)
            if len(results) == 3:
                runtime.store.objects.put(key=layout.lease_key("s", None), data=b"{not a lease")

    with pytest.raises(DurabilityLost):
        await agent.run("task", session_id="s", emit=spoil_the_lease)
    row = runtime.store.sessions.get("s")
    assert row is not None and row.status != "completed"
    entries = [e for run in [row.run_id] for e in runtime.store.journal.list("s", run)]
    assert entries and all(e.kind != "run_end" for e in entries)
    runtime.close()


class TakeoverInCall(ScriptedModel):
    """A scripted model whose call of pass ``at`` lets another store take the session's lease while it runs,
    and lasts ``seconds`` more."""

    def __init__(self, script, *, at: int, taker, seconds: float = 0.0) -> None:
        super().__init__(script)
        self.at, self.taker, self.seconds = at, taker, seconds

    async def complete(self, request):
        if self.calls == self.at:
            await asyncio.to_thread(self.taker.leases.acquire, "s", owner="taker")
            await asyncio.sleep(self.seconds)  # the rest of the model call
        return await super().complete(request)


@pytest.mark.parametrize(("check_writes", "check_s", "call_s"), [(32, 0.05, 0.2), (1, 3600.0, 0.0)],
                         ids=["window-elapsed-during-the-call", "writes-since-the-proof"])
async def test_path07_a_zombie_whose_model_call_spans_the_takeover_runs_none_of_its_tools(
        tmp_path, monkeypatch, check_writes, check_s, call_s):
    """The bound: a run starts no step (model call or a pass's tools) once ``LEASE_CHECK_WRITES`` writes or
    ``LEASE_CHECK_S`` seconds passed since its last proof, without proving its lease again. A takeover
    happens during pass 2's model call; the call outlasts the window (or the run wrote since its proof):
    pass 2's tools never run. On main the proof ran only before model calls, so the whole pass's tools ran."""
    from loomray import run_writes

    monkeypatch.setattr(run_writes, "LEASE_CHECK_WRITES", check_writes)
    monkeypatch.setattr(run_writes, "LEASE_CHECK_S", check_s)
    runtime = LocalRuntime(tmp_path / "d")
    model = TakeoverInCall(passes(6), at=2, taker=open_store(tmp_path / "d"), seconds=call_s)
    agent = Agent("", model=model, tools=[lookup], runtime=runtime, tuning=Tuning(checkpoint=False))
    with pytest.raises(LeaseLostError):
        await agent.run("task", session_id="s")
    assert model.calls == 3 and tool_calls == {"k0": 1, "k1": 1}  # pass 2 was answered; none of its tools ran
    assert runtime.store.sessions.get("s").status == "running"  # never reported as anything else
    runtime.close()
