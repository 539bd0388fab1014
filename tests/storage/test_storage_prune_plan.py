"""``plan_prune``: what a dry run shows is what ``prune`` deletes, and planning deletes nothing."""

from __future__ import annotations

from datetime import timedelta

import pyarrow as pa

from loomray.storage import CheckpointInfo, JournalEntry, PrunePlan, Store
from loomray.storage.rows import CHECKPOINT_SCHEMA, CheckpointRow
from loomray.storage.testing import T0, put_checkpoint


def _history(store: Store) -> None:
    for u in (None, "alice"):
        for s in ("s1", "s2"):
            for i in range(4):
                put_checkpoint(store, s, f"c{i}", user_id=u, turn=i, keep=0)
            for seq, minutes in enumerate((0, 90)):
                store.journal.append(JournalEntry(session_id=s, user_id=u, run_id="r", seq=seq, step_key=f"k{seq}",
                                                  kind="model", created_at=T0 + timedelta(minutes=minutes)))
    store.objects.put(key="sessions/_/s1/checkpoints/orphan.json", data=b"{}")  # its index row was lost


def _snapshot(store: Store) -> dict[str, bytes]:
    return {o.key: store.objects.get(key=o.key).data for o in store.objects.list(prefix="")}


def test_a_dry_run_lists_exactly_what_prune_then_deletes(store):
    _history(store)
    for before, session_id, user_id in [(T0 + timedelta(minutes=2), "s1", None), (None, None, "alice"),
                                        (None, None, None)]:
        before_plan = _snapshot(store)
        plan = store.plan_prune(before, session_id, user_id)
        assert isinstance(plan, PrunePlan) and _snapshot(store) == before_plan  # planning deletes nothing
        report = store.prune(before=before, session_id=session_id, user_id=user_id)
        assert (plan.checkpoints, plan.journal_entries, plan.run_records) == (
            report.checkpoints, report.journal_entries, report.run_records)
        gone = set(before_plan) - set(_snapshot(store))
        planned = {k for s in plan.sessions for k in (*s.object_keys, *s.journal_keys, *s.run_record_keys)}
        assert {r.key for s in plan.sessions for r in s.retired} | {k for s in plan.sessions for k in s.orphan_keys} \
            == {k for s in plan.sessions for k in s.object_keys}  # no chain here: every retired object goes
        assert {k for k in gone if not k.startswith("index/")} == planned


def test_the_plan_summary_names_sessions_checkpoints_and_what_recovery_keeps(store):
    for i in range(3):
        put_checkpoint(store, "s1", f"c{i}", turn=i)
    store.runs.create("s1", run_id="run-1", epoch=0)
    store.journal.append(JournalEntry(session_id="s1", run_id="run-1", seq=0, step_key="start", kind="run_start",
                                      created_at=T0))
    seen = []
    plan = store.plan_prune(T0 + timedelta(hours=1), progress=lambda items, label: seen.append(label) or items)
    assert seen == ["recovery needs of session", "session"]
    (s1,) = plan.summary()["sessions"]
    # The unfinished run resumes from the latest checkpoint: it stays; the older two go.
    assert s1 == {"session_id": "s1", "user_id": None, "checkpoints": 2, "journal_entries": 0, "run_records": 0,
                  "checkpoint_ids": ["c0", "c1"], "kept_for_recovery": ["c2"], "explorations": []}
    assert plan.summary()["checkpoints"] == 2


def test_the_checkpoint_schema_is_the_row_fields_then_tombstone_and_written_at():
    names = [f for f in CheckpointRow.__dataclass_fields__]
    assert CHECKPOINT_SCHEMA.names == [*names, "tombstone", "written_at", "tomb_epoch", "tomb_mark"]
    assert set(CheckpointInfo.__dataclass_fields__) == set(names) - {"epoch", "key", "size", "sha256"}
    assert CHECKPOINT_SCHEMA.field("spend_usd").type == pa.float64()
    assert CHECKPOINT_SCHEMA.names[10:13] == ["cost_usd", "spend_usd", "parent_checkpoint_id"]  # as files have it
