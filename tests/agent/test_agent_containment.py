"""A tool that tries to end its process or thread ends its own run, with a typed error; a process whose event
loop dies anyway exits (the Ray side of both is in tests/ray/test_ray_containment.py)."""

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from loomray import Agent, Tuning
from loomray.errors import LoomrayRunError, ToolAborted
from loomray.models import ScriptedModel
from loomray.runtime import InProcRuntime

REPO = Path(__file__).resolve().parents[2]


def leave() -> str:
    """Calls sys.exit, as some libraries do."""
    sys.exit(4)


def interrupt() -> str:
    """Raises KeyboardInterrupt in its worker thread."""
    raise KeyboardInterrupt


async def misuse() -> str:
    """Raises GeneratorExit outside a generator."""
    raise GeneratorExit


@pytest.mark.parametrize(("fn", "raised"), [(leave, "SystemExit"), (interrupt, "KeyboardInterrupt"),
                                            (misuse, "GeneratorExit")])
async def test_a_tool_ending_its_process_ends_its_run_only(fn, raised):
    runtime = InProcRuntime()
    script = [{"tool": fn.__name__, "args": {}}, "unreachable"]
    agent = Agent("x", model=ScriptedModel(script), tools=[fn], tuning=Tuning(checkpoint=True), runtime=runtime)
    calm = Agent("y", model=ScriptedModel(["fine"]), runtime=runtime)

    with pytest.raises(ToolAborted, match=raised) as caught:
        await agent.run("go", session_id=f"s-{raised}")
    assert isinstance(caught.value, LoomrayRunError) and (caught.value.tool, caught.value.raised) == (fn.__name__,
                                                                                                      raised)
    # The loop it ran on goes on: another run in this process, and the failed session's status.
    assert (await calm.run("hi", session_id="s-calm")).output == "fine"
    assert runtime.store.sessions.get(f"s-{raised}").status == "failed"


def test_tool_aborted_crosses_processes():
    import pickle

    e = pickle.loads(pickle.dumps(ToolAborted("m", tool="t", raised="SystemExit")))
    assert (str(e), e.tool, e.raised) == ("m", "t", "SystemExit")


def test_a_process_whose_loop_died_exits():
    """The guard of an actor's loop: a callback raising SystemExit ends the loop's thread; the process exits 70."""
    code = textwrap.dedent("""
        import asyncio, threading, time
        from loomray.runtime.loop_guard import EXIT_STATUS, guard_loop

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        while not loop.is_running():
            time.sleep(0.01)
        assert guard_loop(loop) and not guard_loop(loop)  # once per loop
        def stop():
            raise SystemExit("a callback ended the loop")
        loop.call_soon_threadsafe(stop)
        time.sleep(30)  # the guard exits first
        raise SystemExit(0)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 70, done.stderr


def test_an_async_tool_is_still_cancellable():
    """CancelledError is how a run is stopped: never turned into a failure."""
    from loomray.records import ToolCall
    from loomray.tools import ToolContext, as_tools, run_tool_call

    async def slow() -> str:
        """Waits."""
        await asyncio.sleep(30)
        return "late"

    async def main():
        task = asyncio.ensure_future(run_tool_call(as_tools([slow]), ToolCall(id="c", name="slow", arguments={}),
                                                   ToolContext("s", None, None, 0, "c")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
