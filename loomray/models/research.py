"""An offline "research" model and its tools: a run that looks like real work.

``Agent("...", model="demo:research", tools=research_tools())`` runs a
multi-turn research task with no network and no API key: each pass the model
searches, fetches a page (a few KB of text), and takes a note; after
``passes`` passes it writes a final report citing its notes. A follow-up
request (``resume("Add a section on costs.")``) gets one more
search / read / note round on it and a revised report. Everything is a
pure function of the transcript, so replays and restored sessions get exactly
the answers an uninterrupted run would have had.

Model settings (``resolve_model("demo:research", passes=8, page_kb=3)``):
``passes`` (default 9), ``page_kb`` (default 3), ``delay`` seconds per call.
"""

from __future__ import annotations

import asyncio
import hashlib
import re

from loomray.condense import estimate_tokens
from loomray.models.base import ModelRequest, ModelResponse
from loomray.models.scripted import reply_index
from loomray.records import Message, ToolCall, Usage
from loomray.tools import Tool, tool

_WORDS = (
    "actor checkpoint replay journal lease epoch transcript shard object bucket index parquet "
    "latency throughput durability recovery supervisor node raylet schedule backoff retry "
    "snapshot compaction tombstone partition consistency fencing quorum token budget tool "
    "agent session fork lineage cursor boundary upload manifest ordering idempotent"
).split()


def _prose(seed: str, n_chars: int) -> str:
    """Deterministic pseudo-prose of about ``n_chars`` characters."""
    out: list[str] = []
    size = 0
    counter = 0
    while size < n_chars:
        digest = hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
        words = [_WORDS[b % len(_WORDS)] for b in digest[:12]]
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)[:n_chars]


def _topic(messages: list[Message]) -> str:
    for m in messages:
        if m.role == "user":
            first = m.content.strip().splitlines()[0] if m.content.strip() else "the task"
            return first[:80]
    return "the task"


def _followup(messages: list[Message]) -> tuple[str | None, int]:
    """A later user request (not the continuation nudge) and the assistant turns since it."""
    users = [i for i, m in enumerate(messages) if m.role == "user"]
    if len(users) < 2:
        return None, 0
    last = messages[users[-1]]
    if last.content.strip() == "Continue the interrupted task.":
        return None, 0
    since = sum(1 for m in messages[users[-1] + 1:] if m.role == "assistant")
    return last.content.strip().splitlines()[0] if last.content.strip() else None, since


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "topic"


_ASPECTS = ("background", "prior work", "failure modes", "measurements", "trade-offs",
            "open questions", "operations", "costs", "security", "scaling", "alternatives", "summary")

#: Tool calls per pass: search, then fetch the first hit, then a note (3 steps per aspect).
_STEPS = ("search", "fetch_page", "take_note")


class ResearchModel:
    """Deterministic offline research agent (``model="demo:research"``)."""

    def __init__(self, name: str = "demo:research", *, passes: int = 9, page_kb: float = 3.0,
                 delay: float = 0.0) -> None:
        self.name = name
        self.passes = passes
        self.page_kb = page_kb
        self.delay = delay
        self.calls = 0

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if self.delay:
            await asyncio.sleep(self.delay)
        self.calls += 1
        index = reply_index(request.messages)
        topic = _topic(request.messages)
        followup, since = _followup(request.messages)
        if index < self.passes or (followup is not None and since < len(_STEPS)):
            if index < self.passes:  # the original plan first, even after a resume
                aspect = _ASPECTS[(index // len(_STEPS)) % len(_ASPECTS)]
                step = _STEPS[index % len(_STEPS)]
            else:  # then one search / read / note round on the follow-up request
                assert followup is not None  # not a planned pass, so the condition above found a follow-up
                aspect, step = followup[:60], _STEPS[since]
            args: dict[str, str | float]
            if step == "search":
                args = {"query": f"{topic} {aspect}"}
                text = f"Looking into {aspect} of {topic}."
            elif step == "fetch_page":
                args = {"url": f"https://docs.example/{_slug(topic)}/{_slug(aspect)}", "max_kb": self.page_kb}
                text = f"The first hit on {aspect} looks relevant; reading it."
            else:
                tool_texts = [m.content for m in request.messages if m.role == "tool"]
                gist = " ".join((tool_texts[-1] if tool_texts else "").split()[:18])
                args = {"title": f"{aspect}", "text": f"{aspect}: {gist}"}
                text = f"Noting what matters about {aspect}."
            message = Message(role="assistant", content=text,
                              tool_calls=[ToolCall(id=f"s{index:04d}_0", name=step, arguments=args)])
        else:
            notes = [m.content for m in request.messages if m.role == "tool" and m.name == "take_note"]
            body = "\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) or "(no notes were taken)"
            message = Message(role="assistant", content=(
                f"# Report: {topic}\n\nAfter {index} steps of research, the findings:\n\n{body}\n\n"
                f"Conclusion: {_prose(topic + ':conclusion', 240)}"))
        tin, tout = estimate_tokens(request.messages), estimate_tokens([message])
        # Priced like a mid-size model ($3 / $15 per million tokens) so cost columns mean something.
        cost = tin * 3e-6 + tout * 15e-6
        return ModelResponse(message=message, usage=Usage(input_tokens=tin, output_tokens=tout, requests=1,
                                                          cost_usd=cost), model=self.name)


def search(query: str) -> str:
    """Search the offline corpus.

    Args:
        query: what to look for.
    """
    slug = _slug(query)
    return "\n".join(f"[{i + 1}] https://docs.example/{slug}/{i} -- {_prose(query + str(i), 180)}" for i in range(5))


def fetch_page(url: str, max_kb: float = 3.0) -> str:
    """Fetch a page of the offline corpus as text.

    Args:
        url: the page address, from a search result.
        max_kb: how much text to return, in KB.
    """
    if not url.startswith("https://docs.example/"):
        raise ValueError(f"offline corpus has no page {url!r}")
    return _prose(url, int(max_kb * 1024))


def take_note(title: str, text: str) -> str:
    """Keep a note for the final report.

    Args:
        title: a short heading.
        text: the note.
    """
    return f"{title}: {text}"


def _note_key(args: dict) -> str:
    raw = f"{args.get('title')}\n{args.get('text')}"
    return "note-" + hashlib.sha256(raw.encode()).hexdigest()[:16]


def research_tools() -> list[Tool]:
    """The demo's tools: ``search``, ``fetch_page`` and ``take_note`` (idempotent per note)."""
    return [tool(search), tool(fetch_page), tool(take_note, idempotency_key=_note_key)]
