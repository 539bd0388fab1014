"""``loomray explore``: run variants of a session from one checkpoint, judge them, keep the best, durably.

In this process, on the cluster (``--address``), or handed to the store's supervisor (``--submit``). The
judge is imported from ``--judge`` on every call, ``--resume`` included: the store never names code to run
(docs/exploration.md, "Command line").
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from typing import Any

import click

from loomray.cli.common import (
    CliError,
    address_option,
    check_id,
    console,
    first_line,
    guarded,
    json_option,
    open_store_or_fail,
    store_option,
    store_url_or_fail,
    user_option,
)
from loomray.cli.explore_view import exploration_dict, exploration_table
from loomray.cli.output import emit_json
from loomray.cli.ray_access import placement_option, require_address
from loomray.cli.runs import agent_for, bind, runtime_for
from loomray.cli.variant_args import parse_variants
from loomray.explore import Budget, ModelJudge, find_exploration
from loomray.explore.record import ExplorationRecord, variant_from_doc
from loomray.storage import Store


def load_judge(ref: str) -> Any:
    """The judge at ``module:attr``: a callable or a ``ModelJudge`` (the current directory is importable)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise CliError(f"--judge must be module:attr, got {ref!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as e:  # not importable, or the module raised while importing
        raise CliError(f"judge {ref!r} failed to load: {type(e).__name__}: {first_line(str(e))}") from e
    if not isinstance(obj, ModelJudge) and not callable(obj):
        raise CliError(f"judge {ref!r} names a {type(obj).__name__}, not a callable or a ModelJudge")
    return obj


@click.command()
@click.argument("session_id", required=False)
@click.option("--variant", "variant_values", multiple=True, metavar="JSON|@FILE",
              help='One variant (repeatable): {"prompt", "model", "instructions", "tools": [names], "tuning": {...}, '
                   '"edits"}, or @file.')
@click.option("--judge", "judge_ref", default=None, metavar="MODULE:FN",
              help="The judge: a function (JudgeInput) -> float | Score, or a ModelJudge.")
@click.option("--rounds", default=1, show_default=True, type=click.IntRange(1), help="Rounds of forks (a beam).")
@click.option("--keep", default=1, show_default=True, type=click.IntRange(1), help="Branches kept per round.")
@click.option("--score-every", default=None, type=click.IntRange(1), metavar="PASSES",
              help="Also score running branches every PASSES passes and stop the dominated ones.")
@click.option("--adopt", is_flag=True, help="Continue SESSION in place from the winner.")
@click.option("--budget-usd", default=None, type=click.FloatRange(0), help="Spend limit for everything.")
@click.option("--budget-s", default=None, type=click.FloatRange(0), help="Wall-clock limit in seconds.")
@click.option("--from", "from_checkpoint", default="latest", show_default=True, help="Checkpoint to explore from.")
@click.option("--id", "exploration_id", default=None, help="The exploration's id (default: a new one).")
@click.option("--resume", "resume_id", default=None, metavar="ID", help="Continue exploration ID.")
@click.option("--submit", is_flag=True,
              help="Hand the exploration to the store's supervisor on the cluster (--address); print its id.")
@click.option("--agent", "agent_ref", default=None, metavar="MODULE:AGENT",
              help="Agent that runs the branches (default: the one stored with the session).")
@user_option
@store_option
@address_option
@placement_option
@json_option
@guarded
def explore(session_id: str | None, variant_values: tuple[str, ...], judge_ref: str | None, rounds: int, keep: int,
            score_every: int | None, adopt: bool, budget_usd: float | None, budget_s: float | None,
            from_checkpoint: str, exploration_id: str | None, resume_id: str | None, submit: bool,
            agent_ref: str | None, user_id: str | None, store_url: str | None, address: str | None, placement: str,
            as_json: bool) -> None:
    """Explore variants of SESSION from one checkpoint; a judge picks the winner (see docs/exploration.md)."""
    check_id(user_id, "user_id")
    if judge_ref is None:
        raise CliError("--judge module:fn is required (also with --resume: the store never names code to run)")
    store = open_store_or_fail(store_url)
    if resume_id is not None:
        if session_id is not None or variant_values:
            raise CliError("--resume takes the session and variants from the stored plan; pass neither")
        args = _stored_args(store, check_id(resume_id, "exploration id") or resume_id, user_id)
    else:
        if session_id is None or not variant_values:
            raise CliError("give SESSION and at least one --variant (or --resume ID)")
        check_id(session_id, "session_id")
        budget = None if budget_usd is None and budget_s is None else Budget(budget_usd, budget_s)
        args = {"session_id": session_id, "variants": parse_variants(variant_values), "rounds": rounds,
                "keep": keep, "score_every": score_every, "adopt": adopt, "budget": budget,
                "from_checkpoint": from_checkpoint, "exploration_id": check_id(exploration_id, "exploration id")}
    judge = load_judge(judge_ref)
    agent, ref = agent_for(args["session_id"], user_id, store, agent_ref)
    if submit:
        _submit(args, judge_ref, ref, user_id, store_url_or_fail(store_url), address, placement, as_json)
        return
    bound = bind(agent, ref, runtime_for(store_url_or_fail(store_url), address, placement))
    sid = args.pop("session_id")
    result = asyncio.run(bound.explore(sid, judge=judge, user_id=user_id, **args))
    if as_json:
        emit_json(exploration_dict(result))
        return
    table, summary = exploration_table(result)
    console.print(table)
    console.print(summary, highlight=False)


def _submit(args: dict[str, Any], judge_ref: str, agent_ref: str, user_id: str | None, store_url: str,
            address: str | None, placement: str, as_json: bool) -> None:
    """Hand the exploration to the store's supervisor on the cluster (:mod:`loomray.runtime.explorations`)."""
    runtime: Any = runtime_for(store_url, require_address(address), placement)
    from loomray.runtime.actors import supervisor_name
    from loomray.runtime.explorations import submit_exploration  # imports Ray

    session_id = args.pop("session_id")
    xid = asyncio.run(submit_exploration(runtime, agent_ref, judge_ref, session_id, user_id=user_id, **args))
    supervisor = supervisor_name(runtime.config.store_url)
    if as_json:
        emit_json({"exploration_id": xid, "session_id": session_id, "supervisor": supervisor})
        return
    console.print(f"submitted exploration {xid} of {session_id} to the store's supervisor ({supervisor}); "
                  f"see it with: loomray query --exploration {xid}", highlight=False)


def _stored_args(store: Store, exploration_id: str, user_id: str | None) -> dict[str, Any]:
    """``explore``'s arguments as the exploration's stored plan has them."""
    session_id = find_exploration(store.objects, exploration_id, user_id)
    plan = None if session_id is None else ExplorationRecord(store.objects, session_id, user_id, exploration_id).get(
        "plan")
    if session_id is None or plan is None:
        raise CliError(f"no exploration {exploration_id!r} (user {user_id!r}) in {store.describe()}")
    if not isinstance(plan["variants"], list):
        raise CliError(f"exploration {exploration_id} chooses its variants with a function "
                       f"({plan['variants'].get('callable')}); continue it from Python with Agent.explore")
    budget = plan["budget"]
    return {"session_id": session_id, "variants": [variant_from_doc(v) for v in plan["variants"]],
            "rounds": plan["rounds"], "keep": plan["keep"], "score_every": plan["score_every"],
            "adopt": plan["adopt"], "from_checkpoint": plan["from_checkpoint"], "exploration_id": exploration_id,
            "budget": None if budget == {"max_cost_usd": None, "max_wall_s": None} else Budget(**budget)}
