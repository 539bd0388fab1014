"""The journal's invariants: replay uses no fenced entry, no step is billed or run twice, a fenced or blind
writer stops, a ``completed`` status row only after every step is durable (see :mod:`durability_checks`)."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from durability_history import _JOURNAL, BLIND_LIMIT, History, JEntry, Violation, _incs_by_epoch, _v


def _replay(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    by_stamp: dict[int, list[JEntry]] = defaultdict(list)
    for e in h.journal:
        if e.stamp is not None:
            by_stamp[e.stamp].append(e)
    for inc in world.incarnations:
        for pos, kind, _run_id, step, stamp in inc.replays:
            if kind == "model":
                entries = [e for e in by_stamp.get(stamp, []) if e.n <= pos]
                if not entries:
                    _v(out, "replay-fenced", f"{inc.id} replayed model step {step} (stamp {stamp}) at call {pos}, "
                                             f"but no journal entry with that answer was written before")
                elif not any(e.valid for e in entries):
                    e = entries[0]
                    _v(out, "replay-fenced", f"{inc.id} replayed model step {step} at call {pos} from the entry "
                                             f"{e.run_id}/{e.seq:08d}-{e.step_key} that {e.actor} wrote at epoch "
                                             f"{e.epoch} at call {e.n}, after epoch {h.max_epoch_before(e.n)} was taken")
            else:
                entries = [e for e in h.journal if e.step_key == step and e.kind == "tool" and e.n <= pos]
                if entries and not any(e.valid for e in entries):
                    e = entries[0]
                    _v(out, "replay-fenced", f"{inc.id} replayed tool step {step} at call {pos}; its only journal "
                                             f"entries were written by fenced writers ({e.actor} at epoch {e.epoch}, "
                                             f"call {e.n})")
    return out


def _target_run(world, inc) -> str | None:
    """The run an incarnation should continue: the run of the latest earlier writer incarnation that had one."""
    earlier = [i for i in world.incarnations if i.start < inc.start and i.run_id is not None and i is not inc]
    return max(earlier, key=lambda i: i.start).run_id if earlier else None


@dataclass
class Seal:
    """A seal entry as the call log shows it landing."""

    n: int
    run_id: str
    seq: int
    epoch: int
    excluded: frozenset[str]
    missing: tuple[tuple[int, int], ...]

    def fences(self, e: JEntry) -> bool:
        """True when this seal makes replay ignore ``e`` (the rule of ``storage.journal``, restated)."""
        return self.run_id == e.run_id and self.epoch > e.epoch and (
            e.seq >= self.seq or f"{e.seq:08d}-{e.step_key}" in self.excluded
            or any(lo <= e.seq <= hi for lo, hi in self.missing))


def _seals(h: History) -> list[Seal]:
    out = []
    for c in h.calls:
        m = _JOURNAL.match(c.key or "") if c.op == "put" and c.applied and c.data is not None else None
        if m is None:
            continue
        try:
            body = json.loads(c.data)
            if body.get("kind") != "seal":
                continue
            output = body.get("output") or {}
            missing = tuple((int(r[0]), int(r[1])) for r in output.get("missing") or ())
            out.append(Seal(c.n, m.group(3), int(m.group(4)), int(body.get("epoch") or 0),
                            frozenset(map(str, output.get("excluded") or ())), missing))
        except (ValueError, TypeError, IndexError, AttributeError):
            continue
    return out


def _last_listing(h: History, j, run_id: str) -> int | None:
    """The call at which takeover ``j`` last listed what could show an entry of ``run_id`` before its swap:
    the run's journal, else (a run it never listed) the session's run records."""
    found: dict[str, int] = {}
    for c in h.calls[j.start:j.acquired - 1]:
        if c.actor == j.actor and c.op in ("list", "list_dirs") and c.outcome == "ok" and c.key:
            if c.key.endswith(f"/journal/{run_id}/"):
                found["journal"] = c.n
            elif c.key.endswith("/runs/"):
                found["records"] = c.n
    return found.get("journal", found.get("records"))


def _writer_of(world, e: JEntry) -> Any:
    return next((i for i in world.incarnations if i.actor == e.actor and i.start < e.n
                 and (i.end is None or e.n <= i.end)), None)


def _ambiguous(world, h: History, e: JEntry, seals: list[Seal]) -> Any:
    """The takeover ``j`` whose listing window holds entry ``e``, if re-running ``e``'s step is excused.

    A taking-over writer lists the journal right before its lease swap and
    seals above what it listed: it cannot tell an entry written between that
    listing and its swap (by a writer that still held the lease) from one a
    zombie wrote after the swap, so it fences both. Re-running such a step is
    the price of not reading the lease per step, not a violation, but only
    when all of this holds:

    - ``e`` was written by a writer that was not fenced then (``e.valid``), of
      an epoch below ``j``'s, after ``j``'s last listing that could have shown
      it and before ``j``'s swap;
    - that writer was alive inside the window (it wrote ``e`` after ``j``'s
      listing, a takeover of a live owner, whether it then learned of ``j``'s
      claim, crashed or kept going); a writer that crashed before the listing
      wrote nothing inside the window;
    - a seal of ``j``'s epoch (``j``'s own, or one a later owner wrote for it
      from the lease note) really fences ``e``.
    """
    if not e.valid:
        return None
    writer = _writer_of(world, e)
    if writer is None:
        return None
    for j in world.incarnations:
        acquired = j.acquired
        if acquired is None or j is writer or j.actor == e.actor or not (e.epoch < (j.epoch or 0) and e.n < acquired):
            continue
        listed = _last_listing(h, j, e.run_id)
        if listed is None or not listed < e.n:
            continue
        if any(s.epoch == j.epoch and s.fences(e) for s in seals):
            return j
    return None


def _billing(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    _incs_by_epoch(world, h)
    world.excused = []
    seals = _seals(h)
    for inc in world.incarnations:
        seen_model: dict[int, int] = {}
        for pos, turn, _stamp in inc.model_calls:
            if turn in seen_model:
                _v(out, "rebilled-model", f"{inc.id} called the model twice for turn {turn} (calls {seen_model[turn]}"
                                          f" and {pos})")
            seen_model[turn] = pos
        target = _target_run(world, inc)
        if target is None:
            continue
        acquired = inc.acquired or inc.start
        if any(e.run_id == target and e.kind == "run_end" and e.valid and e.n < acquired for e in h.journal):
            continue  # that run had finished before this writer took the session: this is a new run
        entries = [e for e in h.journal if e.run_id == target and e.n <= inc.start]
        journaled = {e.step_key: e for e in entries if e.valid and e.kind in ("model", "tool")}
        for pos, turn, _stamp in inc.model_calls:
            e = journaled.get(f"t{turn:04d}-model")
            j = _ambiguous(world, h, e, seals) if e is not None else None
            if j is not None:
                world.excused.append(f"{inc.id} model turn {turn}: entry at call {e.n} by live zombie {e.actor} "
                                     f"fenced by {j.id}'s takeover window (listing .. swap at call {j.acquired})")
            elif e is not None:
                _v(out, "rebilled-model", f"{inc.id} ({inc.kind}, started after call {inc.start}) called the model for "
                                          f"turn {turn} at call {pos}; run {target} had journaled that step "
                                          f"(seq {e.seq}, {e.actor}, epoch {e.epoch}, call {e.n})")
        for pos, _run_id, step, n in inc.tool_runs:
            e = journaled.get(step)
            j = _ambiguous(world, h, e, seals) if e is not None else None
            if j is not None:
                world.excused.append(f"{inc.id} tool {step}: entry at call {e.n} by live zombie {e.actor} "
                                     f"fenced by {j.id}'s takeover window (listing .. swap at call {j.acquired})")
            elif e is not None:
                _v(out, "rerun-tool", f"{inc.id} ({inc.kind}, started after call {inc.start}) ran tool step {step} "
                                      f"(effect {n}) again at call {pos}; run {target} had journaled it (seq {e.seq}, "
                                      f"{e.actor}, epoch {e.epoch}, call {e.n})")
    return out


def _fenced_work(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    _incs_by_epoch(world, h)
    for inc in world.incarnations:
        epoch = inc.epoch
        if epoch is None:
            continue
        end = inc.end if inc.end is not None else 10**12
        learned = next((c.n for c in h.calls if c.actor == inc.actor and inc.start < c.n <= end and c.op == "get"
                        and c.key is not None and c.key.endswith("/lease.json") and c.outcome == "ok"
                        and h.max_epoch_before(c.n) > epoch), None)
        if learned is None:
            continue
        late = [(p, f"model turn {t}") for p, t, _ in inc.model_calls if p > learned]
        late += [(p, f"tool {s}") for p, _, s, _ in inc.tool_runs if p > learned]
        if late:
            _v(out, "fenced-continued", f"{inc.id} (epoch {epoch}) read at call {learned} a lease of epoch "
                                        f"{h.max_epoch_before(learned)}, then still ran "
                                        + ", ".join(f"{w} at call {p}" for p, w in late))
    return out


def _blind(world, h: History, final) -> list[Violation]:
    out: list[Violation] = []
    for inc in world.incarnations:
        end = inc.end if inc.end is not None else 10**12
        mine = [c for c in h.calls if c.actor == inc.actor and inc.start < c.n <= end and c.key is not None
                and ((c.op == "get" and c.key.endswith("/lease.json"))
                     or (c.op == "put" and ("/journal/" in c.key or "/checkpoints/" in c.key
                                            or c.key.startswith("index/checkpoints/"))))]
        for pos, _, step, _ in inc.tool_runs:
            streak = 0
            for c in mine:
                if c.n > pos:
                    break
                streak = streak + 1 if c.outcome in ("failed", "dropped", "error") else 0
            if streak >= BLIND_LIMIT:
                _v(out, "ran-blind", f"{inc.id} ran tool step {step} at call {pos} after {streak} consecutive failed "
                                     f"lease reads / durable writes")
    return out


def _status(world, h: History, final) -> list[Violation]:
    """A 'completed' status row only after every step the run executed is durable (journal or checkpoint)."""
    out: list[Violation] = []
    for n, actor, row in h.session_rows:
        if row.get("status") != "completed":
            continue
        inc = next((i for i in world.incarnations if i.actor == actor and i.start < n
                    and (i.end is None or n <= i.end)), None)
        if inc is None:
            continue
        covered = max((r.turn for r in h.rows.values() if r.valid and r.actor == actor and inc.start < r.n < n
                       and r.key in h.obj_puts), default=-1)
        journaled = {e.step_key for e in h.journal if e.valid and e.actor == actor and inc.start < e.n < n
                     and e.run_id == inc.run_id}
        steps = [(t, f"t{t:04d}-model") for _, t, _ in inc.model_calls if _ < n]
        steps += [(int(step[1:5]), step) for p, _, step, _ in inc.tool_runs if p < n]
        lost = [step for t, step in steps if t >= covered and step not in journaled]
        if lost:
            _v(out, "status-durable", f"{inc.id} wrote session status 'completed' at call {n}, but steps {lost} "
                                      f"are in no durable journal entry or checkpoint of it")
    return out


