"""Judges: a function (sync or async) ``(JudgeInput) -> float | Score``, or a model with a rubric.

A :class:`ModelJudge` call is a run of a small judge session
(``{branch}-j{when}``) on the exploration's runtime, so it is journaled and
checkpointed like any model call: a driver that dies after the call and
before the score was stored finds the finished judge session (or replays its
journal) instead of paying for the call again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from typing import TYPE_CHECKING, Any

from loomray.config import Tuning
from loomray.errors import LoomrayUserError
from loomray.explore.types import JudgeInput, Score
from loomray.records import Message

if TYPE_CHECKING:  # the Agent module imports this package
    from loomray.agent import Agent

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
#: How much of each message a model judge is shown (the rubric decides what matters; this bounds the bill).
_MESSAGE_CHARS = 4000


class ModelJudge:
    """A model that scores branches by ``rubric`` (its instructions).

    ``model`` is a model name or a :class:`~loomray.models.Model`. It is
    asked to answer with a JSON object ``{"score": <number>, "reasons": "..."}``
    (a bare number is accepted too); higher is better.
    """

    def __init__(self, model: Any, rubric: str) -> None:
        if not isinstance(rubric, str) or not rubric.strip():
            raise TypeError("ModelJudge.rubric must be a non-empty str")
        self.model, self.rubric = model, rubric

    def describe(self) -> str:
        """What a stored plan compares on resume: the model's name and a digest of the rubric."""
        name = self.model if isinstance(self.model, str) else getattr(self.model, "name", type(self.model).__name__)
        return f"ModelJudge({name}, rubric {hashlib.sha256(self.rubric.encode()).hexdigest()[:12]})"

    def prompt(self, judged: JudgeInput) -> str:
        """The judge session's user turn: the branch's transcript and how it ended."""
        lines = [f"Branch {judged.session_id}, round {judged.round}, after {judged.turn} passes"
                 f"{' (finished)' if judged.result is not None else ' (still running)'}.", "Transcript:"]
        lines += [f"[{m.role}] {m.content[:_MESSAGE_CHARS]}" for m in judged.messages if m.role != "system"]
        lines.append('Answer with a JSON object: {"score": <number, higher is better>, "reasons": "<why>"}.')
        return "\n".join(lines)

    async def score(self, agent: Agent, judged: JudgeInput, session_id: str,
                    user_id: str | None = None) -> tuple[Score, float]:
        """Run (or find, or replay) the judge session ``session_id``; its score and what it cost."""
        judge = type(agent)(self.rubric, model=self.model, runtime=agent.runtime, tuning=Tuning(checkpoint=True),
                            name="judge")
        done = await agent.runtime.get_checkpoint(session_id, "latest", user_id=user_id)
        if done is not None and done.execution_status == "completed":
            messages, usage = done.messages, done.cumulative_usage
        else:
            result = await judge.run(self.prompt(judged), session_id=session_id, user_id=user_id)
            messages, usage = result.messages, result.usage
        answer = next((m.content for m in reversed(messages) if m.role == "assistant"), "")
        return parse_verdict(answer, session_id), usage.cost_usd or 0.0


def parse_verdict(text: str, where: str) -> Score:
    """A model judge's answer as a Score: a JSON object with ``score``, else the first number in the text."""
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        try:
            doc = json.loads(text[start:end + 1])
            if isinstance(doc, dict) and isinstance(doc.get("score"), (int, float)):
                return Score(float(doc["score"]), str(doc.get("reasons", "")))
        except ValueError:
            pass
    found = _NUMBER.search(text)
    if found is None:
        raise LoomrayUserError(f"model judge {where} answered without a score: {text[:200]!r}")
    return Score(float(found.group()), text.strip()[:2000])


async def call_judge(judge: Any, agent: Agent, judged: JudgeInput, session_id: str,
                     user_id: str | None = None) -> tuple[Score, float]:
    """``judge``'s score of ``judged`` and what judging cost (a function judge: nothing)."""
    if isinstance(judge, ModelJudge):
        return await judge.score(agent, judged, session_id, user_id)
    verdict = judge(judged)
    if inspect.isawaitable(verdict):
        verdict = await verdict
    return Score.of(verdict), 0.0


def check_judge(judge: object) -> None:
    """A ``TypeError`` unless ``judge`` is a ModelJudge or a callable."""
    if not isinstance(judge, ModelJudge) and not callable(judge):
        raise TypeError(f"judge must be a callable (JudgeInput) -> float | Score or a loomray.ModelJudge, "
                        f"got {type(judge).__name__}")


def transcript(messages: list[Message]) -> list[Message]:
    """The messages a judge is given (a copy: a judge cannot change a branch)."""
    return [m.model_copy() for m in messages]
