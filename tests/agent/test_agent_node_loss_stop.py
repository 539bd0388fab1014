"""A process stopping because its node is lost: what the runs already paid for becomes durable, nothing new starts.

On Ray, a session actor or host whose raylet dies freezes its executor, cancels its runs and exits
(``loomray.runtime.raylet_watch``). These tests run that stop in this process, on a real run, at the
moment that used to lose a paid model answer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from agent_helpers import HookedCheckpoints

from loomray import Agent, Tuning
from loomray.journal import answers_recording
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime
from loomray.runtime.raylet_watch import DrainableExecutor, stop_runs


def lookup(key: str) -> str:
    """Look something up."""
    return f"value of {key}"


def script() -> list:
    return [{"tool": "lookup", "args": {"key": "k0"}}, {"tool": "lookup", "args": {"key": "k1"}}, "done"]


async def test_an_answer_waiting_for_its_inputs_upload_is_journaled_when_the_node_is_lost():
    """Async durability: the model's second answer arrives while the checkpoint holding the tool result it read
    still uploads, and an answer is journaled only once its inputs are durable. The node is lost right then:
    the upload lands and the answer is journaled all the same, so the re-issued run replays it instead of
    billing the call again."""
    loop = asyncio.get_running_loop()
    executor = DrainableExecutor(max_workers=4)
    loop.set_default_executor(executor)
    gate, uploading = threading.Event(), threading.Event()

    def gated_put(real, data, info):
        uploading.set()
        gate.wait(timeout=30)
        return real(data, info)

    class AnswerDuringUpload(ScriptedModel):
        async def complete(self, request):
            if self.calls == 1:  # the second call: answer while the first checkpoint uploads
                await asyncio.to_thread(uploading.wait, 30)
            return await super().complete(request)

    rt = InProcRuntime()
    store = rt.store
    rt.store = HookedCheckpoints(store, gated_put)
    first = AnswerDuringUpload(script())
    agent = Agent("You look things up.", model=first, tools=[lookup], runtime=rt,
                  tuning=Tuning(checkpoint=True, durability="async"))
    run = asyncio.ensure_future(agent.run("go", session_id="s1"))
    deadline = time.monotonic() + 30
    while not (first.calls == 2 and answers_recording() == 1):  # answered; its record waits for the upload
        assert time.monotonic() < deadline and not run.done(), "the second answer never waited for its upload"
        await asyncio.sleep(0.01)

    stopping = asyncio.ensure_future(stop_runs([run], executor, drain_s=30))
    await asyncio.sleep(0)  # the stop froze the executor and cancelled the run ...
    assert run.cancelled() or run.cancelling()
    gate.set()  # ... and only then does the upload finish
    await stopping
    assert answers_recording() == 0
    assert late_submit_never_runs(executor)
    # The stopped run itself hangs in a write the frozen executor never takes (its process would exit now).
    assert not run.done()
    run.cancel()

    # The re-issued run: as a new incarnation in another process, with an executor of its own.
    loop.set_default_executor(ThreadPoolExecutor(max_workers=4))
    rt.store = store
    again = ScriptedModel(script())
    result = await Agent("You look things up.", model=again, tools=[lookup], runtime=rt,
                         tuning=Tuning(checkpoint=True, durability="async")).run("go", session_id="s1")
    assert result.output == "done"
    assert again.calls == 1  # only the last answer: the second was journaled and replayed, not billed again
    executor.shutdown(wait=True)


def late_submit_never_runs(executor: DrainableExecutor) -> bool:
    """After the stop, work that is not a run's store write (a tool, a status row) never runs."""
    ran: list[str] = []
    late = executor.submit(ran.append, "late")  # a future no thread ever takes
    return not late.done() and ran == [] and not executor.under_way()
