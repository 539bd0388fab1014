"""A session actor's restart reads the checkpoint it restores once, without a cluster.

The actor class is a plain class: built in this process (Ray's runtime context stubbed) on a local-directory
store that logs every object call, it is what a supervisor's restart builds. Its constructor reads no
checkpoint; its run reads the one it restores once and reports it (``progress()``) from the run's start.
"""

import asyncio
from collections import Counter

import pytest

ray = pytest.importorskip("ray")

from loomray import Agent, Tuning  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402
from loomray.runtime import LocalRuntime  # noqa: E402
from loomray.runtime import session_actor as session_actor_module  # noqa: E402
from loomray.runtime.actors import AgentSpec, RuntimeConfig  # noqa: E402
from loomray.runtime.session_actor import SessionActor  # noqa: E402
from loomray.session import RunRequest  # noqa: E402
from loomray.storage.faults import FaultyObjectStore  # noqa: E402
from loomray.storage.localdir import LocalObjectStore  # noqa: E402
from loomray.storage.store import Store  # noqa: E402


class _Context:
    """What the actor asks of Ray's runtime context."""

    def get_node_id(self) -> str:
        return "node-1" + "0" * 50

    def get_actor_id(self) -> str:
        return "actor-1"


class _Crash(Exception):
    pass


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def checkpoint_gets(objects: FaultyObjectStore) -> Counter:
    got = Counter(c.key for c in objects.calls if c.op == "get" and c.key and "/checkpoints/" in c.key)
    objects.calls.clear()
    return got


async def test_a_restarted_session_actor_reads_its_checkpoint_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ray, "get_runtime_context", lambda: _Context())
    # A real actor's process guards: its loop's end and its raylet's loss end the process. Not this one's.
    monkeypatch.setattr(session_actor_module, "guard_loop", lambda loop: True)
    monkeypatch.setattr(session_actor_module, "watch_raylet", lambda tasks: asyncio.sleep(3600))
    monkeypatch.setattr(SessionActor, "_schedule_linger", lambda self: None)
    root = tmp_path / "store"
    objects = FaultyObjectStore(LocalObjectStore(root))
    store = Store(objects, f"file://{root}")
    model = ScriptedModel([{"tool": "lookup", "args": {"key": "a"}}, {"tool": "lookup", "args": {"key": "b"}}, "done"])
    agent = Agent("You look things up.", model=model, tools=[lookup], runtime=LocalRuntime(store),
                  tuning=Tuning(checkpoint=True))
    seen = {"n": 0}

    def crash_at_second_model_call(event):  # the first incarnation dies after its first checkpoint
        if event.type == "model_call":
            seen["n"] += 1
            if seen["n"] == 2:
                raise _Crash

    with pytest.raises(_Crash):
        await agent.run("task", session_id="s1", emit=crash_at_second_model_call)
    [latest] = await agent.list_checkpoints("s1", limit=1)
    request = RunRequest(kind="run", prompt="task", session_id="s1")  # the request the supervisor restarts
    checkpoint_gets(objects)

    actor = SessionActor(RuntimeConfig(store_url=f"file://{root}"), AgentSpec.of(agent), request.model_dump_json(),
                         store=store)
    assert checkpoint_gets(objects) == Counter()  # the constructor reads no checkpoint
    outcome = await actor.run()
    assert outcome.status == "completed" and outcome.stop_reason == "completed"
    reads = checkpoint_gets(objects)
    assert any(latest.checkpoint_id in key for key in reads), sorted(reads)
    assert max(reads.values()) == 1, f"checkpoint objects read more than once: {reads}"
    progress = await actor.progress()
    assert (progress["restored_checkpoint_id"], progress["restored_turn"]) == (latest.checkpoint_id, latest.turn)
