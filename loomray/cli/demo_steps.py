"""The steps of ``loomray demo`` (see :mod:`loomray.cli.demo`): each one runs, then tells what happened.

Ray is imported by the functions that use it: importing this module (every
``loomray`` command does) must stay cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.panel import Panel
from rich.progress import Progress
from rich.table import Table

from loomray.agent import Agent
from loomray.cli.common import console, sql_to_arrow
from loomray.cli.demo_agent import Pace
from loomray.cli.demo_steer import steer, story
from loomray.cli.progress import run_progress
from loomray.cli.ray_access import ray_get
from loomray.errors import LoomrayRunError
from loomray.ids import new_id
from loomray.records import RunResult
from loomray.run_request import RunRequest
from loomray.runtime.connection import NAMESPACE
from loomray.storage import Store, open_store

if TYPE_CHECKING:  # pragma: no cover - the cluster helper imports Ray
    from loomray.testing.cluster import LocalCluster

TASK = "Durable checkpointing for long-running LLM agents on a Ray cluster"
FORK_PROMPTS = (
    "Add a section on costs.",
    "Add a section on failure modes in production.",
    "Add a section on security and tenancy.",
)


def _log_lines(path: str) -> list[list[str]]:
    try:
        return [line.split() for line in Path(path).read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


def _step(n: int, title: str, body: str) -> None:
    console.print()
    console.print(Panel(body, title=f"[bold]step {n}[/] · {title}", title_align="left", border_style="cyan"))


def _actor_info(store_url: str, session_id: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """Where the session's current incarnation runs, or None while there is none."""
    import ray

    from loomray.runtime.actors import session_actor_name

    try:
        handle = ray.get_actor(session_actor_name(store_url, session_id), namespace=NAMESPACE)
        return ray.get(handle.info.remote(), timeout=timeout)
    except Exception:  # gone, dying, or not yet created: the caller asks again later
        return None


def _node_label(lc: LocalCluster, node_id: str | None) -> str:
    if node_id is None:
        return "?"
    for i, n in enumerate(lc.nodes + lc.removed):
        if n.node_id == node_id:
            index = lc.node_index(node_id)
            return f"{'head' if n is lc.head else 'worker'}-{i if index is None else index} ({node_id[:8]})"
    return node_id[:8]


@contextlib.contextmanager
def _quiet_node_deaths() -> Iterator[None]:
    """Drop Ray's multi-screen "raylet terminated" dumps from the driver; the demo reports the kill itself.

    Ray prints them from a background thread through ``print_to_stdstream``;
    the patch is undone when the demo ends. Other Ray errors still print.
    """
    try:
        import ray._private.worker as worker  # noqa: PLC2701 - Ray has no public hook for this output
    except ImportError:  # pragma: no cover - a Ray without this internal: keep its output
        yield
        return
    original = worker.print_to_stdstream

    def filtered(data: dict[str, Any], ignore_prefix: bool) -> None:
        text = " ".join(str(x) for x in data.get("lines", ()))
        if data.get("pid") == "raylet" and ("marked dead" in text or "Raylet is terminated" in text):
            return
        original(data, ignore_prefix)

    worker.print_to_stdstream = filtered
    try:
        yield
    finally:
        worker.print_to_stdstream = original


def run_demo(agent: Agent, store_url: str, log_path: str, *, pace: Pace, nodes: int, model: str) -> str:
    """Steps 1-7 of the demo; returns the main session id. The cluster is gone on return."""
    from loomray.testing.cluster import local_cluster  # imports Ray

    t0 = time.monotonic()
    logging.getLogger("ray").setLevel(logging.WARNING)  # Ray's INFO lines would interleave with the story
    with _quiet_node_deaths(), contextlib.ExitStack() as cluster:
        with console.status(f"starting a {nodes}-node Ray cluster on 127.0.0.1 ..."):
            lc = cluster.enter_context(local_cluster(
                num_nodes=nodes, worker_resources={"loomray_session": 100},
                init_kwargs={"log_to_driver": False, "logging_level": logging.WARNING}))
        _show_cluster(lc, time.monotonic() - t0)
        sid = _DemoRun(lc, agent, store_url, log_path, pace, model.startswith("demo:")).run()
        with console.status("stopping the cluster ..."):
            cluster.close()
    _step(7, "cleanup", "cluster stopped, every process it started is gone"
          + (f" ([red]{len(lc.leftover)} had to be killed[/])" if lc.leftover else "") + ".")
    return sid


