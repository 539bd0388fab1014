"""The journal: durable wrappers around the model and the tools, outside the loop's logic.

The loop asks :class:`StepRunner` for "the model's answer at step ``t0003-model``" and does not care whether
it was computed or replayed. Every step is recorded *before* its result is returned, with a hash of its
inputs; a step journaled with the same hash is answered from the journal. What may still repeat:
docs/design.md. Persistence is the injected :class:`JournalSink` (``loomray.run_writes`` adapts the store).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from loomray.events import DeterminismViolation, Event, ReplayedStep, TextDelta
from loomray.models.base import Model, ModelRequest, ModelResponse, complete_with_stream
from loomray.records import Message, ToolCall
from loomray.tools import Tool, ToolContext, run_tool_call


def input_hash(data: object) -> str:
    """sha256 of canonical JSON (sorted keys, no whitespace) of ``data``."""
    if hasattr(data, "model_dump"):
        data = data.model_dump(mode="json")
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class JournalRecord:
    """One step as the journal sees it (the store adds session/run/epoch/time)."""

    seq: int
    step_key: str
    kind: str
    input_hash: str
    output: dict[str, Any] = field(default_factory=dict)


class JournalSink(Protocol):
    """Where records go. Must raise the store's fencing error, may swallow others."""

    async def append(self, record: JournalRecord) -> None: ...


#: Journal kinds of control requests a run consumed (see :mod:`loomray.control`): "signal" and "pause"
#: at a pass boundary, "approval" before a tool call. Their ``output["control"]`` names the request.
CONTROL_KINDS = ("signal", "pause", "approval")
#: The kinds replay may answer from (run_start, run_end and seals are not steps).
STEP_KINDS = ("model", "tool", *CONTROL_KINDS)

#: Kinds of a run's first and last journal records (the values of ``storage.journal.RUN_START`` and
#: ``RUN_END``, which this module, knowing nothing of storage, does not import).
RUN_START_KIND = "run_start"
RUN_END_KIND = "run_end"
#: Step keys of those two records. Stored values (existing journals hold them), hence the hyphen of a
#: step key next to the underscore of a kind.
RUN_START_STEP_KEY = "run-start"
RUN_END_STEP_KEY = "run-end"


#: Model answers that arrived and are being journaled, in this process (see :meth:`StepRunner.complete`).
_answers_recording: set[asyncio.Future[None]] = set()


def answers_recording() -> int:
    """How many model answers this process has received and not yet journaled (or failed to): a process that
    stops because its node is lost waits for them."""
    return len(_answers_recording)


def _recorded(task: asyncio.Future[None]) -> None:
    _answers_recording.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: its awaiter may have been cancelled


def model_step_key(turn: int) -> str:
    return f"t{turn:04d}-model"


def safe_call_id(call_id: str) -> str:
    """A provider's tool-call id as a valid storage id segment (a digest keeps distinct ids distinct)."""
    safe = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in call_id)[:80]
    if safe != call_id:  # rewritten: a digest keeps distinct ids distinct
        safe = f"{safe[:70]}-{hashlib.sha256(call_id.encode()).hexdigest()[:8]}"
    return safe


def tool_step_key(turn: int, call_id: str) -> str:
    # Call ids come from providers; keep the key a valid storage id whatever they contain.
    return f"t{turn:04d}-tool-{safe_call_id(call_id)}"


def approval_step_key(turn: int, call_id: str) -> str:
    """Where the decision on tool call ``call_id`` of pass ``turn`` is journaled."""
    return f"t{turn:04d}-approval-{safe_call_id(call_id)}"


def boundary_step_key(turn: int, control: str) -> str:
    """Where consuming control request ``control`` (a signal or pause) at the boundary before pass ``turn`` is
    journaled."""
    return f"t{turn:04d}-{control}"


