"""What the session page shows, read from the store: transcript, checkpoints, events, incarnations, forks.

Everything goes through the same readers the command line uses (the
checkpoint loader, the journal reader of ``loomray logs``, ``loomray
timeline``'s incarnations, ``loomray tree``'s fork tree, the control
module's pending calls), so the page and the terminal never disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loomray import control
from loomray.checkpoint_format import load_checkpoint
from loomray.cli.common import CliError
from loomray.cli.steering import LogReader, entry_summary
from loomray.cli.timeline_view import session_timeline
from loomray.cli.tree_view import ForkNode, fork_tree
from loomray.errors import CheckpointException
from loomray.records import Checkpoint, ToolCall
from loomray.storage import JournalEntry, Store
from loomray.storage.journal import entry_name
from loomray.storage.rows import CheckpointRow, SessionRow

#: How many hops up the ``forked_from`` links the page follows to find the root of a fork tree.
_MAX_TREE_DEPTH = 16


def event_id(entry: JournalEntry) -> str:
    """A journal entry's id in the page and in the live stream (``Last-Event-ID``): ``{run_id}/{entry name}``."""
    return f"{entry.run_id}/{entry_name(entry)}"


def event_view(entry: JournalEntry) -> dict[str, Any]:
    """A journal entry as the page shows it (the live stream sends the same fields as JSON)."""
    return {"id": event_id(entry), "run_id": entry.run_id, "seq": entry.seq, "kind": entry.kind,
            "at": entry.created_at.strftime("%Y-%m-%d %H:%M:%S"), "summary": entry_summary(entry)}


@dataclass
class TranscriptItem:
    """One message of the transcript, or the mark of a checkpoint taken after the messages before it."""

    kind: str  # "message" or "checkpoint"
    role: str = ""
    content: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)
    tool_call_id: str | None = None
    is_error: bool = False
    checkpoint: CheckpointRow | None = None


@dataclass
class SessionView:
    """Everything the session page shows."""

    session_id: str
    user_id: str | None
    status: SessionRow | None
    latest: Checkpoint | None
    checkpoints: list[CheckpointRow]
    transcript: list[TranscriptItem]
    events: list[dict[str, Any]]
    pending: list[ToolCall]
    incarnations: list[dict[str, Any]]
    tree: ForkNode | None
    load_error: str | None = None

    @property
    def state(self) -> str:
        """The status a person reads: the status row's, else the latest checkpoint's, else unknown."""
        if self.status is not None:
            return self.status.status
        return self.latest.execution_status if self.latest is not None else "unknown"

    @property
    def spend(self) -> list[tuple[int, float]]:
        """(turn, running cost) of each checkpoint with a known cost, oldest first: the spend chart's points."""
        return [(r.turn, r.cost_usd) for r in self.checkpoints if r.cost_usd is not None]


def transcript(ckpt: Checkpoint | None, rows: list[CheckpointRow]) -> list[TranscriptItem]:
    """The latest checkpoint's messages, each checkpoint marked after the last message it held."""
    if ckpt is None:
        return []
    marks: dict[int, list[CheckpointRow]] = {}
    for r in rows:
        if 0 < r.message_count <= len(ckpt.messages):
            marks.setdefault(r.message_count, []).append(r)
    items = []
    for i, m in enumerate(ckpt.messages, 1):
        calls = [{"id": c.id, "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}
                 for c in m.tool_calls]
        items.append(TranscriptItem("message", role=m.role, content=m.content, calls=calls,
                                    tool_call_id=m.tool_call_id, is_error=m.is_error))
        items += [TranscriptItem("checkpoint", checkpoint=r) for r in marks.get(i, [])]
    return items


def tree_root(store: Store, session_id: str, user_id: str | None) -> ForkNode | None:
    """The whole fork tree ``session_id`` belongs to (from its root); None when the index knows no such session."""
    try:
        node = fork_tree(store, session_id, user_id)
        for _ in range(_MAX_TREE_DEPTH):
            if node.forked_from is None:
                break
            node = fork_tree(store, node.forked_from, user_id)
        return node
    except CliError:
        return None


def _incarnations(store: Store, session_id: str, user_id: str | None) -> list[dict[str, Any]]:
    try:
        return list(session_timeline(store, session_id, user_id)["incarnations"])
    except CliError:
        return []


def read_session(store: Store, session_id: str, user_id: str | None) -> SessionView | None:
    """The session page's data; None when the store knows nothing of the session."""
    status = store.sessions.get(session_id, user_id=user_id)
    rows = list(reversed(store.checkpoints.list(session_id, user_id=user_id, limit=None)))
    entries = LogReader(store, session_id, user_id).new_entries()
    if status is None and not rows and not entries:
        return None
    latest, error = None, None
    try:
        latest = load_checkpoint(store, session_id, "latest", user_id=user_id)
    except CheckpointException as e:  # shown on the page: the rest of what the store keeps still is
        error = str(e)
    pending: list[ToolCall] = []
    if latest is not None and latest.execution_status == "awaiting_approval":
        pending = control.pending_calls(store, session_id, user_id) or []
    return SessionView(session_id=session_id, user_id=user_id, status=status, latest=latest, checkpoints=rows,
                       transcript=transcript(latest, rows), events=[event_view(e) for e in entries],
                       pending=pending, incarnations=_incarnations(store, session_id, user_id),
                       tree=tree_root(store, session_id, user_id), load_error=error)