def _show_cluster(lc: LocalCluster, took_s: float) -> None:
    table = Table("node", "id", "address", "runs sessions", title=f"cluster up in {took_s:.1f} s")
    for n in lc.nodes:
        table.add_row(_node_label(lc, n.node_id).split(" ")[0], n.node_id[:16], lc.address.split(":")[0],
                      "no (supervisor)" if n is lc.head else "yes")
    _step(1, "a Ray cluster on this machine", "Head + workers, all bound to 127.0.0.1. Session actors need "
          "the resource [bold]loomray_session[/], which only workers have, so losing a worker loses a session.")
    console.print(table)


@dataclass
class _Watch:
    """What the demo saw of its main session: where each incarnation ran, the kill, the recovery."""

    incarnations: list[dict[str, Any]] = field(default_factory=list)
    killed_at: float | None = None
    recovered_in: float | None = None
    kill_turn: int = 0


class _DemoRun:
    """Steps 2-6 on a running cluster: the main session, the kill, the proof, the forks, steering, the query."""

    def __init__(self, lc: LocalCluster, agent: Agent, store_url: str, log_path: str, pace: Pace,
                 demo_model: bool) -> None:
        from loomray.runtime.actors import AgentSpec  # imports Ray
        from loomray.runtime.ray_runtime import RayRuntime

        self.lc, self.log_path, self.pace, self.demo_model = lc, log_path, pace, demo_model
        self.runtime = RayRuntime(store_url, actor_options={"resources": {"loomray_session": 1}})
        self.store = open_store(store_url)  # for reads the runtime's store does not offer (the index, epochs)
        self.supervisor = self.runtime.supervisor()
        self.spec = AgentSpec.of(agent)

    def run(self) -> str:
        sid = new_id("sess")
        _step(2, "submit a long research session", f"session [bold]{sid}[/]: \"{TASK}\"\n"
              + (f"{self.pace.passes} research passes (search / fetch_page / take_note) and a report; a checkpoint "
                 "after every pass. The supervisor (a detached actor on the head) starts the session actor on a "
                 "worker." if self.demo_model else "a real model decides the passes; a checkpoint after every pass."))
        request = RunRequest(kind="run", prompt=TASK, session_id=sid)
        ray_get(self.supervisor.submit.remote(self.spec, request.model_dump_json()))
        result_ref = self.supervisor.result.remote(sid, None)
        watch = self._follow(sid, result_ref)
        outcome = ray_get(result_ref)
        if outcome.status != "completed" or outcome.result_json is None:
            raise LoomrayRunError(f"the demo session ended {outcome.status}: {outcome.error}")
        result = RunResult.model_validate_json(outcome.result_json)
        self._prove(sid, result, watch)
        self._forks(sid)
        self._steer()
        _query(self.store)
        self.store.close()
        self.runtime.close()
        return sid

    def _follow(self, sid: str, result_ref: Any) -> _Watch:
        """Show the main session's model calls until it ends; kill its node once, mid-run, during a fetch_page."""
        import ray

        watch = _Watch()
        with run_progress() as progress:
            bar = progress.add_task(f"{sid}", total=self.pace.passes + 1 if self.demo_model else None, info="starting")
            while True:
                ready, _ = ray.wait([result_ref], timeout=0.2)
                lines = _log_lines(self.log_path)
                calls = sum(1 for x in lines if x[0] == "model")
                self._note_incarnation(sid, watch, progress)
                here = _node_label(self.lc, watch.incarnations[-1]["node_id"]) if watch.incarnations else "?"
                progress.update(bar, completed=calls, info=f"{calls} model calls · on {here}")
                if ready:
                    break
                if (watch.killed_at is None and watch.incarnations and calls >= self.pace.kill_after and lines
                        and lines[-1][0] == "fetch"):
                    self._kill_node(sid, watch, calls, progress)
            progress.update(bar, total=calls, completed=calls)
        return watch

    def _note_incarnation(self, sid: str, watch: _Watch, progress: Progress) -> None:
        """Record where the first incarnation runs, and, after the kill, the one that took over."""
        if not watch.incarnations or (watch.killed_at is not None and len(watch.incarnations) == 1
                                      and watch.recovered_in is not None):
            info = _actor_info(self.runtime.config.store_url, sid, timeout=2)
            if info is not None and all(i["pid"] != info["pid"] for i in watch.incarnations):
                watch.incarnations.append(info)
        if watch.killed_at is not None and watch.recovered_in is None and self.store.leases.current_epoch(sid) >= 2:
            watch.recovered_in = time.monotonic() - watch.killed_at
            progress.console.print(f"[green]recovered[/]: a new incarnation took the lease (epoch 2) "
                                   f"{watch.recovered_in:.1f} s after the kill, restored the checkpoint of turn "
                                   f"{watch.kill_turn} and carries on")

    def _kill_node(self, sid: str, watch: _Watch, calls: int, progress: Progress) -> None:
        victim = self.lc.node_of(watch.incarnations[0]["node_id"])
        if victim is None or victim is self.lc.head:
            return
        rows = self.store.checkpoints.list(sid, limit=1)
        watch.kill_turn = rows[0].turn if rows else 0
        progress.console.print(
            f"[bold red]killing {_node_label(self.lc, victim.node_id)}[/] (SIGKILL of its raylet) after "
            f"{calls} model calls, while pass {calls}'s fetch_page is in flight")
        watch.killed_at = time.monotonic()
        self.lc.remove_node(victim)

    def _prove(self, sid: str, result: RunResult, watch: _Watch) -> None:
        lines = _log_lines(self.log_path)
        indices = [int(x[1]) for x in lines if x[0] == "model"]
        by_pid = Counter(int(x[2]) for x in lines if x[0] == "model")
        journal = Counter(e.epoch for run in self.store.journal.runs(sid) for e in self.store.journal.list(sid, run)
                          if e.kind == "model")
        table = Table("incarnation", "node", "lease epoch", "model calls (call log)", "model steps (journal)",
                      title="who called the model")
        for n, info in enumerate(watch.incarnations, start=1):
            table.add_row(str(n), _node_label(self.lc, info["node_id"]), str(n), str(by_pid.get(info["pid"], 0)),
                          str(journal.get(n, 0)))
        once = sorted(indices) == list(range(len(indices)))
        agree = sum(journal.values()) == len(indices) == result.turns
        body = (f"{result.turns} passes, {len(indices)} model calls in total; reply indices 0..{len(indices) - 1} "
                f"each served [bold]exactly once[/]; the last incarnation made {result.model_calls} of them and "
                "answered the rest from the checkpoint and the journal."
                if once and agree else "[bold red]a model call was repeated or lost[/]")
        if watch.killed_at is not None:
            body += ("\nThe fetch_page in flight when the node died ran again (tools are at-least-once); "
                     "the model call that asked for it did not.")
        _step(3, "the proof: no model call repeated", body)
        console.print(table)
        if not (once and agree):
            raise LoomrayRunError(f"model calls {sorted(indices)} vs journal {dict(journal)} vs turns {result.turns}")

    def _forks(self, sid: str) -> None:
        rows = self.store.checkpoints.list(sid, limit=50)
        base = rows[1] if len(rows) > 1 else rows[0]  # the last one before the report was written
        _step(4, "fork three ways", f"From checkpoint {base.checkpoint_id} (turn {base.turn}, research done, "
              "report not yet written): one new session per follow-up prompt, one actor each, all at once.")
        requests = [RunRequest(kind="resume", prompt=p, session_id=new_id("sess"),
                               from_checkpoint=base.checkpoint_id, fork_of=sid) for p in FORK_PROMPTS]
        for r in requests:
            ray_get(self.supervisor.submit.remote(self.spec, r.model_dump_json()))
        refs = [self.supervisor.result.remote(r.session_id, None) for r in requests]
        nodes = self._follow_forks(requests, refs, base.turn)
        table = Table("fork", "node", "turns", "model calls", "the report's new last note", title="forks")
        for r, ref in zip(requests, refs, strict=False):
            outcome = ray_get(ref)
            where = nodes.get(r.session_id, "?")
            if outcome.status != "completed":
                table.add_row(r.session_id, where, "-", "-", f"[red]{outcome.status}: {outcome.error}[/]")
                continue
            res = RunResult.model_validate_json(outcome.result_json)
            notes = [ln for ln in res.output.splitlines() if ln[:1].isdigit() and ". " in ln[:5]]
            table.add_row(r.session_id, where, str(res.turns), str(res.model_calls),
                          (notes[-1] if notes else res.output.splitlines()[0])[:48])
        console.print(table)

    def _steer(self) -> None:
        """Step 5: a signal to a running session, then an approval it waits for (see loomray.cli.demo_steer)."""
        with console.status("steering a publishing session: a signal, then an approval ..."):
            sid, _, done = asyncio.run(steer(self.runtime, self.log_path, self.pace.fetch_s))
        body, table = story(sid, done, self.log_path)
        _step(5, "steer a running session", body)
        console.print(table)

    def _follow_forks(self, requests: list[RunRequest], refs: list[Any], base_turn: int) -> dict[str, str]:
        """Show each fork's passes until all end; returns the node each ran on, by session id."""
        import ray

        nodes: dict[str, str] = {}
        with run_progress() as progress:
            bars = [progress.add_task(f"fork {i + 1}: {r.prompt}", total=4 if self.demo_model else None,
                                      info="starting") for i, r in enumerate(requests)]
            pending = list(refs)
            while pending:
                _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.3)
                for r, b in zip(requests, bars, strict=False):
                    if r.session_id not in nodes:
                        info = _actor_info(self.runtime.config.store_url, r.session_id, timeout=2)
                        if info is not None:
                            nodes[r.session_id] = _node_label(self.lc, info["node_id"])
                    got = self.store.checkpoints.list(r.session_id, limit=1)
                    done = got[0].turn - base_turn if got else 0
                    progress.update(b, completed=done, info=f"+{done} passes · {nodes.get(r.session_id, '?')}")
            for b in bars:
                progress.update(b, total=1, completed=1)
        return nodes


_SQL = """select coalesce(forked_from, '-') as forked_from, session_id, count(*) as checkpoints,
       max(turn) as turns, max(input_tokens + output_tokens) as tokens,
       round(max(cost_usd), 4) as cost_usd, max(epoch) as max_epoch
from checkpoints group by all order by min(created_at)"""


def _query(store: Store) -> None:
    table = store.query()
    try:
        import duckdb  # optional: the [query] extra
    except ImportError:  # without it, Arrow's own group-by answers
        out = table.group_by("session_id").aggregate([("turn", "max"), ("checkpoint_id", "count")])
        sql = "(pyarrow group_by: DuckDB is not installed)"
    else:
        con = duckdb.connect()
        con.register("checkpoints", table)
        out = sql_to_arrow(con, _SQL)
        con.close()
        sql = _SQL
    _step(6, "query the Parquet index", f"{len(store.index_files())} index files, {table.num_rows} live checkpoint "
          f"rows, read straight from the store with DuckDB over Arrow:\n[dim]{sql}[/]")
    t = Table(*out.column_names)
    for row in out.to_pylist():
        t.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(t)
