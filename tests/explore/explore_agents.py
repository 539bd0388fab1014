"""Scripted agents for the exploration tests: a branch's prompt says how it goes.

A variant's prompt is ``"variant NAME q=Q passes=P"``: the branch makes P tool
passes (the ``step`` tool), then answers ``"answer Q"``. Anything else (the
base session's task) is answered at once. A judge reads Q back: from the
answer once the branch finished, from the prompt while it runs (so
early-stopping tests can rank running branches). The model is a
``ScriptedModel`` (deterministic, priced) whose file-backed counter survives
a killed process.
"""

from __future__ import annotations

import re
from typing import Any

from loomray import Agent, JudgeInput, Score, Tuning, Variant
from loomray.models import ScriptedModel
from loomray.records import Message

_VARIANT = re.compile(r"^variant (\S+) q=([\d.]+) passes=(\d+)$")


def step() -> str:
    """A tool that does nothing but take a pass."""
    return "ok"


def variant(name: str, q: float, passes: int = 0) -> Variant:
    """The prompt-only variant that runs ``passes`` tool passes and answers with quality ``q``."""
    return Variant(prompt=f"variant {name} q={q} passes={passes}")


def reply(messages: list[Message]) -> Any:
    """What the scripted model answers this transcript with (see the module docstring)."""
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    hit = _VARIANT.match(messages[last_user].content) if last_user >= 0 else None
    if hit is None:
        return "base ready"
    done = sum(1 for m in messages[last_user + 1:] if m.role == "assistant")
    if done < int(hit.group(3)):
        return {"tool": "step", "args": {"n": done}}
    return f"answer {hit.group(2)}"


def model(*, delay: float = 0.0, counter_path: Any = None, replies: int = 40) -> ScriptedModel:
    """A ScriptedModel that answers every transcript by :func:`reply` (priced: 1 USD per million tokens)."""
    return ScriptedModel([lambda request: reply(request.messages)] * replies, delay=delay, counter_path=counter_path)


def make_agent(runtime: Any, **model_options: Any) -> Agent:
    """An agent with checkpoints on, the ``step`` tool and the scripted model."""
    return Agent("You explore.", model=model(**model_options), tools=[step], runtime=runtime,
                 tuning=Tuning(checkpoint=True))


def quality(judged: JudgeInput) -> float:
    """Q of the branch: from its answer once finished, else from its prompt."""
    if judged.result is not None:
        return float(judged.result.output.split()[-1])
    hit = _VARIANT.match(judged.variant.prompt or "")
    return float(hit.group(2)) if hit else 0.0


def judge(judged: JudgeInput) -> Score:
    """A function judge: the quality, with a reason."""
    return Score(quality(judged), f"quality of {judged.session_id}")


async def async_judge(judged: JudgeInput) -> float:
    """The same judge, async."""
    return quality(judged)
