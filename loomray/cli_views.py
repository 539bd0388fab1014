"""What ``loomray tree`` and ``loomray timeline`` show: a session's forks and its incarnations.

Both read only what the store keeps, through public :class:`storage.Store`
calls and the documented object layout (``storage.layout``):

- the fork tree comes from the checkpoint index: every checkpoint row of a
  fork names the session it was forked from (``forked_from``) and the first
  one its base checkpoint (``parent_checkpoint_id``); when retention has
  dropped that row, the fork's first run record names the base
  (``base_session_id``/``base_checkpoint_id``). A session's own spend is its
  cumulative cost minus the cost its base checkpoint carried over.
- the timeline groups, by lease epoch, the epoch markers (owner, when it was
  acquired), ``lease.json`` (the current owner and the owners its fence chain
  remembers), the session status rows (node, status, error), the run records
  (which run started, from where), the journal (steps, seals of a takeover)
  and the live checkpoint rows. A compaction keeps only the latest status row
  of a session, and prune/retention delete old objects: what is gone is shown
  as unknown, never guessed.

Rendering: a terminal table (tree branches drawn with box characters) that
fits the terminal, a JSON document, and for the tree a self-contained HTML
page (inline CSS, no scripts, no external assets).
"""

from __future__ import annotations

import html
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from rich import box
from rich.text import Text

from loomray.cli_common import CliError, Col, first_line, fit_table, iso_time, money, time_cells

_STATUS_STYLE = {"running": "cyan", "completed": "green", "failed": "red", "pending": "yellow", "active": "cyan"}
_CKPT_COLUMNS = ["session_id", "checkpoint_id", "turn", "created_at", "cost_usd", "parent_checkpoint_id",
                 "forked_from", "execution_status", "epoch"]


def _who(session_id: str, user_id: str | None) -> str:
    return f"{session_id!r}" + (f" of user {user_id!r}" if user_id else "")


# --------------------------------------------------------------------- fork tree


@dataclass
class ForkNode:
    """One session of a fork tree."""

    session_id: str
    user_id: str | None
    forked_from: str | None = None
    parent_checkpoint_id: str | None = None
    base_turn: int | None = None
    turns: int | None = None
    status: str | None = None
    cost_usd: float | None = None
    carried_cost_usd: float | None = None
    latest_checkpoint_id: str | None = None
    first_checkpoint_at: datetime | None = None
    updated_at: datetime | None = None
    children: list[ForkNode] = field(default_factory=list)

    @property
    def own_spend_usd(self) -> float | None:
        """What this session spent itself: its cost minus what its base checkpoint carried (None: unknown)."""
        if self.cost_usd is None:
            return None
        if self.forked_from is None:
            return self.cost_usd
        return None if self.carried_cost_usd is None else max(0.0, self.cost_usd - self.carried_cost_usd)

    @property
    def own_turns(self) -> int | None:
        if self.turns is None:
            return None
        return self.turns - (self.base_turn or 0)

    def walk(self) -> list[ForkNode]:
        out = [self]
        for child in self.children:
            out += child.walk()
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "user_id": self.user_id, "forked_from": self.forked_from,
                "parent_checkpoint_id": self.parent_checkpoint_id, "base_turn": self.base_turn,
                "turns": self.turns, "own_turns": self.own_turns, "status": self.status,
                "cost_usd": self.cost_usd, "carried_cost_usd": self.carried_cost_usd,
                "own_spend_usd": self.own_spend_usd, "latest_checkpoint_id": self.latest_checkpoint_id,
                "first_checkpoint_at": iso_time(self.first_checkpoint_at), "updated_at": iso_time(self.updated_at),
                "children": [c.to_dict() for c in self.children]}


