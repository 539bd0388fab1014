"""Child process for the crash tests: runs one session on a LocalRuntime and may SIGKILL itself.

    python crash_child.py DATA_DIR SESSION_ID OUT_JSON [KILL_SPEC]

(or the same forked from a server that imported it already: ``crash_procs.run_child``).

KILL_SPEC picks a deterministic point (no timing):
  ``event:<type>:<n>``               die when the n-th event of that type is emitted
  ``store:<sub>.<method>:<before|after>:<n>``  die just before / just after the n-th call of a store method
  ``tool:<n>``                        die inside the n-th tool execution (its effect half done)

With ``CRASH_TRACE_FILE=PATH`` the child exports its spans to PATH (JSON lines).
With ``CRASH_RESUME=1`` the child calls ``resume(session_id=...)`` (no prompt)
instead of ``run``. The model is a ScriptedModel with a file-backed call counter (``DATA_DIR/model_calls``);
the tool appends each effect to ``DATA_DIR/effects``. The result (transcript etc.)
goes to OUT_JSON when the run completes.

Control additions (tests/agent/test_agent_control.py), all off unless set:
  ``CONTROL_APPROVE_PAGE=N``   the research call for page N requires approval
  ``CONTROL_APPROVE=CALL_ID``  resume(None) with approvals={CALL_ID: True} instead of run
  ``CONTROL_DECISION=JSON``    with CONTROL_APPROVE: that decision instead of True
  ``CONTROL_SIGNAL_AT_PAGE=N`` the research call for page N sends a signal (as another client would)
  ``CONTROL_BLOCK_AT_PAGE=N``  the research call for page N writes DATA_DIR/started, then blocks until
                               DATA_DIR/release exists
  KILL_SPEC ``exit:kill``      SIGKILL right after OUT_JSON was written (the run returned: e.g. waiting)
OUT_JSON then also holds ``stop_reason`` and ``pending`` (the ids of pending approvals).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from loomray import Agent, CheckpointConfig, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime

PASSES = 5  # tool passes; the sixth pass is the final answer


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def hit(self, key: str) -> int:
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]


def build(data_dir: str, kill: str | None, position: str = "both"):
    counter = Counter()
    kind, *rest = kill.split(":") if kill else ("", )

    def research(topic: str, page: int) -> str:
        """Read one page about a topic."""
        if kind == "tool" and counter.hit("tool") == int(rest[0]):
            with open(os.path.join(data_dir, "effects"), "a") as f:
                f.write(f"{topic}-{page}-partial\n")
            die()
        _control_hook(data_dir, page)
        with open(os.path.join(data_dir, "effects"), "a") as f:
            f.write(f"{topic}-{page}\n")
        return f"page {page} on {topic}: " + "x" * 2048

    research = _with_approval(research)
    model = ScriptedModel(
        [{"tool": "research", "args": {"topic": "ray", "page": i}} for i in range(PASSES)] + ["report: done"],
        counter_path=os.path.join(data_dir, "model_calls"))
    runtime = LocalRuntime(os.path.join(data_dir, "store"))
    if kind == "store":
        method, when, nth = rest[0], rest[1], int(rest[2])
        inner = runtime.store

        def hooked(real):
            def wrapped(*a, **kw):
                n = counter.hit(method)
                if n == nth and when == "before":
                    die()
                out = real(*a, **kw)
                if n == nth and when == "after":
                    die()
                return out
            return wrapped

        if method == "checkpoints.log.put":
            # A run writes its checkpoints through a checkpoint log (one PUT each): the n-th checkpoint write.
            real_log = inner.checkpoints.log

            def checkpoint_log(*a, **kw):
                log = real_log(*a, **kw)
                log.put = hooked(log.put)
                return log

            inner.checkpoints.log = checkpoint_log
        else:
            part, name = method.split(".")  # e.g. "journal.append": a sub-store's method
            sub = getattr(inner, part)
            setattr(sub, name, hooked(getattr(sub, name)))  # shadows the method for this process only
    position, _, durability = position.partition("/")  # e.g. "after_tools/async"
    agent = Agent("You research.", model=model, tools=[research], runtime=runtime,
                  tuning=Tuning(checkpoint=CheckpointConfig(position=position) if position != "off" else False,
                                durability=durability or "sync"))

    def emit(event) -> None:
        if kind == "event" and event.type == rest[0] and counter.hit(event.type) == int(rest[1]):
            die()

    return agent, emit


SIGNAL_TEXT = "SIGNAL: keep it short"


def _control_hook(data_dir: str, page: int) -> None:
    """What the control tests make the research tool do for one page (see the module docstring)."""
    import time

    if os.environ.get("CONTROL_SIGNAL_AT_PAGE") == str(page):
        from loomray import control
        from loomray.storage import open_store

        store = open_store(os.path.join(data_dir, "store"))
        control.send_signal(store, _SESSION[0], None, SIGNAL_TEXT, source="test")
        store.close()
    if os.environ.get("CONTROL_BLOCK_AT_PAGE") == str(page):
        with open(os.path.join(data_dir, "started"), "w") as f:
            f.write("started\n")
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(data_dir, "release")) and time.monotonic() < deadline:
            time.sleep(0.02)


def _with_approval(research):
    page = os.environ.get("CONTROL_APPROVE_PAGE")
    if page is None:
        return research
    from loomray import tool

    return tool(requires_approval=lambda call: str(call.arguments.get("page")) == page)(research)


_SESSION: list[str] = [""]


async def _control_main(agent, emit, session_id: str, out: str, kill: str | None) -> bool:
    """The control variants of main(); False when none applies."""
    _SESSION[0] = session_id
    approve = os.environ.get("CONTROL_APPROVE")
    if approve is None:
        return False
    decision = json.loads(os.environ.get("CONTROL_DECISION", "true"))  # e.g. {"arguments": {...}}, {"respond": ..}
    if os.environ.get("CONTROL_TYPED") and isinstance(decision, dict):  # the same decision, as its typed value
        from loomray import Approve, Respond

        decision = Approve(**decision) if "arguments" in decision else Respond(decision["respond"])
    result = await agent.resume(None, session_id=session_id, emit=emit, approvals={approve: decision})
    _control_out(out, result, kill)
    return True


def _control_out(out: str, result, kill: str | None) -> None:
    data = {"messages": [m.model_dump(mode="json") for m in result.messages], "turns": result.turns,
            "model_calls": result.model_calls, "output": result.output, "stop_reason": result.stop_reason,
            "pending": [c.id for c in result.pending_approvals],
            "usage": result.usage.model_dump(mode="json"), "resumed_from_checkpoint": result.resumed_from_checkpoint}
    with open(out, "w") as f:
        json.dump(data, f)
    if kill == "exit:kill":
        die()


def _trace_to_file(path: str) -> None:
    """``CRASH_TRACE_FILE``: every span this process ends, one JSON line each, written as it ends (so a
    SIGKILL loses only the spans still open, as with any exporter)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from loomray import telemetry

    class FileExporter(SpanExporter):
        def export(self, spans):
            with open(path, "a") as f:
                f.writelines(json.dumps({
                    "name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
                    "parent": s.parent.span_id if s.parent else None, "pid": os.getpid(),
                    "attributes": {k: v for k, v in s.attributes.items() if isinstance(v, (str, int, float))},
                }) + "\n" for s in spans)
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileExporter()))
    telemetry.enable_tracing(provider)


