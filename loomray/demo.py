"""``loomray demo``: a durable research session on a 3-node Ray cluster, on this machine, offline.

What a person watching sees, step by step:

1. a 3-node Ray cluster starts on 127.0.0.1 (``loomray.testing.local_cluster``);
2. a long research session (``model="demo:research"``, a few seconds per pass)
   is submitted to the supervisor, which starts its actor on a worker node;
3. mid-run, while a tool call is in flight, that node's raylet is SIGKILLed;
   the supervisor restarts the session on the other worker from its latest
   checkpoint, and the journal answers every step already taken;
4. the proof: every model reply index was served exactly once (a call log
   written by the model wrapper in whichever process made the call, checked
   against the journal's model entries per lease epoch);
5. three forks fan out from the checkpoint taken before the report was
   written, each with its own follow-up prompt, one actor each;
6. the Parquet index is queried with DuckDB (a table);
7. the cluster is shut down and checked gone; the data stays on disk.

``--model claude-opus-4-7`` (with ``ANTHROPIC_API_KEY``) swaps in a real
provider; a missing key is one clear line before any cluster starts.
``--fast`` shortens every delay for the test suite.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import click  # noqa: E402
from rich.panel import Panel  # noqa: E402
from rich.table import Table  # noqa: E402

from loomray import Agent, Tuning  # noqa: E402
from loomray.cli_common import console, guarded, sql_to_arrow  # noqa: E402
from loomray.models.base import ModelRequest, ModelResponse  # noqa: E402
from loomray.models.research import fetch_page as _fetch_page  # noqa: E402
from loomray.models.research import search as _search  # noqa: E402
from loomray.models.research import take_note as _take_note  # noqa: E402
from loomray.tools import tool  # noqa: E402

INSTRUCTIONS = (
    "You are a careful research assistant. Work in rounds: search, read the most relevant page with "
    "fetch_page, and keep a note with take_note; one tool call per turn. After at least six rounds, "
    "write a final report that cites your notes."
)
TASK = "Durable checkpointing for long-running LLM agents on a Ray cluster"
FORK_PROMPTS = (
    "Add a section on costs.",
    "Add a section on failure modes in production.",
    "Add a section on security and tenancy.",
)
#: Passes of the offline research model (``make demo``); ``--fast`` uses fewer.
DEMO_PASSES = 14


@dataclass(frozen=True)
class Pace:
    """How slow the demo runs, so a person can follow it."""

    passes: int
    model_s: float
    fetch_s: float
    kill_after: int  # model calls before the node is killed (during the next fetch_page)

    @classmethod
    def choose(cls, fast: bool, passes: int | None) -> Pace:
        # The kill lands during a fetch_page; the work left after it must outlast the ~2 s that a
        # SIGKILLed node's orphaned worker process lives on (docs/ray-notes.md), or that orphan
        # finishes the run itself before the supervisor even notices the node is gone.
        if fast:
            p = passes or 9
            return cls(passes=p, model_s=0.25, fetch_s=0.8, kill_after=2)
        p = passes or DEMO_PASSES
        return cls(passes=p, model_s=1.5, fetch_s=2.0, kill_after=max(2, p // 2))


class CountingModel:
    """Wraps a model; appends one line per *completed* call to a log shared by every process.

    The line names the reply index (assistant turns already in the
    transcript) and the process, so "no model call repeated" can be checked
    across actors and nodes: a replayed step never reaches this method.
    """

    def __init__(self, inner: Any, log_path: str) -> None:
        self.inner = inner
        self.name = inner.name
        self.log_path = log_path

    async def complete(self, request: ModelRequest) -> ModelResponse:
        response = await self.inner.complete(request)
        index = sum(1 for m in request.messages if m.role == "assistant")
        _append(self.log_path, f"model {index} {os.getpid()}")
        return response


def _append(path: str, line: str) -> None:
    # One short O_APPEND write per line: atomic across processes on one machine.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def demo_tools(fetch_s: float = 0.0, log_path: str | None = None) -> list[Any]:
    """The research tools; ``fetch_page`` takes ``fetch_s`` (a slow network) and logs when it starts."""

    def search(query: str) -> str:
        """Search the offline corpus.

        Args:
            query: what to look for.
        """
        return _search(query)

    async def fetch_page(url: str, max_kb: float = 3.0) -> str:
        """Fetch a page of the offline corpus as text.

        Args:
            url: the page address, from a search result.
            max_kb: how much text to return, in KB.
        """
        if log_path:
            _append(log_path, f"fetch {os.getpid()}")
        await asyncio.sleep(fetch_s)
        return _fetch_page(url, max_kb)

    def take_note(title: str, text: str) -> str:
        """Keep a note for the final report.

        Args:
            title: a short heading.
            text: the note.
        """
        return _take_note(title, text)

    return [tool(search), tool(fetch_page), tool(take_note)]


def build_agent(model: str, *, pace: Pace | None = None, log_path: str | None = None) -> Agent:
    """The demo's research agent; ``demo:*`` models get ``pace``, real ones are used as they are."""
    from loomray.models.resolve import resolve_model

    pace = pace or Pace(passes=DEMO_PASSES, model_s=0.0, fetch_s=0.0, kill_after=0)
    if model.startswith("demo:"):
        inner = resolve_model(model, passes=pace.passes, delay=pace.model_s)
    else:
        inner = resolve_model(model)
    wrapped = CountingModel(inner, log_path) if log_path else inner
    return Agent(INSTRUCTIONS, model=wrapped, tools=demo_tools(pace.fetch_s, log_path),
                 tuning=Tuning(checkpoint=True, max_turns=60), name="demo-research")