def fork_tree(store: Any, session_id: str, user_id: str | None) -> ForkNode:
    """The fork tree rooted at ``session_id`` (forks of forks included), from one scan of the user's index."""
    table = store.query(user_id=user_id, columns=_CKPT_COLUMNS)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in table.to_pylist():
        rows[r["session_id"]].append(r)
    status_rows = {r.session_id: r for r in store.list_sessions(user_id=user_id)}
    if session_id not in rows and session_id not in status_rows:
        raise CliError(f"unknown session {_who(session_id, user_id)} in {store.describe()}")

    def forked_from(sid: str) -> str | None:
        parents = {r["forked_from"] for r in rows.get(sid, ()) if r["forked_from"] and r["forked_from"] != sid}
        if not parents:
            return None
        latest = max(rows[sid], key=lambda r: (r["epoch"], r["checkpoint_id"]))
        return latest["forked_from"] if latest["forked_from"] in parents else sorted(parents)[0]

    parent_of = {sid: forked_from(sid) for sid in rows}
    children: dict[str, list[str]] = defaultdict(list)
    for sid, parent in parent_of.items():
        if parent is not None:
            children[parent].append(sid)

    def node(sid: str) -> ForkNode:
        mine = rows.get(sid, [])
        n = ForkNode(sid, user_id, forked_from=parent_of.get(sid))
        if mine:
            latest = max(mine, key=lambda r: (r["epoch"], r["checkpoint_id"]))
            n.turns, n.cost_usd = latest["turn"], latest["cost_usd"]
            n.latest_checkpoint_id, n.status = latest["checkpoint_id"], latest["execution_status"]
            n.first_checkpoint_at = min(r["created_at"] for r in mine)
        row = status_rows.get(sid)
        if row is not None:
            n.status, n.updated_at = row.status, row.updated_at
        if n.forked_from is not None:
            _fill_base(store, n, mine, rows.get(n.forked_from, []))
        return n

    seen: set[str] = set()

    def build(sid: str) -> ForkNode:
        seen.add(sid)
        n = node(sid)
        kids = [build(c) for c in children.get(sid, []) if c not in seen]
        never = datetime.max.replace(tzinfo=timezone.utc)
        n.children = sorted(kids, key=lambda k: (k.first_checkpoint_at or never, k.session_id))
        return n

    return build(session_id)


def _fill_base(store: Any, n: ForkNode, mine: list[dict[str, Any]], parent_rows: list[dict[str, Any]]) -> None:
    """The fork's base checkpoint (its id, turn and the cost it carried), from the index, else the stored objects."""
    by_id = {r["checkpoint_id"]: r for r in parent_rows}
    base = next((r["parent_checkpoint_id"] for r in sorted(mine, key=lambda r: (r["turn"], r["created_at"]))
                 if r["parent_checkpoint_id"] in by_id), None)
    if base is None:
        try:
            records = store.list_runs(n.session_id, user_id=n.user_id)
        except Exception:  # noqa: BLE001 - a view: an unreadable record only leaves the base unknown
            records = []
        base = next((rec.base_checkpoint_id for rec in records
                     if rec.base_session_id == n.forked_from and rec.base_checkpoint_id), None)
    n.parent_checkpoint_id = base
    if base is None:
        return
    if base in by_id:
        n.base_turn, n.carried_cost_usd = by_id[base]["turn"], by_id[base]["cost_usd"]
        return
    try:  # the row went (retention), the object may not have
        raw = store.get_checkpoint(n.forked_from, base, user_id=n.user_id)
    except Exception:  # noqa: BLE001
        raw = None
    if raw is not None:
        try:
            doc = json.loads(raw)
            n.base_turn = doc.get("turn")
            n.carried_cost_usd = (doc.get("cumulative_usage") or {}).get("cost_usd")
        except (ValueError, AttributeError):
            pass


def tree_json(root: ForkNode) -> dict[str, Any]:
    nodes = root.walk()
    spends = [n.own_spend_usd for n in nodes]
    return {"session_id": root.session_id, "user_id": root.user_id, "sessions": len(nodes),
            "spend_usd": sum(s for s in spends if s is not None), "spend_complete": None not in spends,
            "tree": root.to_dict()}


def _tree_lines(root: ForkNode) -> list[tuple[str, ForkNode]]:
    """``(branch prefix, node)`` in drawing order: ``├── `` / ``└── `` / ``│   ``."""
    out = [("", root)]

    def walk(n: ForkNode, indent: str) -> None:
        for i, child in enumerate(n.children):
            last = i == len(n.children) - 1
            out.append((indent + ("└── " if last else "├── "), child))
            walk(child, indent + ("    " if last else "│   "))

    walk(root, "")
    return out


def tree_table(root: ForkNode) -> tuple[Any, str]:
    """The tree as a rich table that fits the terminal, and a one-line summary."""
    lines = _tree_lines(root)
    rows = []
    for prefix, n in lines:
        cell = Text(prefix, style="dim")
        cell.append(n.session_id, style="bold" if n is root else "")
        rows.append({
            "session": cell,
            "from": n.parent_checkpoint_id or ("-" if n.forked_from is None else "?"),
            # A fork's turns as "forked at -> now", e.g. 5→15: the parent checkpoint's turn, then its own latest.
            "turns": "-" if n.turns is None else (str(n.turns) if n.forked_from is None or n.base_turn is None
                                                  else f"{n.base_turn}→{n.turns}"),
            "status": Text(n.status or "-", style=_STATUS_STYLE.get(n.status or "", "")),
            "spend": money(n.own_spend_usd) if n.own_spend_usd is not None or n.cost_usd is None else "?",
        })
    cols = [Col("session"), Col("from", "parent checkpoint", drop=4), Col("turns", justify="right"),
            Col("status"), Col("spend", "own spend", drop=1, justify="right")]
    title = f"fork tree of {root.session_id}" + (f" (itself a fork of {root.forked_from})" if root.forked_from else "")
    table = fit_table(cols, rows, title=title, box=box.SIMPLE_HEAD, title_justify="left")
    data = tree_json(root)
    summary = (f"{data['sessions']} session{'s' if data['sessions'] != 1 else ''}, own spend "
               f"{money(data['spend_usd'])}{'' if data['spend_complete'] else ' (some unknown)'}")
    return table, summary


