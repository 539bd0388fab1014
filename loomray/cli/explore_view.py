"""What the command line shows of explorations: the stored record, as a table, as marks on a fork tree, as
columns of ``loomray query``.

Everything is read from the exploration's record in the store
(:mod:`loomray.explore.record`) and summed up by the same function the
driver uses (:func:`loomray.explore.summary.summarize`), so the command
line, the tree and the result ``Agent.explore`` returned agree.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from loomray.cli.common import CliError
from loomray.cli.output import money
from loomray.cli.tables import Col, fit_table
from loomray.explore.record import ExplorationRecord, find_exploration
from loomray.explore.summary import summarize
from loomray.explore.types import Exploration
from loomray.storage import Store, layout


def load_exploration(store: Store, exploration_id: str, user_id: str | None) -> Exploration:
    """The exploration ``exploration_id`` of ``user_id`` as its record stands; ``CliError`` when there is none."""
    session_id = find_exploration(store.objects, exploration_id, user_id)
    if session_id is None:
        raise CliError(f"no exploration {exploration_id!r} (user {user_id!r}) in {store.describe()}")
    return read_exploration(store, session_id, user_id, exploration_id)


def read_exploration(store: Store, session_id: str, user_id: str | None, exploration_id: str) -> Exploration:
    """One exploration of ``session_id`` from its record."""
    docs = ExplorationRecord(store.objects, session_id, user_id, exploration_id).load()
    return summarize(docs, exploration_id, session_id)


def explorations_of(store: Store, session_id: str, user_id: str | None) -> list[Exploration]:
    """Every exploration run from ``session_id``, oldest first (ids are time-ordered)."""
    prefix = layout.session_prefix(session_id, user_id) + "explorations/"
    ids = [d.rstrip("/") for d in store.objects.list_dirs(prefix=prefix)]
    return [read_exploration(store, session_id, user_id, xid) for xid in sorted(ids)]


def branch_marks(store: Store, session_ids: list[str], user_id: str | None) -> dict[str, dict[str, Any]]:
    """For every branch of an exploration run from one of ``session_ids``: its exploration, round, score, stop
    reason, and whether it won."""
    marks: dict[str, dict[str, Any]] = {}
    for sid in session_ids:
        for x in explorations_of(store, sid, user_id):
            for b in x.branches:
                marks[b.session_id] = {"exploration_id": x.exploration_id, "round": b.round, "score": b.score,
                                       "stop_reason": b.stop_reason, "winner": b.session_id == x.winner}
    return marks


def exploration_dict(x: Exploration) -> dict[str, Any]:
    """An exploration as ``--json`` prints it."""
    return {"exploration_id": x.exploration_id, "session_id": x.session_id, "winner": x.winner,
            "stop_reason": x.stop_reason, "rounds_run": x.rounds_run, "spend_usd": x.spend_usd,
            "saved_usd": x.saved_usd, "adopted_checkpoint_id": x.adopted_checkpoint_id,
            "branches": [{"session_id": b.session_id, "round": b.round, "parent": b.parent,
                          "prompt": b.variant.prompt, "score": b.score, "reasons": b.reasons,
                          "stop_reason": b.stop_reason, "spend_usd": b.spend_usd,
                          "judge_spend_usd": b.judge_spend_usd, "turns": b.turns} for b in x.branches]}


def exploration_table(x: Exploration) -> tuple[Any, str]:
    """The branches as a table that fits the terminal, and a one-line summary."""
    rows = [{"session": ("★ " if b.session_id == x.winner else "") + b.session_id, "round": str(b.round),
             "score": "-" if b.score is None else f"{b.score:g}", "stop": b.stop_reason or "running",
             "spend": money(b.spend_usd), "turns": str(b.turns), "prompt": (b.variant.prompt or "")[:60]}
            for b in x.branches]
    cols = [Col("session"), Col("round", justify="right"), Col("score", justify="right"), Col("stop"),
            Col("spend", justify="right", drop=1), Col("turns", justify="right", drop=2),
            Col("prompt", wrap=True, drop=3, min_wrap=12)]
    table = fit_table(cols, rows, title=f"exploration {x.exploration_id} of {x.session_id}")
    summary = (f"{x.stop_reason}: winner {x.winner or '-'}, {len(x.branches)} branches in {x.rounds_run} rounds, "
               f"spend {money(x.spend_usd)}, early stopping saved ~{money(x.saved_usd)}"
               + (f"; adopted as checkpoint {x.adopted_checkpoint_id}" if x.adopted_checkpoint_id else ""))
    return table, summary


def with_branch_columns(table: pa.Table, x: Exploration, min_score: float | None) -> pa.Table:
    """The checkpoint rows of ``x``'s branches, with the branch's exploration id, round, score and stop reason."""
    branches = {b.session_id: b for b in x.branches
                if min_score is None or (b.score is not None and b.score >= min_score)}
    table = table.filter(pc.is_in(table["session_id"], value_set=pa.array(sorted(branches), pa.string())))
    sids = table["session_id"].to_pylist()
    return (table.append_column("exploration_id", pa.array([x.exploration_id] * len(sids), pa.string()))
            .append_column("round", pa.array([branches[s].round for s in sids], pa.int64()))
            .append_column("score", pa.array([branches[s].score for s in sids], pa.float64()))
            .append_column("branch_stop", pa.array([branches[s].stop_reason for s in sids], pa.string())))
