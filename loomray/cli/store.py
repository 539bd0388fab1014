"""Commands on a store, no cluster needed: ``checkpoints`` [``quarantine``], ``show``, ``compact``,
``lease repair``, ``tree`` and ``timeline``.

``query`` and ``prune`` live in :mod:`loomray.cli.query` and
:mod:`loomray.cli.prune`, the steering commands in :mod:`loomray.cli.steering`.
"""

from __future__ import annotations

import json
from typing import NoReturn

import click
from rich.text import Text

from loomray.checkpoint_format import load_checkpoint
from loomray.cli.common import (
    STATUS_STYLE,
    CliError,
    check_id,
    console,
    err_console,
    first_line,
    guarded,
    json_option,
    open_session_store,
    open_store_or_fail,
    session_exists,
    store_option,
    unknown_session,
    user_option,
    who,
)
from loomray.cli.output import emit_json, money, row_dict, tell, time_cells
from loomray.cli.progress import Activity, progress_option
from loomray.cli.tables import Col, fit_table
from loomray.cli.timeline_view import session_timeline, timeline_table
from loomray.cli.tree_view import fork_tree, fork_variant, run_records, tree_html, tree_json, tree_table, variant_line
from loomray.errors import CheckpointException
from loomray.storage import Store
from loomray.storage.errors import InvalidIdError, LeaseCorruptError, StorageError
from loomray.storage.layout import lease_key


class _ListByDefault(click.Group):
    """A group whose first argument, unless it names a subcommand, goes to its ``list`` subcommand.

    So ``loomray checkpoints SESSION`` keeps listing, and ``loomray checkpoints
    quarantine SESSION CKPT`` runs the subcommand (``loomray checkpoints list
    quarantine`` lists a session named "quarantine").
    """

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ctx.help_option_names):
            args = ["list", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_ListByDefault)
def checkpoints() -> None:
    """A session's checkpoints: list (the default) or quarantine.

    `loomray checkpoints SESSION` lists them, newest first;
    `loomray checkpoints quarantine SESSION CKPT` moves a bad one aside.
    """


@checkpoints.command("list")
@click.argument("session_id")
@store_option
@user_option
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 10_000),
              help="Show at most this many checkpoints, newest first.")
@json_option
@guarded
def checkpoints_list(session_id: str, store_url: str | None, user_id: str | None, limit: int, as_json: bool) -> None:
    """List a session's checkpoints, newest first."""
    store = open_session_store(store_url, session_id, user_id)
    rows = store.checkpoints.list(session_id, user_id=user_id, limit=limit)
    if not rows and not session_exists(store, session_id, user_id):
        raise unknown_session(store, session_id, user_id)
    if as_json:
        emit_json([row_dict(r) for r in rows])
        return
    if not rows:
        err_console.print(f"session {session_id!r} has no checkpoints (it ran without checkpointing)")
        return
    # Optional columns go first when the terminal is narrow (--json has everything); ids, statuses and
    # times are never cut: the id is what people copy into the next command.
    cols = [Col("checkpoint"), Col("turn", justify="right"), Col("status"), Col("created", drop=2),
            Col("cost", drop=3, justify="right"), Col("tokens", drop=4, justify="right"),
            Col("epoch", drop=5, justify="right"), Col("after", drop=6), Col("messages", drop=7, justify="right")]
    created = time_cells([r.created_at for r in rows])
    cells = [{"checkpoint": r.checkpoint_id, "turn": str(r.turn), "after": r.position.removeprefix("after_"),
              "status": Text(r.execution_status, style=STATUS_STYLE.get(r.execution_status, "")),
              "messages": str(r.message_count), "tokens": str(r.input_tokens + r.output_tokens),
              "cost": money(r.cost_usd), "epoch": str(r.epoch), "created": t} for r, t in zip(rows, created, strict=False)]
    console.print(fit_table(cols, cells, title=f"checkpoints of {session_id} (times UTC)"))


