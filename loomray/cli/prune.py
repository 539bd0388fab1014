"""``loomray prune``: delete old checkpoints, journal entries and run records, after a dry run or a question.

What ``--dry-run`` lists is what ``Store.prune`` with the same filters would
delete: it asks the store's own planner.
"""

from __future__ import annotations

import sys
from datetime import datetime

import click

from loomray.cli.common import (
    TIME_HELP,
    CliError,
    check_id,
    console,
    err_console,
    guarded,
    json_option,
    open_store_or_fail,
    parse_time,
    store_option,
)
from loomray.cli.output import count, emit_json, row_dict
from loomray.cli.progress import Activity, iter_progress, progress_option, stdin_is_tty
from loomray.cli.tables import Col, fit_table
from loomray.storage import Store
from loomray.storage.pruning import PrunePlan, SessionPrunePlan

#: Checkpoint ids a dry run lists in the terminal (``--json`` lists them all).
_DRY_RUN_LISTED = 50


@click.command()
@store_option
@click.option("--before", default=None, help=f"Only what was created before this time: {TIME_HELP}.")
@click.option("--session", "session_id", default=None, help="Only this session's history.")
@click.option("--user", "user_id", default=None, help="Only this user's sessions.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--yes", is_flag=True,
              help="Delete without asking. Without it prune asks on a terminal and refuses when stdin is not one.")
@progress_option
@json_option
@guarded
def prune(store_url: str | None, before: str | None, session_id: str | None, user_id: str | None,
          dry_run: bool, yes: bool, show_progress: bool, as_json: bool) -> None:
    """Delete checkpoints, journal entries and run records matching every given filter, and nothing else.

    With --before, what recovering an unfinished run needs stays. The records
    of the sessions' explorations go once they are over (finished before
    --before, if given); a running exploration's never do. --dry-run
    lists what would go. Without --yes, prune shows what it would delete and
    asks for confirmation on a terminal; when stdin is not a terminal (a
    script, cron) it refuses unless --yes is given.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    cutoff = parse_time(before)
    everything = before is None and session_id is None and user_id is None
    store = open_store_or_fail(store_url)
    if dry_run:
        with Activity("prune --dry-run", show_progress) as activity:
            plan = _plan(store, cutoff, session_id, user_id, activity)
        _print_plan(plan, as_json)
        return
    if not yes:
        what = ("prune with no filter deletes every session's history" if everything
                else "prune deletes what matches its filters")
        if not stdin_is_tty():
            raise CliError(f"{what} and asks first, but stdin is not a terminal: pass --yes to delete without "
                           "asking (or --dry-run to list what would be deleted)")
        with Activity("prune: looking for what matches", show_progress) as activity:
            plan = _plan(store, cutoff, session_id, user_id, activity)
        if not (plan.checkpoints or plan.journal_entries or plan.run_records or plan.explorations):
            err_console.print("nothing matches: nothing to delete", highlight=False)
            if as_json:
                emit_json({"checkpoints": 0, "journal_entries": 0, "run_records": 0, "explorations": 0})
            return
        err_console.print(f"prune would delete {_plan_summary(plan)} in {store.describe()}"
                          + (" (every session's history)" if everything else ""), highlight=False)
        if not click.confirm("Delete them?", default=False, err=True):
            err_console.print("nothing deleted", highlight=False)
            sys.exit(1)
    with Activity("prune", show_progress) as activity:
        activity.step("deleting checkpoints, journal entries and run records")
        report = store.prune(before=cutoff, session_id=session_id, user_id=user_id)
    if as_json:
        emit_json(row_dict(report))
    else:
        console.print(f"pruned {count(report.checkpoints, 'checkpoint')}, "
                      f"{count(report.journal_entries, 'journal entry', 'journal entries')} and "
                      f"{count(report.run_records, 'run record')}"
                      + (f", and {count(report.explorations, 'finished exploration')}" if report.explorations else ""),
                      highlight=False)


def _plan(store: Store, cutoff: datetime | None, session_id: str | None, user_id: str | None,
          activity: Activity) -> PrunePlan:
    """The store's own prune plan for these filters, its passes over the sessions reported on ``activity``."""
    activity.step("listing sessions")
    return store.plan_prune(before=cutoff, session_id=session_id, user_id=user_id,
                            progress=lambda sessions, label: iter_progress(activity, sessions, label))


def _deleting(plan: PrunePlan) -> list[SessionPrunePlan]:
    """The sessions of which the plan deletes something."""
    return [s for s in plan.sessions if s.checkpoints or s.journal_entries or s.run_records or s.explorations.deleted]


def _plan_summary(plan: PrunePlan) -> str:
    return (f"{count(plan.checkpoints, 'checkpoint')}, "
            f"{count(plan.journal_entries, 'journal entry', 'journal entries')} and "
            f"{count(plan.run_records, 'run record')} of {count(len(_deleting(plan)), 'session')}"
            + (f", and {count(plan.explorations, 'finished exploration')}" if plan.explorations else ""))


def _print_plan(plan: PrunePlan, as_json: bool) -> None:
    if as_json:
        emit_json({"dry_run": True, **plan.summary()})
        return
    sessions = _deleting(plan)
    if not sessions:
        console.print("dry run: nothing matches; prune would delete nothing")
        return
    multi_user = any(s.user_id for s in sessions)
    rows = [{"session": s.session_id, "user": s.user_id or "-", "checkpoints": str(s.checkpoints),
             "journal": str(s.journal_entries), "runs": str(s.run_records),
             "kept": str(len(s.kept_for_recovery))} for s in sessions]
    cols = [Col("session")] + ([Col("user", drop=2)] if multi_user else [])
    cols += [Col("checkpoints", justify="right"), Col("journal", "journal entries", justify="right"),
             Col("runs", "run records", justify="right"), Col("kept", "kept for recovery", drop=1, justify="right")]
    console.print(fit_table(cols, rows, title="dry run: prune would delete"))
    listed = [(s, r.checkpoint_id) for s in sessions for r in s.retired]
    if listed:
        console.print("checkpoints it would delete (session, checkpoint):", highlight=False)
        for s, cid in listed[:_DRY_RUN_LISTED]:
            console.print(f"  {s.session_id} {cid}", highlight=False, soft_wrap=True)
        if len(listed) > _DRY_RUN_LISTED:
            console.print(f"  ... and {len(listed) - _DRY_RUN_LISTED} more (--json lists them all)", highlight=False)
    console.print(f"dry run: nothing deleted; prune would delete {_plan_summary(plan)}", highlight=False)
