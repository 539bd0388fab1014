"""What ``loomray timeline`` shows: a session's incarnations, one per lease epoch.

Read only from what the store keeps, through public :class:`storage.Store` calls and the documented layout;
what is gone is shown as unknown, never guessed (the sources: docs/api.md, "Command line").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.table import Table
from rich.text import Text

from loomray.cli.common import STATUS_STYLE, CliError, first_line, who
from loomray.cli.output import iso_time, parse_iso, time_cells
from loomray.cli.tables import Col, fit_table
from loomray.run_errors import read_error
from loomray.storage import RunRecord, Store, layout


def _json_object(store: Store, key: str) -> dict[str, Any] | None:
    obj = store.objects.get(key=key)
    if obj is None:
        return None
    try:
        doc = json.loads(obj.data)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


_NODE_IN_OWNER = re.compile(r"@([0-9a-fA-F]{6,})")


@dataclass
class Incarnation:
    """One lease epoch of a session: who held it, when, what it did and how it ended."""

    epoch: int
    owner: str | None = None
    node_id: str | None = None
    acquired_at: datetime | None = None
    times: list[datetime] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    steps: int = 0
    seals: int = 0
    status: str | None = None
    status_at: datetime | None = None
    error: str | None = None
    causes: list[str] = field(default_factory=list)
    outcome: str | None = None

    @property
    def start(self) -> datetime | None:
        return self.acquired_at or (min(self.times) if self.times else None)

    @property
    def end(self) -> datetime | None:
        return max(self.times) if self.times else None

    def touch(self, t: datetime | None, run_id: str | None = None) -> None:
        if t is not None:
            self.times.append(t)
        if run_id and run_id not in self.runs:
            self.runs.append(run_id)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "owner": self.owner, "node_id": self.node_id, "start": iso_time(self.start),
                "end": iso_time(self.end), "runs": self.runs,
                "turns": {"first": min(self.turns), "last": max(self.turns)} if self.turns else None,
                "steps": self.steps, "status": self.status, "error": self.error,
                "cause": "; ".join(self.causes) or None, "outcome": self.outcome}


class _Timeline:
    """The incarnations of one session, filled in from each kind of record the store keeps."""

    def __init__(self, store: Store, session_id: str, user_id: str | None) -> None:
        self.store, self.session_id, self.user_id = store, session_id, user_id
        self.incarnations: dict[int, Incarnation] = {}
        self.lease: dict[str, Any] | None = None
        self.current: int | None = None

    def at(self, epoch: Any) -> Incarnation | None:
        """The incarnation of ``epoch``, created on first sight; None for what is not an epoch."""
        if type(epoch) is not int or epoch < 0:
            return None
        return self.incarnations.setdefault(epoch, Incarnation(epoch))

    def read_epoch_markers(self) -> None:
        """One marker per epoch ever acquired: its owner and when."""
        prefix = layout.epoch_prefix(self.session_id, self.user_id)
        for info in self.store.objects.list(prefix=prefix):
            name = info.key[len(prefix):]
            if not (name.isascii() and name.isdigit()):
                continue
            i = self.at(int(name))
            doc = _json_object(self.store, info.key) or {}
            if i is not None:
                i.owner = doc.get("owner") if isinstance(doc.get("owner"), str) else i.owner
                i.acquired_at = parse_iso(doc.get("acquired_at"))

    def read_lease(self) -> None:
        """``lease.json``: the current holder, and the owners its fence chain remembers."""
        lease = self.lease = _json_object(self.store, layout.lease_key(self.session_id, self.user_id))
        self.current = lease.get("epoch") if lease is not None and type(lease.get("epoch")) is int else None
        i = self.at(self.current)
        if lease is None or i is None:
            return
        i.owner = i.owner or lease.get("owner")
        i.acquired_at = i.acquired_at or parse_iso(lease.get("acquired_at"))
        note = lease.get("note")
        for prev in (note.get("prev") if isinstance(note, dict) else None) or []:
            if isinstance(prev, dict) and type(prev.get("epoch")) is int and isinstance(prev.get("owner"), str):
                j = self.at(prev["epoch"])
                if j is not None:
                    j.owner = j.owner or prev["owner"]

    def read_status_rows(self) -> None:
        """The session's status rows (the history, until a compaction keeps only the latest)."""
        sid, uid = self.session_id, self.user_id
        for r in sorted(self.store.sessions.history(sid, user_id=uid), key=lambda r: r.updated_at):
            i = self.at(r.epoch)
            if i is None:
                continue
            i.touch(r.updated_at, r.run_id)
            i.node_id = i.node_id or r.node_id
            if i.status_at is None or r.updated_at >= i.status_at:
                i.status, i.status_at, i.error = r.status, r.updated_at, r.error
                if r.status == "failed":  # the index holds the error's type only; its text is the session's
                    i.error = read_error(self.store, sid, uid, r.run_id) or r.error

    def read_run_records(self) -> set[tuple[int, str]]:
        """Which run started in which epoch, and from where; returns the ``(epoch, run_id)`` pairs seen."""
        records = self.store.runs.list(self.session_id, user_id=self.user_id)
        for rec in records:
            i = self.at(rec.epoch)
            if i is not None:
                i.touch(rec.created_at, rec.run_id)
                i.causes.append(_run_cause(self.session_id, rec))
        return {(rec.epoch, rec.run_id) for rec in records}

    def read_journal(self, recorded: set[tuple[int, str]]) -> None:
        """Steps per epoch, and takeovers (a run continued by a later epoch than the one that started it)."""
        for run_id in self.store.journal.runs(self.session_id, user_id=self.user_id):
            first_epoch: int | None = None
            for entry in self.store.journal.read(self.session_id, run_id, user_id=self.user_id).all:
                i = self.at(entry.epoch)
                if i is None:
                    continue
                if entry.kind == "seal":  # written by the next owner on the run it fences: not its own work
                    i.touch(entry.created_at)
                    i.seals += 1
                    owner = entry.output.get("owner") if isinstance(entry.output, dict) else None
                    i.owner = i.owner or (owner if isinstance(owner, str) else None)
                    continue
                i.touch(entry.created_at, run_id)
                i.steps += entry.kind not in ("run_start", "run_end")
                if first_epoch is None:
                    first_epoch = entry.epoch
                elif entry.epoch > first_epoch and (entry.epoch, run_id) not in recorded:
                    cause = f"took over run {run_id} from epoch {first_epoch} (recovery)"
                    if cause not in i.causes:
                        i.causes.append(cause)

    def read_checkpoints(self) -> None:
        """The live checkpoints: the turns each epoch wrote."""
        rows = self.store.query(user_id=self.user_id, session_id=self.session_id,
                                columns=["turn", "created_at", "epoch"])
        for r in rows.to_pylist():
            i = self.at(r["epoch"])
            if i is not None:
                i.touch(r["created_at"])
                i.turns.append(r["turn"])

    def conclude(self) -> list[Incarnation]:
        """The incarnations in epoch order, with what the records leave implicit filled in: node, cause, outcome."""
        epochs = sorted(self.incarnations)
        for k, e in enumerate(epochs):
            i = self.incarnations[e]
            if i.node_id is None and i.owner:
                m = _NODE_IN_OWNER.search(i.owner)
                i.node_id = m.group(1) if m else None
            if i.owner and "repair" in i.owner:
                i.causes.insert(0, "lease repair")
            if not i.causes:
                if i.seals and not i.steps:
                    i.causes.append("took the lease and fenced the previous holder")
                elif e == 0:
                    i.causes.append("written without a lease")
                elif k == 0 and (i.steps or i.turns):
                    i.causes.append("first recorded run (its run record is gone)")
            i.outcome = _outcome(i, epochs[k + 1] if k + 1 < len(epochs) else None, self.current)
        return [self.incarnations[e] for e in epochs]


