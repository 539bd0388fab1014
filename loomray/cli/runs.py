"""``resume`` and ``fork``: continue a session, or fan out from one of its checkpoints.

Both run on the cluster given by ``--address`` / ``RAY_ADDRESS``; without
one they run in this process against the store (same journal, same
checkpoints, same results), which needs no cluster at all. The agent comes
from ``--agent module:attr``, else from the reference stored with the session.
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import click
from rich.progress import Progress, TaskID

from loomray.agent import Agent
from loomray.cli.common import (
    CliError,
    address_option,
    check_id,
    console,
    first_line,
    guarded,
    json_option,
    open_session_store,
    open_store_or_fail,
    store_option,
    store_url_or_fail,
    unknown_session,
    user_option,
)
from loomray.cli.output import emit_json, excerpt
from loomray.cli.progress import run_progress
from loomray.cli.ray_access import join_cluster, placement_option, require_address
from loomray.cli.tables import Col, fit_table
from loomray.cli.variant_args import parse_variants
from loomray.errors import LoomrayUserError
from loomray.events import CheckpointEvent, EmitFn, Event, RunStart
from loomray.records import RunResult
from loomray.runtime import LocalRuntime, Runtime
from loomray.runtime.connection import normalize_store_url
from loomray.storage import Store
from loomray.variants import describe_variant


def load_agent(ref: str) -> Agent:
    """Import the agent at ``module:attr`` (the current directory is importable, as with uvicorn/celery)."""
    from loomray.runtime.actors import resolve_ref  # imports Ray

    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = resolve_ref(ref)
    except LoomrayUserError as e:  # not importable, malformed, or not an Agent: the message names the reference
        raise CliError(first_line(str(e))) from e
    except Exception as e:  # the module raised while importing (e.g. a missing API key)
        raise CliError(f"agent reference {ref!r} failed to load: {type(e).__name__}: {first_line(str(e))}") from e
    if not isinstance(obj, Agent):
        raise CliError(f"agent reference {ref!r} names a {type(obj).__name__}, not a loomray Agent")
    return obj


def runtime_for(store_url: str, address: str | None, placement: str = "actor") -> Runtime:
    """The cluster at ``address`` (checked and joined), else this process (a bound agent's reference is stored
    with its sessions, so they stay resumable by reference)."""
    if not address:
        return LocalRuntime(store_url)
    require_address(address)
    join_cluster(address)
    from loomray.runtime.ray_runtime import RayRuntime  # imports Ray

    return RayRuntime(normalize_store_url(store_url), address=address, placement=placement)


def agent_for(session_id: str, user_id: str | None, store: Store, agent_ref: str | None) -> tuple[Agent, str]:
    """The agent that continues ``session_id``: ``--agent``, else the reference stored with the session."""
    row = store.sessions.get(session_id, user_id=user_id)
    if agent_ref is None:
        if row is None and not store.checkpoints.list(session_id, user_id=user_id, limit=1):
            raise unknown_session(store, session_id, user_id)
        agent_ref = row.agent_ref if row is not None else None
        if not agent_ref:
            raise CliError(f"session {session_id!r} has no stored agent reference (it was run in-process); "
                           "pass --agent module:attr")
    return load_agent(agent_ref), agent_ref


def bind(agent: Agent, ref: str, runtime: Runtime) -> Agent:
    """A copy of ``agent`` on ``runtime`` that remembers its reference (restartable by the supervisor)."""
    from loomray.runtime.actors import set_agent_ref  # imports Ray

    mine = copy.copy(agent)
    mine.runtime = runtime
    return set_agent_ref(mine, ref)


def result_dict(r: RunResult) -> dict[str, Any]:
    """A run's result as ``--json`` prints it."""
    return {"session_id": r.session_id, "turns": r.turns, "model_calls": r.model_calls,
            "checkpoint_id": r.checkpoint_id, "resumed_from_checkpoint": r.resumed_from_checkpoint,
            "input_tokens": r.usage.input_tokens, "output_tokens": r.usage.output_tokens, "cost_usd": r.usage.cost_usd,
            "output": r.output}