#: Importable reference for ``loomray resume/fork`` on demo sessions (no delays, offline model).
research_agent = build_agent("demo:research")
REF = "loomray.demo:research_agent"


# --------------------------------------------------------------------- the demo


def _log_lines(path: str) -> list[list[str]]:
    try:
        return [line.split() for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _step(n: int, title: str, body: str) -> None:
    console.print()
    console.print(Panel(body, title=f"[bold]step {n}[/] · {title}", title_align="left", border_style="cyan"))


@click.command()
@click.option("--store", "store_url", default=None, metavar="URL",
              help="Where to keep the data (default ./loomray-data/demo-<timestamp>).")
@click.option("--model", default="demo:research", show_default=True,
              help="Model name; e.g. claude-opus-4-7 with ANTHROPIC_API_KEY set.")
@click.option("--fast", is_flag=True, help="Short delays and fewer passes (for tests).")
@click.option("--passes", type=click.IntRange(4, 60), default=None, help="Research passes of the offline model.")
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
        if store_url is None:
            stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
            store_url = os.path.abspath(os.path.join("loomray-data", f"demo-{stamp}"))
        elif "://" not in store_url:
            store_url = os.path.abspath(store_url)
        from storage import open_store

        open_store(store_url).close()
        if model == "demo:research":  # later `loomray resume/fork` on this store find the agent by this name
            from loomray.runtime.actors import set_agent_ref

            set_agent_ref(agent, REF)
        console.print(Panel(
            f"A research session on a {nodes}-node Ray cluster on 127.0.0.1, model [bold]{model}[/].\n"
            f"We will kill the node running it, watch it recover with no model call repeated,\n"
            f"fork it three ways, and query the index. Data: [bold]{store_url}[/]",
            title="[bold]loomray demo[/]", border_style="magenta"))
        sid = run_demo(agent, store_url, log_path, pace=pace, nodes=nodes, model=model)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    console.print()
    console.print(Panel(f"Done in {time.monotonic() - started:.0f} s. The data stays in [bold]{store_url}[/]",
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


def _actor_info(session_id: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """Where the session's current incarnation runs, or None while there is none."""
    import ray

    from loomray.runtime.actors import NAMESPACE, session_actor_name

    try:
        handle = ray.get_actor(session_actor_name(session_id), namespace=NAMESPACE)
        return ray.get(handle.info.remote(), timeout=timeout)
    except Exception:  # gone, dying, or not yet created: the caller asks again later
        return None


def _node_label(lc: Any, node_id: str | None) -> str:
    if node_id is None:
        return "?"
    for i, n in enumerate(lc.nodes + lc.removed):
        if n.node_id == node_id:
            return f"{'head' if n is lc.head else 'worker'}-{lc._index.get(node_id, i)} ({node_id[:8]})"
    return node_id[:8]


def _quiet_node_deaths() -> Any:
    """Drop Ray's multi-screen "raylet terminated" dumps from the driver; the demo reports the kill itself.

    Ray prints them from a background thread through ``print_to_stdstream``;
    the patch is undone when the demo ends. Other Ray errors still print.
    """
    try:
        import ray._private.worker as worker  # noqa: PLC2701 - Ray has no public hook for this output
    except ImportError:  # pragma: no cover - a Ray without this internal: keep its output
        return lambda: None
    original = worker.print_to_stdstream

    def filtered(data: dict, ignore_prefix: bool) -> None:
        text = " ".join(str(x) for x in data.get("lines", ()))
        if data.get("pid") == "raylet" and ("marked dead" in text or "Raylet is terminated" in text):
            return
        original(data, ignore_prefix)

    worker.print_to_stdstream = filtered
    return lambda: setattr(worker, "print_to_stdstream", original)


def run_demo(agent: Agent, store_url: str, log_path: str, *, pace: Pace, nodes: int, model: str) -> str:
    """Steps 1-6 of the module docstring; returns the main session id. The cluster is gone on return."""
    import logging

    from loomray.testing import local_cluster

    t0 = time.monotonic()
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray's INFO lines would interleave with the story
    with console.status(f"starting a {nodes}-node Ray cluster on 127.0.0.1 ..."):
        cluster = local_cluster(num_nodes=nodes, worker_resources={"loomray_session": 100},
                                init_kwargs={"log_to_driver": False, "logging_level": logging.WARNING})
        lc = cluster.__enter__()
    restore = _quiet_node_deaths()
    try:
        table = Table(title=f"cluster up in {time.monotonic() - t0:.1f} s")
        for col in ("node", "id", "address", "runs sessions"):
            table.add_column(col)
        for n in lc.nodes:
            table.add_row(_node_label(lc, n.node_id).split(" ")[0], n.node_id[:16], lc.address.split(":")[0],
                          "no (supervisor)" if n is lc.head else "yes")
        _step(1, "a Ray cluster on this machine", "Head + workers, all bound to 127.0.0.1. Session actors need "
              "the resource [bold]loomray_session[/], which only workers have, so losing a worker loses a session.")
        console.print(table)
        sid = _session_run(lc, agent, store_url, log_path, pace, model)
    except BaseException:
        cluster.__exit__(None, None, None)
        restore()
        raise
    with console.status("stopping the cluster ..."):
        cluster.__exit__(None, None, None)
    restore()
    _step(6, "cleanup", "cluster stopped, every process it started is gone"
          + (f" ([red]{len(lc.leftover)} had to be killed[/])" if lc.leftover else "") + ".")
    return sid


def _session_run(lc: Any, agent: Agent, store_url: str, log_path: str, pace: Pace, model: str) -> str:
    import ray

    from loomray.cli_ray import ray_get
    from loomray.errors import LoomrayRunError
    from loomray.ids import new_id
    from loomray.records import RunResult
    from loomray.runtime import RayRuntime
    from loomray.runtime.actors import AgentSpec
    from loomray.session import RunRequest

    runtime = RayRuntime(store_url, actor_options={"resources": {"loomray_session": 1}})
    store = runtime.store
    handle = runtime.supervisor()
    spec = AgentSpec.of(agent)
    sid = new_id("sess")
    request = RunRequest(kind="run", prompt=TASK, session_id=sid)
    demo_model = model.startswith("demo:")
    _step(2, "submit a long research session", f"session [bold]{sid}[/]: \"{TASK}\"\n"
          + (f"{pace.passes} research passes (search / fetch_page / take_note) and a report; a checkpoint after "
             "every pass. The supervisor (a detached actor on the head) starts the session actor on a worker."
             if demo_model else "a real model decides the passes; a checkpoint after every pass."))
    ray_get(handle.submit.remote(spec, request.model_dump_json()))
    result_ref = handle.result.remote(sid, None)

    from loomray.cli_ray import _progress

    incarnations: list[dict[str, Any]] = []
    killed_at: float | None = None
    recovered_in: float | None = None
    kill_turn = None
    with _progress() as progress:
        bar = progress.add_task(f"{sid}", total=pace.passes + 1 if demo_model else None, info="starting")
        while True:
            ready, _ = ray.wait([result_ref], timeout=0.2)
            lines = _log_lines(log_path)
            calls = sum(1 for x in lines if x[0] == "model")
            if not incarnations or (killed_at is not None and len(incarnations) == 1 and recovered_in is not None):
                info = _actor_info(sid, timeout=2)
                if info is not None and all(i["pid"] != info["pid"] for i in incarnations):
                    incarnations.append(info)
            if killed_at is not None and recovered_in is None and store.current_epoch(sid) >= 2:
                recovered_in = time.monotonic() - killed_at
                progress.console.print(f"[green]recovered[/]: a new incarnation took the lease (epoch 2) "
                                       f"{recovered_in:.1f} s after the kill, restored the checkpoint of turn "
                                       f"{kill_turn} and carries on")
            here = _node_label(lc, incarnations[-1]["node_id"]) if incarnations else "?"
            progress.update(bar, completed=calls, info=f"{calls} model calls · on {here}")
            if ready:
                break
            if (killed_at is None and incarnations and calls >= pace.kill_after and lines
                    and lines[-1][0] == "fetch"):
                victim = lc.node_of(incarnations[0]["node_id"])
                if victim is not None and victim is not lc.head:
                    rows = store.list_checkpoints(sid, limit=1)
                    kill_turn = rows[0].turn if rows else 0
                    progress.console.print(
                        f"[bold red]killing {_node_label(lc, victim.node_id)}[/] (SIGKILL of its raylet) after "
                        f"{calls} model calls, while pass {calls}'s fetch_page is in flight")
                    killed_at = time.monotonic()
                    lc.remove_node(victim)
        progress.update(bar, total=calls, completed=calls)
    outcome = ray.get(result_ref)
    if outcome.status != "completed" or outcome.result_json is None:
        raise LoomrayRunError(f"the demo session ended {outcome.status}: {outcome.error}")
    result = RunResult.model_validate_json(outcome.result_json)
    _prove(store, sid, result, log_path, incarnations, lc, killed_at is not None)
    _forks(lc, store, handle, spec, sid, log_path, pace, demo_model)
    _query(store)
    runtime.close()
    return sid


def _prove(store: Any, sid: str, result: Any, log_path: str, incarnations: list[dict[str, Any]], lc: Any,
           killed: bool) -> None:
    from loomray.errors import LoomrayRunError

    lines = _log_lines(log_path)
    indices = [int(x[1]) for x in lines if x[0] == "model"]
    by_pid: dict[int, int] = {}
    for x in lines:
        if x[0] == "model":
            by_pid[int(x[2])] = by_pid.get(int(x[2]), 0) + 1
    journal: dict[int, int] = {}
    for run in store.journal_runs(sid):
        for e in store.journal_list(sid, run):
            if e.kind == "model":
                journal[e.epoch] = journal.get(e.epoch, 0) + 1
    table = Table(title="who called the model")
    for col in ("incarnation", "node", "lease epoch", "model calls (call log)", "model steps (journal)"):
        table.add_column(col)
    for n, info in enumerate(incarnations, start=1):
        table.add_row(str(n), _node_label(lc, info["node_id"]), str(n), str(by_pid.get(info["pid"], 0)),
                      str(journal.get(n, 0)))
    once = sorted(indices) == list(range(len(indices)))
    agree = sum(journal.values()) == len(indices) == result.turns
    body = (f"{result.turns} passes, {len(indices)} model calls in total; reply indices 0..{len(indices) - 1} "
            f"each served [bold]exactly once[/]; the last incarnation made {result.model_calls} of them and "
            "answered the rest from the checkpoint and the journal."
            if once and agree else "[bold red]a model call was repeated or lost[/]")
    if killed:
        body += ("\nThe fetch_page in flight when the node died ran again (tools are at-least-once); "
                 "the model call that asked for it did not.")
    _step(3, "the proof: no model call repeated", body)
    console.print(table)
    if not (once and agree):
        raise LoomrayRunError(f"model calls {sorted(indices)} vs journal {journal} vs turns {result.turns}")


def _forks(lc: Any, store: Any, handle: Any, spec: Any, sid: str, log_path: str, pace: Pace,
           demo_model: bool) -> None:
    import ray

    from loomray.cli_ray import _progress, ray_get
    from loomray.ids import new_id
    from loomray.records import RunResult
    from loomray.session import RunRequest

    rows = store.list_checkpoints(sid, limit=50)
    base = rows[1] if len(rows) > 1 else rows[0]  # the last one before the report was written
    _step(4, "fork three ways", f"From checkpoint {base.checkpoint_id} (turn {base.turn}, research done, report "
          "not yet written): one new session per follow-up prompt, one actor each, all at once.")
    requests = [RunRequest(kind="resume", prompt=p, session_id=new_id("sess"), from_checkpoint=base.checkpoint_id,
                           fork_of=sid) for p in FORK_PROMPTS]
    for r in requests:
        ray_get(handle.submit.remote(spec, r.model_dump_json()))
    refs = [handle.result.remote(r.session_id, None) for r in requests]
    nodes: dict[str, str] = {}
    with _progress() as progress:
        bars = [progress.add_task(f"fork {i + 1}: {r.prompt}", total=4 if demo_model else None, info="starting")
                for i, r in enumerate(requests)]
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.3)
            for r, b in zip(requests, bars, strict=False):
                if r.session_id not in nodes:
                    info = _actor_info(r.session_id, timeout=2)
                    if info is not None:
                        nodes[r.session_id] = _node_label(lc, info["node_id"])
                got = store.list_checkpoints(r.session_id, limit=1)
                done = got[0].turn - base.turn if got else 0
                progress.update(b, completed=done, info=f"+{done} passes · {nodes.get(r.session_id, '?')}")
        for b in bars:
            progress.update(b, total=1, completed=1)
    table = Table(title="forks")
    for col in ("fork", "node", "turns", "model calls", "the report's new last note"):
        table.add_column(col)
    for r, ref in zip(requests, refs, strict=False):
        outcome = ray.get(ref)
        if outcome.status != "completed":
            table.add_row(r.session_id, nodes.get(r.session_id, "?"), "-", "-",
                          f"[red]{outcome.status}: {outcome.error}[/]")
            continue
        res = RunResult.model_validate_json(outcome.result_json)
        notes = [ln for ln in res.output.splitlines() if ln[:1].isdigit() and ". " in ln[:5]]
        table.add_row(r.session_id, nodes.get(r.session_id, "?"), str(res.turns), str(res.model_calls),
                      (notes[-1] if notes else res.output.splitlines()[0])[:48])
    console.print(table)


_SQL = """select coalesce(forked_from, '-') as forked_from, session_id, count(*) as checkpoints,
       max(turn) as turns, max(input_tokens + output_tokens) as tokens,
       round(max(cost_usd), 4) as cost_usd, max(epoch) as max_epoch
from checkpoints group by all order by min(created_at)"""


def _query(store: Any) -> None:
    table = store.query()
    try:
        import duckdb
    except ImportError:  # DuckDB is the [query] extra; without it, Arrow's own group-by answers
        out = table.group_by("session_id").aggregate([("turn", "max"), ("checkpoint_id", "count")])
        sql = "(pyarrow group_by: DuckDB is not installed)"
    else:
        con = duckdb.connect()
        con.register("checkpoints", table)
        out = sql_to_arrow(con, _SQL)
        con.close()
        sql = _SQL
    _step(5, "query the Parquet index", f"{len(store.index_files())} index files, {table.num_rows} live checkpoint "
          f"rows, read straight from the store with DuckDB over Arrow:\n[dim]{sql}[/]")
    t = Table()
    for name in out.column_names:
        t.add_column(name)
    for row in out.to_pylist():
        t.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(t)
