"""What ``loomray tree`` shows: a session's forks, their forks, and so on (how each fact is read: docs/api.md,
"Command line"), as a terminal table, a JSON document or a self-contained HTML page.

Branches of an exploration carry its marks: round, score, stop reason, a star on the winner
(:mod:`loomray.cli.explore_view`).
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from loomray.cli.common import STATUS_STYLE, unknown_session
from loomray.cli.explore_view import branch_marks
from loomray.cli.output import iso_time, money
from loomray.cli.tables import Col, fit_table
from loomray.storage import Store
from loomray.variants import describe_variant

_CKPT_COLUMNS = ["session_id", "checkpoint_id", "turn", "created_at", "cost_usd", "parent_checkpoint_id",
                 "forked_from", "execution_status", "epoch"]



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
    #: The stored form of the variant the fork runs (:meth:`loomray.Variant.to_json`); None: no variant.
    variant: dict[str, Any] | None = None
    children: list[ForkNode] = field(default_factory=list)
    #: As a branch of an exploration: its exploration id, round, score, stop reason, and whether it won.
    exploration: dict[str, Any] | None = None

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
                "variant": self.variant, "exploration": self.exploration,
                "children": [c.to_dict() for c in self.children]}

    @property
    def variant_summary(self) -> str:
        """What the fork's variant changed, in one line ("-": not a fork of a variant)."""
        return "-" if self.variant is None else variant_line(self.variant)

    def mark(self) -> tuple[str, str]:
        """The exploration's score (a star on the winner) and stop reason of this branch; dashes when none."""
        x = self.exploration
        if x is None:
            return "-", "-"
        score = "-" if x["score"] is None else f"{x['score']:g}"
        return ("★ " if x["winner"] else "") + score, x["stop_reason"] or "running"