class _Bars:
    """Progress bars fed by the runs' own events: a bar per session from its first event, its turn from each
    checkpoint. ``labels``: the label of each run in the order given (a run is matched to it by its prompt);
    :meth:`finish` gives every run the work returned a bar, whatever events reached this process."""

    def __init__(self, progress: Progress, labels: Sequence[tuple[str | None, str]]) -> None:
        self._progress, self._labels, self._free = progress, list(labels), list(labels)
        self._bars: dict[str, tuple[TaskID, int]] = {}

    def _bar(self, sid: str, prompt: str | None, turn: int) -> tuple[TaskID, int]:
        if sid not in self._bars:
            hit = next((i for i, (p, _) in enumerate(self._free) if p == prompt), 0 if self._free else None)
            label = self._free.pop(hit)[1] if hit is not None else sid
            self._bars[sid] = (self._progress.add_task(label, total=None, info="starting"), turn)
        return self._bars[sid]

    def __call__(self, event: Event) -> None:
        bar, base = self._bar(event.session_id, event.prompt if isinstance(event, RunStart) else None, event.turn)
        if isinstance(event, CheckpointEvent) and event.ok:
            self._progress.update(bar, info=f"turn {event.turn} (+{max(event.turn - base, 0)})")

    def finish(self, results: Sequence[RunResult]) -> None:
        """Every run done: each result's bar (made now, with its label in order, if no event came) completed."""
        for r, (_, label) in zip(results, self._labels, strict=False):
            if r.session_id not in self._bars:
                self._bars[r.session_id] = (self._progress.add_task(label, total=None, info=""), 0)
                self._free = [f for f in self._free if f[1] != label]
            self._progress.update(self._bars[r.session_id][0], total=1, completed=1, info=f"turn {r.turns}")


async def with_progress(work: Callable[[EmitFn], Awaitable[list[RunResult]]],
                        labels: Sequence[tuple[str | None, str]]) -> list[RunResult]:
    """``work(emit)``, showing a bar per run (see :class:`_Bars`) until it is done."""
    with run_progress() as progress:
        bars = _Bars(progress, labels)
        results = await work(bars)
        bars.finish(results)
        return results


@click.command()
@click.argument("session_id")
@click.argument("prompt", required=False)
@click.option("--from", "from_checkpoint", default="latest", show_default=True,
              help="Checkpoint to continue from; an older one forks into a new session.")
@click.option("--agent", "agent_ref", default=None, metavar="MODULE:AGENT",
              help="Agent to continue with (default: the one stored with the session).")
@user_option
@store_option
@address_option
@json_option
@guarded
def resume(session_id: str, prompt: str | None, from_checkpoint: str, agent_ref: str | None, user_id: str | None,
           store_url: str | None, address: str | None, as_json: bool) -> None:
    """Continue a session (on the cluster with --address, else in this process) and print the result."""
    if from_checkpoint != "latest":
        check_id(from_checkpoint, "checkpoint_id")
    store = open_session_store(store_url, session_id, user_id)
    agent, ref = agent_for(session_id, user_id, store, agent_ref)
    bound = bind(agent, ref, runtime_for(store_url_or_fail(store_url), address))

    async def work(emit: EmitFn) -> list[RunResult]:
        return [await bound.resume(prompt, session_id=session_id, from_checkpoint=from_checkpoint, user_id=user_id,
                                   emit=emit)]

    result = asyncio.run(with_progress(work, [(prompt, f"resume {session_id}")]))[0]
    if as_json:
        emit_json(result_dict(result))
        return
    where = "in place" if result.session_id == session_id else f"as new session {result.session_id} (a fork)"
    console.print(f"resumed {session_id} {where}: {result.turns} turns, {result.model_calls} model calls, "
                  f"checkpoint {result.checkpoint_id}", highlight=False)
    console.print(excerpt(result.output, 600), highlight=False)