class StepRunner:
    """Runs model and tool steps, journaling them when a sink is given.

    ``prior`` are the records a replay may answer from; ``next_seq`` is where this run's own records
    continue. Whatever ``before_model_call`` (before every live model call) or ``before_tools`` (before a
    pass's tools) raises stops the run before the call is billed or the tools act.
    """

    def __init__(
        self,
        model: Model,
        tools: dict[str, Tool],
        *,
        sink: JournalSink | None = None,
        prior: list[JournalRecord] = (),  # type: ignore[assignment]
        next_seq: int = 0,
        emit: Callable[[Event], Awaitable[None]] | None = None,
        session_id: str = "",
        run_id: str | None = None,
        stream: bool = False,
        before_model_call: Callable[[], Awaitable[None]] | None = None,
        journal_tools: bool = True,
        before_tools: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.model = model
        self.before_model_call = before_model_call
        self._before_tools = before_tools
        #: False when the checkpoint written right after a pass's tools holds their results (a synchronous
        #: checkpoint after every pass): the result of the pass's last tool to finish is then not journaled, since
        #: the very next write (that checkpoint) holds it; the others are, as they finish.
        self.journal_tools = journal_tools
        #: Tool records not journaled (``journal_tools`` False) since the last checkpoint that holds them.
        self.volatile: list[JournalRecord] = []
        #: Awaited before a model answer is journaled: the checkpoints written before it (which hold the tool
        #: results the answer was computed from) are durable first, also when they upload in the background.
        self.before_model_record: Callable[[], Awaitable[None]] | None = None
        #: Stream text deltas as events when the model can (only worth it when someone listens).
        self.stream = stream
        self.tools = tools
        self.sink = sink
        self.seq = next_seq
        self.emit = emit
        self.session_id = session_id
        self.run_id = run_id
        self._by_key: dict[str, JournalRecord] = {}
        self._by_idem: dict[str, JournalRecord] = {}
        #: Signal/pause records by the pass boundary (turn) they were consumed at.
        self._boundary: dict[int, dict[str, JournalRecord]] = {}
        for rec in prior:
            self._index(rec)
        #: The messages of the previous model request, and the hash state over their digests.
        self._prefix: tuple[list[Message], Any] = ([], hashlib.sha256())
        #: Model invocations actually made (not replayed).
        self.model_calls = 0
        #: How long the last model call this runner made took (s): what an async checkpoint can hide behind.
        self.model_s = 0.0
        self.replayed = 0

    @property
    def replaying(self) -> bool:
        """True when earlier records may answer steps of this run."""
        return bool(self._by_key)

    def _index(self, rec: JournalRecord) -> None:
        self._by_key[rec.step_key] = rec  # later records win: a re-executed step replaces its stale one
        key = rec.output.get("idempotency_key") if rec.kind == "tool" else None
        if key:
            self._by_idem[f"{rec.output.get('tool')}:{key}"] = rec
        if rec.kind in ("signal", "pause") and rec.step_key[1:5].isdigit():
            self._boundary.setdefault(int(rec.step_key[1:5]), {})[rec.step_key] = rec

    def journaled(self, step_key: str) -> JournalRecord | None:
        """The record that answers ``step_key`` (journaled earlier, or recorded by this run), if any."""
        return self._by_key.get(step_key)

    def boundary_records(self, turn: int) -> list[JournalRecord]:
        """The signal and pause records consumed at the boundary before pass ``turn``, in journal order."""
        return sorted(self._boundary.get(turn, {}).values(), key=lambda r: r.seq)

    async def record(self, kind: str, step_key: str, ihash: str, output: dict[str, Any], *,
                     durable: bool = True) -> None:
        """Append a record (no-op without a sink, or when not ``durable``) and make it answer later lookups."""
        rec = JournalRecord(seq=self.seq, step_key=step_key, kind=kind, input_hash=ihash, output=output)
        if self.sink is not None and durable:
            self.seq += 1
            await self.sink.append(rec)
        elif self.sink is None:
            self.seq += 1
        else:
            self.volatile.append(rec)
        self._index(rec)

    def checkpointed(self) -> None:
        """A checkpoint holding every result so far was written: nothing is volatile any more."""
        self.volatile = []

    async def persist_volatile(self) -> None:
        """The checkpoint that was to hold the volatile tool results failed: journal them after all."""
        records, self.volatile = self.volatile, []
        for rec in records:
            if self.sink is not None:
                rec = JournalRecord(seq=self.seq, step_key=rec.step_key, kind=rec.kind, input_hash=rec.input_hash,
                                    output=rec.output)
                self.seq += 1
                await self.sink.append(rec)

    async def record_run_start(self, spec_hash: str, output: dict[str, Any]) -> None:
        """Journal the run's start (its spec and where it starts). Without a sink nothing is recorded, but the
        start still takes its seq, so a run numbers its steps alike with or without a journal."""
        if self.sink is None:
            self.seq += 1
            return
        await self.record(RUN_START_KIND, RUN_START_STEP_KEY, spec_hash, output)

    async def record_run_end(self, output: dict[str, Any]) -> None:
        """Journal the run's end (nothing without a sink): recovery then finds the run finished."""
        if self.sink is not None:
            await self.record(RUN_END_KIND, RUN_END_STEP_KEY, "", output)

    async def _notify(self, event: Event) -> None:
        if self.emit is not None:
            await self.emit(event)

    async def _lookup(self, rec: JournalRecord | None, ihash: str, step_key: str, kind: str, turn: int) -> bool:
        """True when ``rec`` may answer this step; emits replay / violation events."""
        if rec is None:
            return False
        if rec.input_hash == ihash:
            self.replayed += 1
            await self._notify(ReplayedStep(session_id=self.session_id, run_id=self.run_id, turn=turn,
                                            step_key=step_key, kind=kind))
            return True
        await self._notify(DeterminismViolation(
            session_id=self.session_id, run_id=self.run_id, turn=turn, step_key=step_key, kind=kind,
            journaled_hash=rec.input_hash, actual_hash=ihash))
        return False

    def request_hash(self, request: ModelRequest) -> str:
        """``input_hash(request)``'s job, in O(new messages) per call instead of O(transcript).

        Transcripts only grow between condensings, so the hash state over the previous call's messages is
        kept and, when this request starts with the very same message objects, only the new ones are digested.
        """
        messages = request.messages
        prev, state = self._prefix
        n = len(prev)
        if n <= len(messages) and all(map(operator.is_, prev, messages)):
            h = state.copy()
            new = messages[n:]
        else:
            h, new = hashlib.sha256(), messages
        for m in new:
            h.update(hashlib.sha256(m.__pydantic_serializer__.to_json(m)).digest())
        self._prefix = (list(messages), h.copy())
        h.update(input_hash(request.model_dump(mode="json", exclude={"messages"})).encode())
        return h.hexdigest()

    async def complete(self, request: ModelRequest, *, turn: int) -> tuple[ModelResponse, bool]:
        """The model's answer for pass ``turn``: replayed when journaled with the same inputs."""
        step_key = model_step_key(turn)
        ihash = self.request_hash(request)
        rec = self._by_key.get(step_key)
        if await self._lookup(rec, ihash, step_key, "model", turn):
            return ModelResponse.model_validate(rec.output["response"]), True  # type: ignore[union-attr]
        on_delta = None
        if self.stream and self.emit is not None:
            async def on_delta(text: str) -> None:
                await self._notify(TextDelta(session_id=self.session_id, run_id=self.run_id, turn=turn,
                                             step_key=step_key, text=text))
        if self.before_model_call is not None:
            await self.before_model_call()
        # Streamed when the model can stream and someone listens; the journal keeps only the final answer.
        started = time.perf_counter()
        response = await complete_with_stream(self.model, request, on_delta)
        self.model_s = time.perf_counter() - started
        self.model_calls += 1
        # The answer is paid for: it is journaled even if this run is cancelled meanwhile (a lost node's watchdog
        # may stop the run while the answer waits for its inputs' upload); losing it would pay for it again.
        recording = asyncio.ensure_future(self._record_answer(step_key, ihash, response))
        _answers_recording.add(recording)
        recording.add_done_callback(_recorded)
        await asyncio.shield(recording)
        return response, False

    async def _record_answer(self, step_key: str, ihash: str, response: ModelResponse) -> None:
        if self.before_model_record is not None:
            await self.before_model_record()
        await self.record("model", step_key, ihash, {"response": response.model_dump(mode="json")})

    async def before_tool_pass(self) -> None:
        """Right before a pass's tool calls start (see ``before_tools``)."""
        if self._before_tools is not None:
            await self._before_tools()

    async def call_tool(self, call: ToolCall, ctx: ToolContext, *, turn: int,
                        last: Callable[[], bool] | None = None) -> tuple[Message, bool]:
        """The result message of one tool call: replayed when journaled with the same inputs. ``last()`` says,
        when the tool has finished, whether it is the last of its pass still running (see ``journal_tools``)."""
        step_key = tool_step_key(turn, call.id)
        ihash = input_hash({"name": call.name, "arguments": call.arguments})
        t = self.tools.get(call.name)
        idem = None
        if t is not None:
            try:
                idem = t.key_for(call.arguments)
            except Exception:  # a key function that cannot read bad arguments: no key
                idem = None
        rec = self._by_idem.get(f"{call.name}:{idem}") if idem else self._by_key.get(step_key)
        if rec is not None and idem:
            ihash = rec.input_hash if rec.output.get("idempotency_key") == idem else ihash
        if await self._lookup(rec, ihash, step_key, "tool", turn):
            msg = Message.model_validate(rec.output["message"])  # type: ignore[union-attr]
            # The same effect answered under this call's id.
            return msg.model_copy(update={"tool_call_id": call.id}), True
        if idem:
            ctx = ToolContext(**{**ctx.__dict__, "idempotency_key": idem})
        msg = await run_tool_call(self.tools, call, ctx)
        output: dict[str, Any] = {"message": msg.model_dump(mode="json"), "tool": call.name}
        if idem:
            output["idempotency_key"] = idem
        await self.record("tool", step_key, ihash, output,
                          durable=self.journal_tools or last is None or not last())
        return msg, False
