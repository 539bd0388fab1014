"""Agents the Ray runtime tests run, importable by reference in every worker process.

Workers find this module through PYTHONPATH (the test module's cluster sets it).
Each agent's tool writes a marker file *before* it sleeps: the model step that
asked for the tool is journaled by then, so a node killed after a marker
appears must not cause that model call to be repeated. ``ScriptedModel``
appends one line per model call to ``model-calls`` (fsynced), so the count
survives the process that made the call.

A tool step holds while the file ``hold`` exists in the agent's directory
(writing ``holding-{pid}`` first and ``released-{pid}`` after): the zombie test
freezes an incarnation mid-step with it, deterministically.
"""

import asyncio
import os
import time
import uuid
from pathlib import Path

from loomray import Agent, CheckpointConfig, Tool, Tuning, tool
from loomray.models import ScriptedModel

ROOT = Path(os.environ.get("LOOMRAY_RAY_TEST_DIR", "/tmp/loomray-ray-test"))
TURNS = 8


def make(name: str, step_s: float = 0.4, *, counted: bool = True) -> Agent:
    """The slow agent ``name``: TURNS tool passes of ``step_s`` seconds, then a final answer.

    ``counted=False`` builds the same agent (same transcript) without the call
    log and with its markers in a separate directory: an uninterrupted reference run.
    """
    workdir = ROOT / (name if counted else f"{name}-reference")
    workdir.mkdir(parents=True, exist_ok=True)

    async def slow_step(n: int) -> str:
        """One unit of slow work (stands in for a long tool call)."""
        pid = os.getpid()
        (workdir / f"step-{n:02d}").write_text(str(pid))
        if (workdir / "hold").exists():
            (workdir / f"holding-{pid}").write_text(str(n))
            deadline = time.monotonic() + 120
            while (workdir / "hold").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            (workdir / f"released-{pid}").write_text(str(n))
        await asyncio.sleep(step_s)
        return f"step {n} done"

    script = [{"tool": "slow_step", "args": {"n": i}} for i in range(TURNS)] + [f"{name} finished"]
    model = ScriptedModel(script, counter_path=(workdir / "model-calls") if counted else None)
    return Agent(f"{name} agent", model=model, tools=[slow_step], tuning=Tuning(checkpoint=True), name=name)


def model_calls(name: str) -> list[int]:
    """The reply indices ScriptedModel served for agent ``name``, across all processes."""
    path = ROOT / name / "model-calls"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def steps_started(name: str) -> int:
    return len(list((ROOT / name).glob("step-*")))


def pids_with(name: str, prefix: str) -> set[int]:
    """Pids that left ``{prefix}-{pid}`` markers (``holding``, ``released``) in agent ``name``'s directory."""
    return {int(p.name.rsplit("-", 1)[1]) for p in (ROOT / name).glob(f"{prefix}-*")}


def fork_agent(name: str, work_s: float) -> Agent:
    """Answers the source run at once; each fork runs one ``work`` tool call, recording its interval."""
    workdir = ROOT / name
    workdir.mkdir(parents=True, exist_ok=True)

    async def work() -> str:
        """Slow work that records when it ran (start and end, wall clock)."""
        start = time.time()
        await asyncio.sleep(work_s)
        (workdir / f"interval-{uuid.uuid4().hex}").write_text(f"{start} {time.time()}")
        return "worked"

    model = ScriptedModel(["source ready", {"tool": "work", "args": {}}, "fork done"])
    return Agent("fork agent", model=model, tools=[work], tuning=Tuning(checkpoint=True), name=name)


def max_overlap(name: str) -> int:
    """The most ``work`` intervals of agent ``name`` that ran at the same instant."""
    edges = []
    for p in (ROOT / name).glob("interval-*"):
        start, end = map(float, p.read_text().split())
        edges += [(start, 1), (end, -1)]
    running = peak = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        running += step
        peak = max(peak, running)
    return peak