def _fork_base(store: Store, session_id: str, user_id: str | None, from_checkpoint: str) -> tuple[str, int]:
    """The checkpoint to fork from (``latest`` resolved) and its turn, from the session's index rows."""
    if from_checkpoint != "latest":
        check_id(from_checkpoint, "checkpoint_id")
    rows = store.checkpoints.list(session_id, user_id=user_id, limit=1 if from_checkpoint == "latest" else None)
    row = next((r for r in rows if from_checkpoint in ("latest", r.checkpoint_id)), None)
    if row is None:
        raise CliError(f"session {session_id!r} has no checkpoint {from_checkpoint!r} to fork from")
    return row.checkpoint_id, row.turn


@click.command()
@click.argument("session_id")
@click.option("--from", "from_checkpoint", default="latest", show_default=True, help="Checkpoint to fork from.")
@click.option("--prompt", "prompts", multiple=True, help="One fork per --prompt.")
@click.option("--variant", "variant_texts", multiple=True, metavar="JSON|@FILE",
              help="One fork per --variant: what it changes (prompt, model, instructions, tools, tuning, edits).")
@click.option("--agent", "agent_ref", default=None, metavar="MODULE:AGENT",
              help="Agent to run the forks (default: the one stored with the session).")
@user_option
@store_option
@address_option
@placement_option
@json_option
@guarded
def fork(session_id: str, from_checkpoint: str, prompts: tuple[str, ...], variant_texts: tuple[str, ...],
         agent_ref: str | None, user_id: str | None, store_url: str | None, address: str | None, placement: str,
         as_json: bool) -> None:
    """Fork a session: one new session per --prompt (or per --variant), each from the same checkpoint of SESSION_ID.

    The forks run at once (on the cluster with --address, else in this process); SESSION_ID itself is
    left as it is. Prints each fork's new session id and result.
    """
    check_id(session_id, "session_id")
    check_id(user_id, "user_id")
    if bool(prompts) == bool(variant_texts):
        raise CliError("give one fork per --prompt or per --variant (not both)")
    variants = parse_variants(variant_texts)
    store = open_store_or_fail(store_url)
    agent, ref = agent_for(session_id, user_id, store, agent_ref)
    from_checkpoint, base_turn = _fork_base(store, session_id, user_id, from_checkpoint)
    bound = bind(agent, ref, runtime_for(store_url_or_fail(store_url), address, placement))
    # Each fork's prompt, how it is shown, and its variant as stored (None: a prompt fork).
    arms: list[tuple[str | None, str, dict[str, Any] | None]] = [
        (v.prompt, describe_variant(v.to_json()), v.to_json()) for v in variants] or [(p, p, None) for p in prompts]
    labels = [(p, f"fork {i + 1}: {excerpt(what or '', 32)}") for i, (p, what, _) in enumerate(arms)]
    results = asyncio.run(with_progress(lambda emit: bound.fork(
        session_id, from_checkpoint=from_checkpoint, prompts=None if variants else list(prompts),
        variants=variants or None, user_id=user_id, emit=emit), labels))
    if as_json:
        emit_json([{**result_dict(r), "prompt": p, "variant": v, "forked_from": session_id,
                    "from_checkpoint": from_checkpoint} for r, (p, _, v) in zip(results, arms, strict=True)])
        return
    # The new session ids are what the next command needs: printed whole, whatever the terminal's width.
    cols = [Col("session"), Col("turns", justify="right"), Col("calls", "model calls", drop=2, justify="right"),
            Col("prompt", "variant" if variants else "prompt", wrap=True, min_wrap=12),
            Col("output", wrap=True, drop=1)]
    rows = [{"session": r.session_id, "prompt": w, "turns": str(r.turns), "calls": str(r.model_calls),
             "output": excerpt(r.output, 80)} for r, (_, w, _) in zip(results, arms, strict=True)]
    console.print(fit_table(cols, rows, title=f"{len(results)} forks of {session_id} from {from_checkpoint} "
                                              f"(turn {base_turn})"))