@checkpoints.command("quarantine")
@click.argument("session_id")
@click.argument("checkpoint_id")
@store_option
@user_option
@json_option
@guarded
def checkpoints_quarantine(session_id: str, checkpoint_id: str, store_url: str | None, user_id: str | None,
                           as_json: bool) -> None:
    """Move a bad checkpoint aside (to the session's quarantine/) and retire its index row.

    "latest" and listings no longer see it; the bytes stay for inspection.
    """
    check_id(checkpoint_id, "checkpoint_id")
    store = open_session_store(store_url, session_id, user_id)
    moved = store.checkpoints.quarantine(session_id, checkpoint_id, user_id=user_id)
    where = f"bytes moved to {store.describe(moved)}" if moved else "its object was already gone"
    tell(as_json, {"session_id": session_id, "user_id": user_id, "checkpoint_id": checkpoint_id,
                   "quarantine_key": moved},
         f"checkpoint {checkpoint_id} of session {session_id} quarantined: {where}; its index row is retired")


@click.command()
@click.argument("session_id")
@click.argument("checkpoint_id", default="latest")
@store_option
@user_option
@click.option("--messages/--no-messages", default=True, help="Print the transcript (the default), or only the checkpoint's header with --no-messages.")
@click.option("--raw", "raw_object", is_flag=True,
              help="Print the stored object as it is (an incremental checkpoint holds only what its pass added).")
@json_option
@guarded
def show(session_id: str, checkpoint_id: str, store_url: str | None, user_id: str | None,
         messages: bool, raw_object: bool, as_json: bool) -> None:
    """Show one checkpoint (default: the latest) with its whole transcript."""
    if checkpoint_id != "latest":
        check_id(checkpoint_id, "checkpoint_id")
    store = open_session_store(store_url, session_id, user_id)
    if raw_object:
        try:
            raw = store.checkpoints.get(session_id, checkpoint_id, user_id=user_id)
        except InvalidIdError:
            raise
        except StorageError as e:  # what the API raises for any failed load, with the storage error as its cause
            raise CheckpointException(f"checkpoint {checkpoint_id!r} of session {session_id!r} could not be "
                                      f"loaded: {type(e).__name__}: {e}") from e
        if raw is None:
            _no_checkpoint(store, session_id, checkpoint_id, user_id)
        click.echo(raw.decode("utf-8"))
        return
    ckpt = load_checkpoint(store, session_id, checkpoint_id, user_id=user_id)  # the chain put together
    if ckpt is None:
        _no_checkpoint(store, session_id, checkpoint_id, user_id)
    if as_json:
        click.echo(ckpt.model_dump_json())
        return
    u = ckpt.cumulative_usage
    cost = "cost unknown" if u.cost_usd is None else money(u.cost_usd)
    console.print(
        f"[bold]{ckpt.session_id}[/] {ckpt.checkpoint_id}  turn {ckpt.turn}  {ckpt.position}  "
        f"{ckpt.execution_status}  {len(ckpt.messages)} messages  "
        f"{u.input_tokens}+{u.output_tokens} tokens  {cost}"
        + (f"  forked from {ckpt.forked_from}" if ckpt.forked_from else "")
    )
    variant = fork_variant(run_records(store, session_id, user_id)) if ckpt.forked_from else None
    if variant is not None:
        console.print(f"variant: {variant_line(variant)}", markup=False, highlight=False, soft_wrap=True)
    if messages:
        for m in ckpt.messages:
            text = m.content if len(m.content) <= 400 else m.content[:400] + " ..."
            calls = "".join(f"\n    -> {c.name}({json.dumps(c.arguments)[:120]})" for c in m.tool_calls)
            console.print(f"[cyan]{m.role}[/]: {text}{calls}", highlight=False)


def _no_checkpoint(store: Store, session_id: str, checkpoint_id: str, user_id: str | None) -> NoReturn:
    what = "unknown session" if not session_exists(store, session_id, user_id) else f"no checkpoint {checkpoint_id!r} for session"
    raise CliError(f"{what} {who(session_id, user_id)}")