#: Killed mid-run by removing its node.
nodekill = make("nodekill")
#: Outlives a supervisor that is killed mid-run.
orphaned = make("orphaned")
#: Loses its actor and its supervisor at once; a new supervisor restarts it by reference.
adopted = make("adopted")
#: Ends while no supervisor lives (its supervisor killed mid-run, the replacement held back).
unwatched = make("unwatched", 0.2)
#: Waited on for longer than the driver waits for a re-adoption, then its supervisor is killed.
outwaited = make("outwaited", 0.3)
#: Loses its lease to an intruder mid-run.
fenced = make("fenced")
#: Its node is frozen (raylet SIGSTOP) mid-step: the frozen incarnation becomes a zombie.
zombie = make("zombie", 0.2)
#: Its whole cluster is shut down mid-run (while it holds in a step); a new cluster's supervisor finishes it.
restart = make("restart", 0.2)
#: Streams its events to the driver.
streamed = make("streamed", 0.0)
# The command-line tests' two stores: a session in each, submitted with --resources.
placed_a = make("placed_a", 0.1)
placed_b = make("placed_b", 0.1)
#: One quick answer per turn: the source and the forks of the fan-out test.
quick = Agent("quick agent", model=ScriptedModel([f"answer {i}" for i in range(4)]),
              tuning=Tuning(checkpoint=True), name="quick")
#: Forks whose concurrency the bound test observes.
bounded = fork_agent("bounded", 1.5)

#: The same agents for the dense-placement runs of the same tests, each with its own call log.
nodekill_dense = make("nodekill_dense")
orphaned_dense = make("orphaned_dense")
adopted_dense = make("adopted_dense")
unwatched_dense = make("unwatched_dense", 0.2)
fenced_dense = make("fenced_dense")
zombie_dense = make("zombie_dense", 0.2)
restart_dense = make("restart_dense", 0.5)
streamed_dense = make("streamed_dense", 0.0)