def session_timeline(store: Store, session_id: str, user_id: str | None) -> dict[str, Any]:
    """The session's incarnations by epoch, from everything the store keeps about them (see the module doc)."""
    timeline = _Timeline(store, session_id, user_id)
    timeline.read_epoch_markers()
    timeline.read_lease()
    timeline.read_status_rows()
    timeline.read_journal(timeline.read_run_records())
    timeline.read_checkpoints()
    if not timeline.incarnations:
        raise CliError(f"unknown session {who(session_id, user_id)} in {store.describe()} "
                       "(no lease, epoch marker, status row, run record, journal or checkpoint)")
    incarnations = timeline.conclude()
    return {"session_id": session_id, "user_id": user_id, "current_epoch": timeline.current,
            "lease_owner": timeline.lease.get("owner") if timeline.lease is not None else None,
            "incarnations": [i.to_dict() for i in incarnations]}


def _run_cause(session_id: str, rec: RunRecord) -> str:
    req = rec.request if isinstance(rec.request, dict) else {}
    if rec.base_session_id and rec.base_session_id != session_id:
        return f"forked from {rec.base_session_id} at {rec.base_checkpoint_id}"
    if rec.base_checkpoint_id:
        how = "with a new prompt" if req.get("prompt") else "to continue"
        return f"resumed from {rec.base_checkpoint_id} {how} (run {rec.run_id})"
    if rec.replay_from:
        return f"re-ran run {rec.replay_from}, replaying its journal (run {rec.run_id})"
    return f"new run {rec.run_id}" + (" (resume)" if req.get("kind") == "resume" else "")


def _outcome(i: Incarnation, later: int | None, current: int | None) -> str:
    if i.status == "completed":
        return "completed" + (f"; epoch {later} came later" if later is not None else "")
    if i.status == "failed":
        err = first_line(i.error or "")
        return (f"failed: {err}" if err else "failed") + (f"; epoch {later} came later" if later is not None else "")
    if later is not None:
        return f"superseded by epoch {later} (lease taken over)"
    if i.status in ("running", "pending"):
        return f"{i.status}; holds the lease" if i.epoch == current else i.status
    return "holds the lease" if i.epoch == current else "-"


def timeline_table(data: dict[str, Any]) -> Table:
    """The incarnations as a rich table that fits the terminal (the cause column wraps)."""
    incs = data["incarnations"]
    times = time_cells([parse_iso(x["start"]) for x in incs] + [parse_iso(x["end"]) for x in incs])
    starts, ends = times[:len(incs)], times[len(incs):]
    rows = []
    for x, start, end in zip(incs, starts, ends, strict=False):
        what = x["cause"] or "-"
        outcome = Text(x["outcome"] or "-", style=STATUS_STYLE.get(x["status"] or "", ""))
        cell = Text(what + " → ")
        cell.append(outcome)
        rows.append({"epoch": str(x["epoch"]), "node": (x["node_id"] or "-")[:12], "owner": x["owner"] or "-",
                     "start": start, "end": end,
                     "turns": "-" if not x["turns"] else f"{x['turns']['first']}-{x['turns']['last']}",
                     "what": cell})
    cols = [Col("epoch", justify="right")] + ([Col("node", drop=3)] if any(x["node_id"] for x in incs) else [])
    cols += [Col("owner", drop=4), Col("start"),
            Col("end", drop=1), Col("turns", drop=2, justify="right"),
            Col("what", "what happened", wrap=True, min_wrap=30)]
    who = data["session_id"] + (f" (user {data['user_id']})" if data["user_id"] else "")
    return fit_table(cols, rows, title=f"incarnations of {who} (times UTC)", title_justify="left")