@click.command()
@store_option
@progress_option
@json_option
@guarded
def compact(store_url: str | None, show_progress: bool, as_json: bool) -> None:
    """Compact the store's index: merge its small Parquet files, drop the rows of deleted checkpoints.

    Queries (`loomray query`, outside readers) read fewer files afterwards. A running supervisor also does it
    every 10 minutes.
    """
    with Activity("compact", show_progress) as activity:
        store = open_store_or_fail(store_url)
        if activity.enabled:
            activity.step("listing index files")
            n = len(store.index_files("checkpoints")) + len(store.index_files("sessions"))
            activity.step(f"merging {n} index files, partition by partition")
        report = store.compact()
    if as_json:
        emit_json(row_dict(report))
    else:
        console.print(
            f"index files {report.files_before} -> {report.files_after}, {report.rows} rows kept, "
            f"{report.tombstones_dropped} tombstoned rows dropped"
        )


@click.group()
def lease() -> None:
    """Repair a session's lease: lease.json, the record of which incarnation may write the session."""


@lease.command("repair")
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def lease_repair(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """Rewrite an unreadable or missing lease.json above every epoch the session used.

    The new epoch fences every holder: a running writer stops at its next lease
    check, and the session's next incarnation takes the epoch after it. A
    healthy lease is left alone.
    """
    store = open_session_store(store_url, session_id, user_id)
    key = lease_key(session_id, user_id)
    epoch: int | None
    try:
        epoch, state, problem = store.leases.current_epoch(session_id, user_id=user_id), "ok", None
        if store.objects.get(key=key) is None:
            state = "missing"
    except LeaseCorruptError as e:
        epoch, state, problem = None, "corrupt", first_line(str(e))
    if state == "missing" and not epoch and not session_exists(store, session_id, user_id):
        raise unknown_session(store, session_id, user_id)
    repaired = state != "ok"
    if repaired:
        epoch = store.leases.repair(session_id, user_id=user_id, owner="loomray lease repair").epoch
    rewritten = (f"{store.describe(key)} was {state}" + (f" ({problem})" if problem else "")
                 + f"; rewritten at epoch {epoch}, above every epoch the session used")
    tell(as_json, {"session_id": session_id, "user_id": user_id, "state": state, "repaired": repaired,
                   "epoch": epoch, "problem": problem},
         rewritten if repaired else f"the lease of session {session_id} is healthy (epoch {epoch}): nothing to repair")


@click.command()
@click.argument("session_id")
@store_option
@user_option
@click.option("--html", "html_path", default=None, metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write the tree as a self-contained HTML page to FILE.")
@json_option
@guarded
def tree(session_id: str, store_url: str | None, user_id: str | None, html_path: str | None, as_json: bool) -> None:
    """The fork tree of a session: its forks, their forks, and so on.

    Per session: the parent checkpoint it was forked from, its turns, its
    status and its own spend (its cost minus what its parent checkpoint had
    already cost).
    """
    store = open_session_store(store_url, session_id, user_id)
    root = fork_tree(store, session_id, user_id)
    if html_path:
        try:
            with open(html_path, "w", encoding="utf-8") as f:
                f.write(tree_html(root, store_desc=store.describe()))
        except OSError as e:
            raise CliError(f"cannot write {html_path!r}: {e.strerror or e}") from e
    if as_json:
        emit_json(tree_json(root) | ({"html": html_path} if html_path else {}))
        return
    table, summary = tree_table(root)
    console.print(table)
    console.print(summary, highlight=False)
    if html_path:
        err_console.print(f"wrote {html_path}", highlight=False, soft_wrap=True)


@click.command()
@click.argument("session_id")
@store_option
@user_option
@json_option
@guarded
def timeline(session_id: str, store_url: str | None, user_id: str | None, as_json: bool) -> None:
    """A session's incarnations, by lease epoch: owner and node, start, end, and why it started and ended.

    Read from the epoch markers, lease.json, the status rows, the run records,
    the journal and the checkpoints the store still holds.
    """
    store = open_session_store(store_url, session_id, user_id)
    data = session_timeline(store, session_id, user_id)
    if as_json:
        emit_json(data)
        return
    console.print(timeline_table(data))
    if data["current_epoch"] is not None:
        console.print(f"lease: epoch {data['current_epoch']}, owner {data['lease_owner'] or '-'}", highlight=False,
                      soft_wrap=True)


STORE_COMMANDS: tuple[click.Command, ...] = (checkpoints, show, compact, lease, tree, timeline)