_HTML_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem; color: #1d232a; }
h1 { font-size: 1.3rem; } code, .sid { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; }
ul.tree, ul.tree ul { list-style: none; margin: 0; padding-left: 1.6rem; }
ul.tree { padding-left: 0; }
ul.tree li { position: relative; margin: .35rem 0; }
ul.tree ul > li::before { content: ""; position: absolute; left: -1.1rem; top: -.4rem; width: .9rem;
  height: 1.45rem; border-left: 1px solid #9aa5b1; border-bottom: 1px solid #9aa5b1; }
.node { display: inline-block; border: 1px solid #c9d1d9; border-radius: 6px; padding: .35rem .6rem;
  background: #f6f8fa; }
.node:target { outline: 2px solid #0969da; }
.node .sid { font-weight: 600; }
.node dl { display: flex; flex-wrap: wrap; gap: .1rem 1rem; margin: .25rem 0 0; font-size: 12px; }
.node dt { color: #57606a; } .node dd { margin: 0 0 0 .25rem; }
.node .links { font-size: 12px; margin-top: .2rem; }
.status-completed { color: #1a7f37; } .status-failed { color: #cf222e; } .status-running { color: #0969da; }
"""


def _status_class(status: str) -> str:
    return ' class="status-' + html.escape(status) + '"'


def tree_html(root: ForkNode, *, store_desc: str, generated_at: datetime | None = None) -> str:
    """A self-contained HTML page of the tree: one ``div.node`` per session, ``a.child`` links parent -> child."""
    nodes = root.walk()
    anchor = {id(n): f"node-{i}" for i, n in enumerate(nodes)}
    parent_anchor: dict[int, str] = {}
    for n in nodes:
        for c in n.children:
            parent_anchor[id(c)] = anchor[id(n)]
    e = html.escape
    data = tree_json(root)

    def item(n: ForkNode) -> str:
        facts = [("parent checkpoint", n.parent_checkpoint_id or "-"),
                 ("forked at", "-" if n.base_turn is None else f"turn {n.base_turn}"),
                 ("turns", "-" if n.turns is None else str(n.turns)),
                 ("status", n.status or "-"),
                 ("own spend", money(n.own_spend_usd) if n.own_spend_usd is not None or n.cost_usd is None else "?"),
                 ("total cost", money(n.cost_usd))]
        dl = "".join(f"<dt>{e(k)}</dt><dd{_status_class(v) if k == 'status' else ''}>{e(v)}</dd>"
                     for k, v in facts)
        links = ""
        if id(n) in parent_anchor:
            links += f'fork of <a class="parent" href="#{parent_anchor[id(n)]}">{e(n.forked_from or "")}</a> '
        if n.children:
            links += "forks: " + ", ".join(f'<a class="child" href="#{anchor[id(c)]}">{e(c.session_id)}</a>'
                                           for c in n.children)
        attrs = f'class="node" id="{anchor[id(n)]}" data-session="{e(n.session_id)}"'
        if n.forked_from is not None:
            attrs += f' data-parent="{e(n.forked_from)}"'
        out = f'<li><div {attrs}><span class="sid">{e(n.session_id)}</span><dl>{dl}</dl>'
        if links:
            out += f'<div class="links">{links}</div>'
        out += "</div>"
        if n.children:
            out += "<ul>" + "".join(item(c) for c in n.children) + "</ul>"
        return out + "</li>"

    when = iso_time(generated_at or datetime.now(timezone.utc))
    title = f"fork tree of {root.session_id}"
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{e(title)}</title>\n<style>{_HTML_CSS}</style>\n</head>\n<body>\n"
            f"<h1>Fork tree of <code>{e(root.session_id)}</code></h1>\n"
            f"<p>{data['sessions']} sessions, own spend {e(money(data['spend_usd']))}"
            f"{'' if data['spend_complete'] else ' (some unknown)'}; store <code>{e(store_desc)}</code>; "
            f"generated {e(when or '')}.</p>\n"
            f'<ul class="tree">{item(root)}</ul>\n</body>\n</html>\n')


# --------------------------------------------------------------------- timeline


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if isinstance(value, str):
        try:
            t = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
    return None


def _json_object(store: Any, key: str) -> dict[str, Any] | None:
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


def session_timeline(store: Any, session_id: str, user_id: str | None) -> dict[str, Any]:
    """The session's incarnations by epoch, from everything the store keeps about them (see the module doc)."""
    from storage import layout
    from storage.rows import SESSION_SCHEMA

    inc: dict[int, Incarnation] = {}

    def at(epoch: Any) -> Incarnation | None:
        if type(epoch) is not int or epoch < 0:
            return None
        return inc.setdefault(epoch, Incarnation(epoch))

    # Epoch markers: one per epoch ever acquired (owner, acquired_at).
    prefix = layout.epoch_prefix(session_id, user_id)
    for info in store.objects.list(prefix=prefix):
        name = info.key[len(prefix):]
        if not (name.isascii() and name.isdigit()):
            continue
        i = at(int(name))
        doc = _json_object(store, info.key) or {}
        if i is not None:
            i.owner = doc.get("owner") if isinstance(doc.get("owner"), str) else i.owner
            i.acquired_at = _parse_time(doc.get("acquired_at"))

    # lease.json: the current holder, and the owners its fence chain remembers.
    lease = _json_object(store, layout.lease_key(session_id, user_id))
    current = lease.get("epoch") if lease is not None and type(lease.get("epoch")) is int else None
    if current is not None:
        i = at(current)
        i.owner = i.owner or lease.get("owner")
        i.acquired_at = i.acquired_at or _parse_time(lease.get("acquired_at"))
        note = lease.get("note") if isinstance(lease.get("note"), dict) else {}
        for prev in note.get("prev") or []:
            if isinstance(prev, dict) and type(prev.get("epoch")) is int and isinstance(prev.get("owner"), str):
                j = at(prev["epoch"])
                j.owner = j.owner or prev["owner"]

    # Session status rows (the history, until a compaction keeps only the latest).
    _, sessions = store.index.read_prefix(layout.index_partition(layout.SESSION_INDEX, session_id, user_id),
                                          SESSION_SCHEMA, cache=False)
    status_rows = [r for r in sessions.to_pylist() if (r["session_id"], r["user_id"]) == (session_id, user_id)]
    for r in sorted(status_rows, key=lambda r: r["updated_at"]):
        i = at(r["epoch"])
        if i is None:
            continue
        i.touch(r["updated_at"], r["run_id"])
        i.node_id = i.node_id or r["node_id"]
        if i.status_at is None or r["updated_at"] >= i.status_at:
            i.status, i.status_at, i.error = r["status"], r["updated_at"], r["error"]

    # Run records: which run started in which epoch, and from where.
    records = store.list_runs(session_id, user_id=user_id)
    recorded = {(rec.epoch, rec.run_id) for rec in records}
    for rec in records:
        i = at(rec.epoch)
        if i is None:
            continue
        i.touch(rec.created_at, rec.run_id)
        i.causes.append(_run_cause(session_id, rec))

    # The journal: steps per epoch, and takeovers (a run continued by a later epoch than started it).
    for run_id in store.journal_runs(session_id, user_id=user_id):
        journal = store.journal_read(session_id, run_id, user_id=user_id)
        first_epoch: int | None = None
        for entry in journal.all:
            i = at(entry.epoch)
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

    # Live checkpoints: the turns each epoch wrote.
    ckpts = store.query(user_id=user_id, session_id=session_id, columns=["turn", "created_at", "epoch"])
    for r in ckpts.to_pylist():
        i = at(r["epoch"])
        if i is not None:
            i.touch(r["created_at"])
            i.turns.append(r["turn"])

    if not inc:
        raise CliError(f"unknown session {_who(session_id, user_id)} in {store.describe()} "
                       "(no lease, epoch marker, status row, run record, journal or checkpoint)")
    epochs = sorted(inc)
    for k, e in enumerate(epochs):
        i = inc[e]
        later = epochs[k + 1] if k + 1 < len(epochs) else None
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
        i.outcome = _outcome(i, later, current)
    return {"session_id": session_id, "user_id": user_id, "current_epoch": current,
            "lease_owner": lease.get("owner") if lease is not None else None,
            "incarnations": [inc[e].to_dict() for e in epochs]}


def _run_cause(session_id: str, rec: Any) -> str:
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


def timeline_table(data: dict[str, Any]) -> Any:
    """The incarnations as a rich table that fits the terminal (the cause column wraps)."""
    incs = data["incarnations"]
    times = time_cells([_parse_time(x["start"]) for x in incs] + [_parse_time(x["end"]) for x in incs])
    starts, ends = times[:len(incs)], times[len(incs):]
    rows = []
    for x, start, end in zip(incs, starts, ends, strict=False):
        what = x["cause"] or "-"
        outcome = Text(x["outcome"] or "-", style=_STATUS_STYLE.get(x["status"] or "", ""))
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