def _latest(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A session's newest checkpoint row: highest lease epoch, then highest (time-ordered) checkpoint id."""
    return max(rows, key=lambda r: (r["epoch"], r["checkpoint_id"]))


def _forked_from(rows: list[dict[str, Any]], session_id: str) -> str | None:
    """The session ``session_id`` was forked from, as its checkpoint rows name it (its latest row's, if any)."""
    parents = {r["forked_from"] for r in rows if r["forked_from"] and r["forked_from"] != session_id}
    if not parents:
        return None
    latest = _latest(rows)["forked_from"]
    return latest if latest in parents else sorted(parents)[0]


def fork_tree(store: Store, session_id: str, user_id: str | None) -> ForkNode:
    """The fork tree rooted at ``session_id`` (forks of forks included), from one scan of the user's index."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in store.query(user_id=user_id, columns=_CKPT_COLUMNS).to_pylist():
        rows[r["session_id"]].append(r)
    status_rows = {r.session_id: r for r in store.sessions.list(user_id=user_id)}
    if session_id not in rows and session_id not in status_rows:
        raise unknown_session(store, session_id, user_id)
    parent_of = {sid: _forked_from(mine, sid) for sid, mine in rows.items()}
    children: dict[str, list[str]] = defaultdict(list)
    for sid, parent in parent_of.items():
        if parent is not None:
            children[parent].append(sid)
    records = _fork_records(store, user_id, session_id, children, parent_of)

    def node(sid: str) -> ForkNode:
        mine = rows.get(sid, [])
        n = ForkNode(sid, user_id, forked_from=parent_of.get(sid))
        if mine:
            latest = _latest(mine)
            n.turns, n.cost_usd = latest["turn"], latest["cost_usd"]
            n.latest_checkpoint_id, n.status = latest["checkpoint_id"], latest["execution_status"]
            n.first_checkpoint_at = min(r["created_at"] for r in mine)
        row = status_rows.get(sid)
        if row is not None:
            n.status, n.updated_at = row.status, row.updated_at
        if n.forked_from is not None:
            n.variant = fork_variant(records.get(sid, []))
            _fill_base(store, n, n.forked_from, mine, rows.get(n.forked_from, []), records.get(sid, []))
        return n

    seen: set[str] = set()

    def build(sid: str) -> ForkNode:
        seen.add(sid)
        n = node(sid)
        kids = [build(c) for c in children.get(sid, []) if c not in seen]
        never = datetime.max.replace(tzinfo=timezone.utc)
        n.children = sorted(kids, key=lambda k: (k.first_checkpoint_at or never, k.session_id))
        return n

    root = build(session_id)
    marks = branch_marks(store, [n.session_id for n in root.walk() if n.children], user_id)
    for n in root.walk():
        n.exploration = marks.get(n.session_id)
    return root


def _fork_records(store: Store, user_id: str | None, root: str, children: dict[str, list[str]],
                  parent_of: dict[str, str | None]) -> dict[str, list[Any]]:
    """The run records of every fork in the tree under ``root`` (their variants, and bases the index lost), read
    in parallel: on S3, a tree of many forks would otherwise wait for one LIST and its GETs after another."""
    subtree, todo = set(), [root]
    while todo:
        sid = todo.pop()
        if sid not in subtree:
            subtree.add(sid)
            todo += children.get(sid, [])
    forks = sorted(s for s in subtree if parent_of.get(s) is not None)
    if not forks:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(forks))) as pool:
        return dict(zip(forks, pool.map(lambda s: run_records(store, s, user_id), forks), strict=True))


def run_records(store: Store, session_id: str, user_id: str | None) -> list[Any]:
    """The session's run records, oldest first; none when they cannot be read (a view leaves that part unknown)."""
    try:
        return list(store.runs.list(session_id, user_id=user_id))
    except Exception:  # noqa: BLE001 - a view: an unreadable record only leaves the base and variant unknown
        return []


def fork_variant(records: list[Any]) -> dict[str, Any] | None:
    """The stored variant a fork runs: its first run's request names it (None: not a fork of a variant)."""
    for rec in records:
        variant = (rec.request or {}).get("variant")
        if isinstance(variant, dict):
            return variant
    return None


def variant_line(variant: dict[str, Any]) -> str:
    """A stored variant in one line (:func:`loomray.variants.describe_variant`), whatever the store holds."""
    try:
        return describe_variant(variant)
    except Exception:  # noqa: BLE001 - the store's bytes, shown: an unreadable one says so rather than failing
        return "(unreadable variant)"


def _fill_base(store: Store, n: ForkNode, parent: str, mine: list[dict[str, Any]],
               parent_rows: list[dict[str, Any]], records: list[Any]) -> None:
    """The fork's base checkpoint (its id, turn and the cost it carried), from the index, else the stored objects."""
    by_id = {r["checkpoint_id"]: r for r in parent_rows}
    base = next((r["parent_checkpoint_id"] for r in sorted(mine, key=lambda r: (r["turn"], r["created_at"]))
                 if r["parent_checkpoint_id"] in by_id), None)
    if base is None:
        base = next((rec.base_checkpoint_id for rec in records
                     if rec.base_session_id == parent and rec.base_checkpoint_id), None)
    n.parent_checkpoint_id = base
    if base is None:
        return
    if base in by_id:
        n.base_turn, n.carried_cost_usd = by_id[base]["turn"], by_id[base]["cost_usd"]
        return
    try:  # the row went (retention), the object may not have
        raw = store.checkpoints.get(parent, base, user_id=n.user_id)
    except Exception:  # noqa: BLE001
        raw = None
    if raw is not None:
        try:
            doc = json.loads(raw)
            n.base_turn = doc.get("index", doc).get("turn")  # an incremental object carries its row first
            n.carried_cost_usd = (doc.get("cumulative_usage") or {}).get("cost_usd")
        except (ValueError, AttributeError):
            pass


def tree_json(root: ForkNode) -> dict[str, Any]:
    """The tree as ``loomray tree --json`` prints it: the whole tree, and its total own spend."""
    nodes = root.walk()
    spends = [n.own_spend_usd for n in nodes]
    return {"session_id": root.session_id, "user_id": root.user_id, "sessions": len(nodes),
            "spend_usd": sum(s for s in spends if s is not None), "spend_complete": None not in spends,
            "tree": root.to_dict()}


def _own_spend(n: ForkNode) -> str:
    """A session's own spend as money; ``?`` when its cost is known but what its base carried is not."""
    return money(n.own_spend_usd) if n.own_spend_usd is not None or n.cost_usd is None else "?"


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


def tree_table(root: ForkNode) -> tuple[Table, str]:
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
            "status": Text(n.status or "-", style=STATUS_STYLE.get(n.status or "", "")),
            "spend": _own_spend(n),
            "variant": n.variant_summary,
            "score": n.mark()[0], "stop": n.mark()[1],
        })
    cols = [Col("session"), Col("from", "parent checkpoint", drop=4), Col("turns", justify="right"),
            Col("status"), Col("spend", "own spend", drop=1, justify="right")]
    if any(n.exploration for _, n in lines):
        cols += [Col("score", justify="right", drop=2), Col("stop", "explore stop", drop=3)]
    if any(n.variant is not None for _, n in lines):  # a tree without variants keeps its columns
        cols.append(Col("variant", drop=5, wrap=True))
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
                 ("own spend", _own_spend(n)),
                 ("total cost", money(n.cost_usd))] + ([("variant", n.variant_summary)] if n.variant else [])
        if n.exploration is not None:
            facts += [("score", n.mark()[0]), ("explore stop", n.mark()[1])]
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