async def main() -> None:
    data_dir, session_id, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if os.environ.get("CRASH_TRACE_FILE"):
        _trace_to_file(os.environ["CRASH_TRACE_FILE"])
    kill = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] else None
    position = os.environ.get("CRASH_POSITION", "both")
    agent, emit = build(data_dir, kill, position)
    if await _control_main(agent, emit, session_id, out, kill):
        return
    if os.environ.get("CRASH_RESUME"):  # the second process resumes instead of re-issuing the run
        result = await agent.resume(session_id=session_id, emit=emit)
    else:
        result = await agent.run("research ray for me", session_id=session_id, emit=emit)
    with open(out, "w") as f:
        json.dump({"messages": [m.model_dump(mode="json") for m in result.messages], "turns": result.turns,
                   "model_calls": result.model_calls, "output": result.output,
                   "usage": result.usage.model_dump(mode="json"),
                   "resumed_from_checkpoint": result.resumed_from_checkpoint}, f)
    _control_out(out, result, kill)


def forked_main(argv: list[str]) -> None:
    """What ``python crash_child.py ARGV...`` does, in a process forked with its environment already set
    (``crash_procs.run_child``)."""
    sys.argv = [__file__, *argv]
    asyncio.run(main())


if __name__ == "__main__":
    asyncio.run(main())
