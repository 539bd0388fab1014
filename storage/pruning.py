"""Prune: delete checkpoints, journal entries and run records matching every given filter, and nothing else.

(And the explorations of the sessions in scope that are over: :mod:`storage.prune_explorations`.)
With ``before``, what recovery of an unfinished last run needs stays, and
so do the run records the last run is chosen among, stripped of their
request (docs/contracts.md ``prune``). One planner chooses what goes, for a
dry run (:func:`plan_prune`) and for :func:`prune`, which plans each session
right before it deletes. How prune stays safe against a run that starts
meanwhile: docs/design.md "Checkpoints: incremental objects in chains".
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import chains, layout
from .heads import last_run_unfinished, writer_heads
from .ids import user_from_segment, user_segment, validate_id
from .journal import RUN_END, last_run_window, load_entries, unfinished_last_run
from .journal.runs import drop_request, requests_held
from .prune_explorations import ExplorationsPlan, delete_explorations, plan_explorations
from .prune_objects import put_back, read_objects, restore_entry
from .rows import CheckpointRow, JournalEntry, PruneReport, RunRecord, as_utc

if TYPE_CHECKING:
    from .store import Store

log = logging.getLogger("storage")
#: ``(user_id, session_id)``.
SessionKey = tuple[str | None, str]
#: Wraps each pass over the sessions in scope: ``progress(sessions, label)`` yields them (e.g. reporting
#: ``label i/n`` as it goes); labels are "recovery needs of session" and "session".
Progress = Callable[[Sequence[SessionKey], str], Iterable[SessionKey]]


@dataclass(frozen=True)
class SessionPrunePlan:
    """What prune deletes of one session.

    ``retired``: the live index rows it retires (object and row), by
    ``(turn, checkpoint_id)``; ``orphan_keys``: checkpoint objects without a
    live row (only without ``before``); ``journal_keys`` and
    ``run_record_keys``: the objects it deletes; ``kept_for_recovery``: live
    checkpoint ids spared because recovering the unfinished last run needs
    them. ``live`` and ``entries`` (the journal entries read, with ``before``)
    are what prune checks its second look against and puts back from.
    """

    user_id: str | None
    session_id: str
    retired: tuple[CheckpointRow, ...]
    orphan_keys: tuple[str, ...]
    journal_keys: tuple[str, ...]
    run_record_keys: tuple[str, ...]
    kept_for_recovery: tuple[str, ...]
    live: tuple[CheckpointRow, ...] = ()
    entries: Mapping[str, JournalEntry] = field(default_factory=dict)
    #: The checkpoint objects deleted: the retired rows', their chains' and the orphans', less what a kept
    #: row's chain or another session's pin still needs (those stay until nothing needs them).
    object_keys: tuple[str, ...] = ()
    #: Run records that stay (the last run is chosen among them) but lose their request and its hash: the
    #: records of matching runs that recovery does not need (:func:`storage.journal.runs.drop_request`).
    request_keys: tuple[str, ...] = ()
    #: The records of the session's explorations that are over (:mod:`storage.prune_explorations`).
    explorations: ExplorationsPlan = ExplorationsPlan()
    #: The rows the session's running writer builds on next (:func:`storage.heads.writer_heads`): their objects
    #: stay, and without ``before`` (which deletes the run's records) a writer pin holds them from then on.
    heads: tuple[CheckpointRow, ...] = ()
    #: The session's writer pin goes: its run has finished.
    drop_writer_pin: bool = False

    @property
    def checkpoints(self) -> int:
        """Checkpoints deleted: the retired rows and the orphans."""
        return len({r.key for r in self.retired}) + len(self.orphan_keys)

    @property
    def journal_entries(self) -> int:
        return len(self.journal_keys)

    @property
    def run_records(self) -> int:
        return len(self.run_record_keys)

    def summary(self) -> dict[str, Any]:
        """The counts and ids (JSON-ready) a dry run shows."""
        return {"session_id": self.session_id, "user_id": self.user_id, "checkpoints": self.checkpoints,
                "journal_entries": self.journal_entries, "run_records": self.run_records,
                "checkpoint_ids": [r.checkpoint_id for r in self.retired],
                "kept_for_recovery": list(self.kept_for_recovery), "explorations": list(self.explorations.deleted)}


@dataclass(frozen=True)
class PrunePlan:
    """What ``prune(before, session_id, user_id)`` deletes, session by session (``Store.plan_prune``)."""

    before: datetime | None
    session_id: str | None
    user_id: str | None
    sessions: tuple[SessionPrunePlan, ...]

    @property
    def checkpoints(self) -> int:
        return sum(s.checkpoints for s in self.sessions)

    @property
    def journal_entries(self) -> int:
        return sum(s.journal_entries for s in self.sessions)

    @property
    def run_records(self) -> int:
        return sum(s.run_records for s in self.sessions)

    @property
    def explorations(self) -> int:
        return sum(len(s.explorations.deleted) for s in self.sessions)

    def summary(self) -> dict[str, Any]:
        """The filters, the totals and every session's :meth:`SessionPrunePlan.summary`, JSON-ready but for
        ``before`` (a datetime)."""
        return {"before": self.before, "session_id": self.session_id, "user_id": self.user_id,
                "checkpoints": self.checkpoints, "journal_entries": self.journal_entries,
                "run_records": self.run_records, "explorations": self.explorations,
                "sessions": [s.summary() for s in self.sessions]}


def _scope(store: Store, session_id: str | None, user_id: str | None) -> list[SessionKey]:
    if session_id is not None:
        validate_id(session_id, "session_id")  # even when no session exists to match
    users = [user_segment(user_id)] if user_id is not None else store.objects.list_dirs(prefix="sessions/")
    out = []
    for seg in users:
        if session_id is not None:
            out.append((user_from_segment(seg), validate_id(session_id, "session_id")))
        else:
            out.extend((user_from_segment(seg), s) for s in store.objects.list_dirs(prefix=f"sessions/{seg}/"))
    return out


def _unwrapped(sessions: Sequence[SessionKey], label: str) -> Iterable[SessionKey]:
    return sessions


@dataclass
class _Needs:
    """What recovering unfinished last runs needs: run ids whose journal and record stay, per session; the
    ``(user, session, checkpoint)`` they start from; and, per session, the sessions whose run forks from it."""

    runs: dict[SessionKey, set[str]] = field(default_factory=dict)
    checkpoints: set[tuple[str | None, str, str]] = field(default_factory=set)
    forks: dict[SessionKey, list[SessionKey]] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def of(cls, store: Store, sessions: Iterable[SessionKey]) -> _Needs:
        needs = cls()
        for uid, sid in sessions:
            last = unfinished_last_run(store, sid, uid)
            if last is None:
                continue
            needs.runs[(uid, sid)] = {r for r in (last.run_id, last.replay_from) if r}
            if last.base_checkpoint_id and last.base_session_id:
                needs.checkpoints.add((uid, last.base_session_id, last.base_checkpoint_id))
                if last.base_session_id != sid:
                    needs.forks[(uid, last.base_session_id)].append((uid, sid))
        return needs

    def spared(self, uid: str | None, sid: str, rows: Iterable[CheckpointRow]) -> set[str]:
        """Checkpoint ids of ``rows`` (session ``sid``'s) recovery needs: bases, and the latest when unfinished."""
        spared = {cid for u, s, cid in self.checkpoints if (u, s) == (uid, sid)}
        rows = list(rows)
        if (uid, sid) in self.runs and rows:
            # An unfinished run resumes from the session's latest checkpoint (the newest it wrote).
            spared.add(max(rows, key=lambda r: r.order).checkpoint_id)
        return spared


class _Planner:
    """Chooses what prune deletes: the sessions in scope and, with a cutoff, what recovery needs (read once)."""

    def __init__(self, store: Store, before: datetime | None, session_id: str | None, user_id: str | None,
                 progress: Progress = _unwrapped) -> None:
        self.store = store
        self.cutoff = as_utc(before) if before is not None else None
        self.scope = _scope(store, session_id, user_id)
        self.needs = _Needs()
        if self.cutoff is not None:
            self.needs = _Needs.of(store, progress(self.scope, "recovery needs of session"))

    def plan(self, uid: str | None, sid: str) -> SessionPrunePlan:
        """What prune deletes of session ``sid`` now."""
        store, cutoff = self.store, self.cutoff
        snap = store.checkpoints.snapshot(sid, user_id=uid)
        live = tuple(snap.rows.values())  # fenced rows too: prune retires them with the rest
        spared = self.needs.spared(uid, sid, snap.live.values())  # "latest" is what readers see (visibility)
        retired = sorted((r for r in live if (cutoff is None or r.created_at < cutoff)
                          and r.checkpoint_id not in spared), key=lambda r: (r.turn, r.checkpoint_id))
        orphans: list[str] = []
        if cutoff is None:
            # Objects without an index row (written, row lost in a crash) go too when everything goes; a checkpoint
            # that landed after the snapshot is a running writer's newest, not an orphan.
            listed = {o.key for o in store.objects.list(prefix=layout.session_prefix(sid, uid) + "checkpoints/")}
            orphans = sorted(k for k in listed - {r.key for r in retired} if k in snap.present or not k.endswith(".json"))
        kept_runs = self.needs.runs.get((uid, sid), set())
        kept = tuple(layout.journal_prefix(sid, uid, r) for r in kept_runs)
        keys = [o.key for o in store.objects.list(prefix=layout.journal_prefix(sid, uid)) if not o.key.startswith(kept)]
        entries: dict[str, JournalEntry] = {}
        older: list[tuple[int, str]] = []
        bare: list[str] = []
        if cutoff is not None:
            last, older, window = last_run_window(store, sid, uid)
            bare = requests_held(store, window, sid, uid,
                                 lambda rec: rec.run_id not in kept_runs and as_utc(rec.created_at) < cutoff)
            last_id = last.run_id if last is not None else _legacy_last_run(store, sid, uid)
            entries = load_entries(store, keys)
            # The last run's run_end stays: without it a finished run would read as unfinished, and be run again.
            keys = [k for k in keys if k in entries and as_utc(entries[k].created_at) < cutoff
                    and not (entries[k].kind == RUN_END and entries[k].run_id == last_id)]
        records = _doomed_records(store, sid, uid, cutoff, older, kept_runs)
        # With a cutoff, whether the last run is unfinished was read once for every session in scope.
        unfinished = (uid, sid) in self.needs.runs if cutoff is not None else last_run_unfinished(store, sid, uid)
        heads = writer_heads(snap, unfinished)
        finished = cutoff is None and unfinished is False  # (with a cutoff, False may also mean "nothing tells")
        return SessionPrunePlan(uid, sid, tuple(retired), tuple(orphans), tuple(keys), tuple(records),
                                tuple(sorted(spared & {r.checkpoint_id for r in live})), live, entries,
                                _object_keys(store, uid, sid, live, retired, orphans, heads, finished),
                                tuple(bare), plan_explorations(store.objects, sid, uid, cutoff), tuple(heads),
                                finished)


def _object_keys(store: Store, uid: str | None, sid: str, live: Sequence[CheckpointRow],
                 retired: Sequence[CheckpointRow], orphans: Sequence[str],
                 heads: Sequence[CheckpointRow] = (), finished: bool = False) -> tuple[str, ...]:
    """The objects prune deletes with ``retired``: theirs, their chains' and ``orphans``, less what the rows that
    stay need, what a running writer may build on (``heads``, retired or not: :mod:`storage.chains`) and what
    pins hold (an unreadable pin keeps every object): other sessions', and the writer pin unless the last run
    ``finished``."""
    gone = {r.checkpoint_id for r in retired}
    kept = [*(r for r in live if r.checkpoint_id not in gone), *heads]
    candidates = chains.unneeded_keys(retired, kept, sid, uid, orphans)
    if candidates:
        pinned = chains.Pins(store.objects).pinned(sid, uid, but_writer=finished)
        candidates = set() if pinned is None else candidates - pinned
    return tuple(sorted(candidates))


def plan_prune(store: Store, *, before: datetime | None = None, session_id: str | None = None,
               user_id: str | None = None, progress: Progress | None = None) -> PrunePlan:
    """What :func:`prune` with these filters would delete, read without deleting anything.

    The same planner ``prune`` uses, so a dry run lists exactly what a prune
    started at the same moment would delete (a run that starts meanwhile can
    only make prune delete less). ``progress(sessions, label)`` wraps each
    pass over the sessions in scope (to report progress).
    """
    progress = progress or _unwrapped
    planner = _Planner(store, before, session_id, user_id, progress)
    sessions = tuple(planner.plan(uid, sid) for uid, sid in progress(planner.scope, "session"))
    return PrunePlan(planner.cutoff, session_id, user_id, sessions)


def prune(store: Store, *, before: datetime | None, session_id: str | None, user_id: str | None) -> PruneReport:
    """Delete checkpoints, journal entries and run records matching every given filter, tombstoning index rows.

    Each session is planned (:class:`SessionPrunePlan`) right before its
    deletes; see the module docstring for what stays and why a run started
    meanwhile never loses what it needs.
    """
    planner = _Planner(store, before, session_id, user_id)
    n_ckpt = n_journal = n_runs = n_explorations = 0
    for uid, sid in planner.scope:
        plan = planner.plan(uid, sid)
        n_explorations += delete_explorations(store.objects, plan.explorations)
        if planner.cutoff is None:
            _hold_for_writer(store, plan)
            store.checkpoints.retire(sid, list(plan.retired), user_id=uid, collect=False)  # tombstones, view
            if plan.object_keys:
                store.objects.delete(keys=list(plan.object_keys))
            if plan.drop_writer_pin:
                chains.drop_writer_pin(store._rows, sid, uid)
            store.checkpoints.release_pins(sid, list(plan.retired), user_id=uid)
            n_ckpt += plan.checkpoints
            _delete(store, plan.journal_keys, plan.run_record_keys)
            n_journal += plan.journal_entries
        else:
            checkpoints, journal_entries = _prune_keeping_recovery(store, planner, plan)
            n_ckpt += checkpoints
            n_journal += journal_entries
        n_runs += plan.run_records
    return PruneReport(checkpoints=n_ckpt, journal_entries=n_journal, run_records=n_runs,
                       explorations=n_explorations)


def _hold_for_writer(store: Store, plan: SessionPrunePlan) -> None:
    """Before a prune without ``before`` retires the heads of a run that goes on, and deletes its records: pin
    what they are read from for the session's writer, since nothing else will tell it is running."""
    if plan.heads and (plan.retired or plan.run_record_keys):
        chains.Pins(store.objects).write_writer(plan.session_id, plan.user_id, plan.heads)


def _delete(store: Store, journal_keys: Sequence[str], record_keys: Sequence[str]) -> None:
    if journal_keys:
        store.objects.delete(keys=list(journal_keys))
    if record_keys:
        store.objects.delete(keys=list(record_keys))


def _prune_keeping_recovery(store: Store, planner: _Planner, plan: SessionPrunePlan) -> tuple[int, int]:
    """Carry out ``plan`` (made with a cutoff): objects first, rows last, with what a run recorded meanwhile
    needs put back in between. ``(checkpoints, journal entries)`` deleted. A failure before the rows are
    retired puts back what was deleted, and raises."""
    doomed, keys = list(plan.retired), list(plan.journal_keys)
    held: dict[str, bytes] = {}
    if plan.object_keys:
        # Objects first, rows later (below): a run recorded meanwhile may need one back.
        held = read_objects(store, list(plan.object_keys))
        store.objects.delete(keys=list(plan.object_keys))
    try:
        _delete(store, keys, plan.run_record_keys)
        for key in plan.request_keys:  # kept records of finished runs: what decides the last run stays, no request
            drop_request(store, key)
        if not (doomed or keys):
            return 0, 0
        return _retire_what_no_run_needs(store, planner, plan, held)
    except BaseException:
        # The rows are not tombstoned yet: put back what was deleted, so no reader finds a listed checkpoint
        # without its object (prune, run again, deletes it for good).
        put_back(store, held, {k: plan.entries[k] for k in keys if k in plan.entries})
        raise


def _retire_what_no_run_needs(store: Store, planner: _Planner, plan: SessionPrunePlan,
                              held: Mapping[str, bytes]) -> tuple[int, int]:
    """After the deletes: put back what a run recorded meanwhile needs, tombstone the rest of the rows."""
    uid, sid = plan.user_id, plan.session_id
    doomed, keys = list(plan.retired), list(plan.journal_keys)
    # What recovery needs now, after the deletes: a run recorded since the first look gets back what it
    # names. (Deleted records are never among those the last run is chosen from: no record returns.)
    now = _Needs.of(store, [(uid, sid), *planner.needs.forks.get((uid, sid), ())])
    wanted = now.spared(uid, sid, plan.live)
    back = [r for r in doomed if r.checkpoint_id in wanted]
    for key in sorted(chains.needed_keys(back, sid) & set(held)):  # a wanted checkpoint needs its chain too
        store.objects.put(key=key, data=held[key])
    replayed = now.runs.get((uid, sid), set())
    restored = [k for k in keys if plan.entries[k].run_id in replayed]
    for key in restored:
        restore_entry(store, key, plan.entries[key])
    if back or restored:
        log.warning("prune of session %r put back %d checkpoint(s) and %d journal entr%s that a run started "
                    "meanwhile needs", sid, len(back), len(restored), "y" if len(restored) == 1 else "ies")
    doomed = [r for r in doomed if r not in back]
    store.checkpoints.retire(sid, doomed, user_id=uid, collect=False)  # tombstones (and the view); objects gone
    store.checkpoints.release_pins(sid, doomed, user_id=uid)
    return len(doomed), len(set(keys) - set(restored))


def _legacy_last_run(store: Store, sid: str, uid: str | None) -> str | None:
    """The last run of a session without run records: its last journal run id in sorted order."""
    runs = store.objects.list_dirs(prefix=layout.journal_prefix(sid, uid))
    return runs[-1] if runs else None


def _doomed_records(store: Store, sid: str, uid: str | None, cutoff: datetime | None,
                    older: list[tuple[int, str]], kept_runs: set[str]) -> list[str]:
    """Run record keys prune deletes: all without a cutoff; else the ``older`` ones (not among those the last run
    is chosen from: the newest also anchors the next slot number) past the cutoff, sparing kept runs."""
    if cutoff is None:
        return sorted(o.key for o in store.objects.list(prefix=layout.run_prefix(sid, uid)))
    doomed = []
    for _, rec_key in older:
        obj = store.objects.get(key=rec_key)
        if obj is None:
            continue
        try:
            rec = RunRecord.model_validate_json(obj.data)
        except ValueError:
            continue  # unreadable: not ours to judge by age; readers skip it
        if rec.run_id not in kept_runs and as_utc(rec.created_at) < cutoff:
            doomed.append(rec_key)
    return doomed