def isolation_agent(kind: str) -> Agent:
    """Sessions that share one dense host in the isolation test.

    ``blocking`` holds a thread in a sync tool until the file ``release``
    exists (leaving a ``blocked-*`` marker first); ``failing``'s model raises
    on its second call; ``quick`` runs five quick tool passes.
    """
    workdir = ROOT / "isolation"
    workdir.mkdir(parents=True, exist_ok=True)

    def block() -> str:
        """Blocks its thread (a sync tool, so it runs off the host's event loop)."""
        (workdir / f"blocked-{uuid.uuid4().hex}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not (workdir / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "unblocked"

    def noop() -> str:
        """Returns at once."""
        return "ok"

    def boom(request):
        raise RuntimeError("boom: this session's own failure")

    script: list = {
        "blocking": [{"tool": "block", "args": {}}, "blocking done"],
        "failing": [{"tool": "noop", "args": {}}, boom],
        "quick": [{"tool": "noop", "args": {}}] * 5 + ["quick done"],
    }[kind]
    return Agent(f"{kind} agent", model=ScriptedModel(script), tools=[block, noop], tuning=Tuning(checkpoint=True),
                 name=f"iso-{kind}")


def steered(name: str, script: list, position: str = "after_tools", **tuning) -> Agent:
    """An agent to steer on the cluster: ``transfer`` needs approval; ``hold`` runs while the file ``hold`` exists.

    Both leave files in the agent's directory: ``transfer-*`` per run of the transfer, ``held-*`` when
    ``hold`` starts and ``done-*`` when it returns, so tests count effects across processes and nodes.
    """
    workdir = ROOT / name
    workdir.mkdir(parents=True, exist_ok=True)

    @tool(requires_approval=True)
    def transfer(amount: int) -> str:
        """Move money (a person approves each call)."""
        (workdir / f"transfer-{uuid.uuid4().hex}").write_text(str(amount))
        return f"moved {amount}"

    async def hold(key: str) -> str:
        """Slow work that lasts while the file ``hold`` exists."""
        (workdir / f"held-{uuid.uuid4().hex}").write_text(key)
        deadline = time.monotonic() + 60
        while (workdir / "hold").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        (workdir / f"done-{uuid.uuid4().hex}").write_text(key)
        return f"held {key}"

    model = ScriptedModel(script, counter_path=workdir / "model-calls")
    return Agent(f"{name} agent", model=model, tools=[transfer, hold], name=name,
                 tuning=Tuning(checkpoint=CheckpointConfig(position=position), **tuning))


def files(name: str, prefix: str) -> int:
    """How many ``{prefix}-*`` marker files agent ``name`` left."""
    return len(list((ROOT / name).glob(f"{prefix}-*")))


#: Stops for approval, then (approved) finishes; (denied) tells the model.
approve = steered("approve", [{"tool": "transfer", "args": {"amount": 5}}, "transfer settled"])
approve_dense = steered("approve_dense", [{"tool": "transfer", "args": {"amount": 5}}, "transfer settled"])
deny = steered("deny", [{"tool": "transfer", "args": {"amount": 9}}, "transfer refused"])
#: A signal sent while ``hold`` runs arrives at the next pass boundary, before the second model call.
signalled = steered("signalled", [{"tool": "hold", "args": {"key": "a"}}, "heard you"])
#: Cancelled while ``hold`` runs.
cancelled, cancelled_dense = (
    steered(name, [{"tool": "hold", "args": {"key": "a"}}, {"tool": "hold", "args": {"key": "b"}}, "never reached"],
            position="both", durability="async") for name in ("cancelled", "cancelled_dense"))


def priced(name: str, **tuning) -> Agent:
    """Four priced lookup passes and a report; every call costs what its transcript costs (``price_per_mtok``)."""
    workdir = ROOT / name
    workdir.mkdir(parents=True, exist_ok=True)

    def lookup(key: str) -> str:
        """Look something up."""
        (workdir / f"lookup-{uuid.uuid4().hex}").write_text(key)
        return f"value of {key} " * 20

    script = [{"tool": "lookup", "args": {"key": f"k{i}"}} for i in range(4)] + ["report: done"]
    model = ScriptedModel(script, counter_path=workdir / "model-calls", price_per_mtok=1000.0)
    return Agent(f"{name} agent", model=model, tools=[lookup], name=name, tuning=Tuning(checkpoint=True, **tuning))


#: The same agent, once with a token limit the first call reaches and once without.
budget_low = priced("budget", max_tokens=1)
budget_high = priced("budget")
#: A fork tree's spend.
spend = priced("spend")


def instructed(request) -> str:
    """A final answer that names the instructions the model was given (the transcript's system message)."""
    system = [m.content for m in request.messages if m.role == "system"]
    return f"finished under: {system[0] if system else '-'}"


def variant_parts(name: str, step_s: float = 0.4) -> tuple[Agent, ScriptedModel]:
    """A base agent that answers its source run at once, and the model of a variant that forks it: TURNS slow
    tool passes (replies 1..TURNS, after the source's one answer), then :func:`instructed`. Each model logs its
    calls to its own file (``{name}`` and ``{name}-variant``)."""
    base = make(name, step_s)
    base.model = ScriptedModel(["source ready"], name="base-model", counter_path=ROOT / name / "model-calls")
    workdir = ROOT / f"{name}-variant"
    workdir.mkdir(parents=True, exist_ok=True)
    script = ["-", *({"tool": "slow_step", "args": {"n": i}} for i in range(TURNS)), instructed]
    return base, ScriptedModel(script, name="variant-model", counter_path=workdir / "model-calls")


#: A variant fork whose node is removed mid-run (per placement).
variant_kill, variant_kill_model = variant_parts("variant_kill")
variant_kill_dense, variant_kill_dense_model = variant_parts("variant_kill_dense")


def instructed_with_tools(request) -> str:
    """:func:`instructed`, plus the tools the model was offered."""
    return f"{instructed(request)}; tools: {','.join(sorted(t['name'] for t in request.tools))}"


def adoptable(name: str) -> Agent:
    """A base agent whose variant fork loses its actor and its supervisor at once: TURNS slow passes after the
    source's answer, then :func:`instructed_with_tools`. Importable by reference (``ray_agents:{name}``), so a
    new supervisor rebuilds the fork's agent from the reference and the variant the fork's run record stores."""
    base = make(name, 0.4)

    def spare() -> str:
        """A tool the variant leaves out."""
        return "spare"

    script = ["source ready", *({"tool": "slow_step", "args": {"n": i}} for i in range(TURNS)), instructed_with_tools]
    base.model = ScriptedModel(script, name="base-model", counter_path=ROOT / name / "model-calls")
    base.tools = {**base.tools, "spare": Tool(spare)}
    return base


variant_adopt = adoptable("variant_adopt")
variant_adopt_dense = adoptable("variant_adopt_dense")
