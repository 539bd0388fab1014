"""``loomray demo``: a durable research session on a 3-node Ray cluster, on this machine, offline.

Kill a node mid-run, recover with no model call repeated, fork, steer, query (step by step in docs/api.md,
"Command line"); the steps are in :mod:`loomray.cli.demo_steps`. ``--fast`` shortens every delay for tests.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone

import click
from rich.panel import Panel

from loomray.cli.common import console, guarded
from loomray.cli.demo_agent import RESEARCH_AGENT_REF, Pace, build_agent
from loomray.cli.demo_steps import run_demo
from loomray.runtime.connection import normalize_store_url
from loomray.storage import open_store


@click.command()
@click.option("--store", "store_url", default=None, metavar="URL",
              help="Where to keep the data (default ./loomray-data/demo-<timestamp>).")
@click.option("--model", default="demo:research", show_default=True,
              help="Model name; e.g. claude-opus-4-7 with ANTHROPIC_API_KEY set.")
@click.option("--fast", is_flag=True, help="Short delays and fewer passes (for tests).")
@click.option("--passes", type=click.IntRange(4, 60), default=None, help="Research passes of the offline model (default: 14; 9 with --fast).")
@click.option("--nodes", type=click.IntRange(3, 8), default=3, show_default=True, help="Ray nodes (head + workers).")
@guarded
def demo(store_url: str | None, model: str, fast: bool, passes: int | None, nodes: int) -> None:
    """Kill a node mid-session, recover with no model call repeated, fork, query: on a local Ray cluster."""
    pace = Pace.choose(fast, passes)
    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="loomray-demo-")
    log_path = os.path.join(workdir, "model-calls.log")
    try:
        if not model.startswith("demo:"):  # a real model picks its own number of passes: kill early
            pace = dataclasses.replace(pace, kill_after=2)
        agent = build_agent(model, pace=pace, log_path=log_path)  # a missing key fails here, before Ray
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        store_url = normalize_store_url(store_url or os.path.join("loomray-data", f"demo-{stamp}"))
        open_store(store_url).close()
        if model == "demo:research":  # later `loomray resume/fork` on this store find the agent by this name
            from loomray.runtime.actors import set_agent_ref  # imports Ray

            set_agent_ref(agent, RESEARCH_AGENT_REF)
        console.print(Panel(
            f"A research session on a {nodes}-node Ray cluster on 127.0.0.1, model [bold]{model}[/].\n"
            f"We will kill the node running it, watch it recover with no model call repeated,\n"
            f"fork it three ways, and query the index. Data: [bold]{store_url}[/]",
            title="[bold]loomray demo[/]", border_style="magenta"))
        sid = run_demo(agent, store_url, log_path, pace=pace, nodes=nodes, model=model)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _print_next_steps(sid, store_url, time.monotonic() - started)


def _print_next_steps(sid: str, store_url: str, took_s: float) -> None:
    console.print()
    console.print(Panel(f"Done in {took_s:.0f} s. The data stays in [bold]{store_url}[/]",
                        title="[bold green]demo complete[/]", border_style="green"))
    console.print("Try:", highlight=False)
    for line in (f"loomray checkpoints {sid} --store {store_url}",
                 f"loomray show {sid} --store {store_url} --no-messages",
                 f"loomray status --store {store_url}",
                 "loomray query \"select session_id, forked_from, max(turn) turns from checkpoints group by all\""
                 f" --store {store_url}",
                 f"loomray resume {sid} \"Add a section on operations.\" --store {store_url}",
                 f"loomray fork {sid} --prompt \"Shorter.\" --prompt \"Longer.\" --store {store_url}"):
        console.print(f"  {line}", highlight=False, soft_wrap=True)
