"""Condensing: keep a long transcript under a token budget, deterministically (``Tuning.condense_after_tokens``).

Not to be confused with the index's compaction (``loomray compact``,
:meth:`storage.Store.compact`), which merges index files: this module
touches only a run's transcript. Condensing is a pure function of the
transcript (no model call), so a replayed run condenses to exactly the same
messages and every later step's input hash
matches its journal entry. It keeps the system message, the first user message
(the task) and the last ``keep_last`` messages, and folds everything between
into one short digest appended to the task message. The cut never separates an
assistant message from the tool results that answer it.
"""

from __future__ import annotations

import operator

from loomray.records import Message

#: Rough characters per token; good enough for a budget, never used for billing.
CHARS_PER_TOKEN = 4
_DIGEST_CHARS = 160


#: Characters counted per message object (messages are immutable): a long transcript is estimated in O(new
#: messages), not O(transcript), on every pass. Bounded: cleared when it grows past ``_CACHE_LIMIT`` entries.
_chars: dict[int, tuple[Message, int]] = {}
_CACHE_LIMIT = 200_000


def _message_chars(m: Message) -> int:
    hit = _chars.get(id(m))
    if hit is not None and hit[0] is m:
        return hit[1]
    chars = len(m.content) + 16 + sum(len(c.name) + len(str(c.arguments)) + 16 for c in m.tool_calls)
    if len(_chars) >= _CACHE_LIMIT:
        _chars.clear()
    _chars[id(m)] = (m, chars)
    return chars


#: The last transcript estimated per first message (one per transcript in practice), and its character count:
#: a transcript that only grew since is counted from where that one ended.
_prefixes: dict[int, tuple[list[Message], int]] = {}


def estimate_tokens(messages: list[Message]) -> int:
    """A cheap, deterministic token estimate of a transcript."""
    if not messages:
        return 0
    key = id(messages[0])
    prev = _prefixes.get(key)
    if prev is not None and len(prev[0]) <= len(messages) and all(map(operator.is_, prev[0], messages)):
        chars = prev[1] + sum(map(_message_chars, messages[len(prev[0]):]))
    else:
        chars = sum(map(_message_chars, messages))
    if len(_prefixes) >= 4096:
        _prefixes.clear()
    _prefixes[key] = (list(messages), chars)
    return chars // CHARS_PER_TOKEN


def _cut_index(messages: list[Message], start: int, keep_last: int) -> int:
    """First index of the kept tail, moved back so no tool result loses its call."""
    cut = max(start, len(messages) - keep_last)
    while cut > start and messages[cut].role == "tool":
        cut -= 1
    return cut


def condense(messages: list[Message], *, budget_tokens: int, keep_last: int) -> list[Message] | None:
    """Return a condensed transcript, or None when it is under budget or nothing can be folded."""
    if estimate_tokens(messages) <= budget_tokens:
        return None
    head_end = 0
    while head_end < len(messages) and messages[head_end].role == "system":
        head_end += 1
    if head_end >= len(messages) or messages[head_end].role != "user":
        return None
    task = messages[head_end]
    start = head_end + 1
    cut = _cut_index(messages, start, keep_last)
    folded = messages[start:cut]
    if not folded:
        return None
    assistants = sum(1 for m in folded if m.role == "assistant")
    # The digest's first line keeps the wording of the releases that called this compaction: it is part of the
    # transcript, so of the input hash of every journaled step after it (a run recovered across an upgrade).
    lines = [f"[compacted: {len(folded)} earlier messages, {assistants} from the assistant]"]
    for m in folded:
        if m.role == "assistant" and m.tool_calls:
            text = "called " + ", ".join(f"{c.name}({_short(str(c.arguments), 60)})" for c in m.tool_calls)
        else:
            text = _short(m.content, _DIGEST_CHARS)
        who = m.name if m.role == "tool" and m.name else m.role
        lines.append(f"- {who}: {text}")
    digest = "\n".join(lines)
    new_task = task.model_copy(update={"content": f"{task.content}\n\n{digest}"})
    return [*messages[:head_end], new_task, *messages[cut:]]


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
