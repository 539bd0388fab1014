"""Agents the Ray runtime tests run, importable by reference in every worker process.

Workers find this module through PYTHONPATH (the test module's cluster sets it).
Each agent's tool writes a marker file *before* it sleeps: the model step that
asked for the tool is journaled by then, so a node killed after a marker
appears must not cause that model call to be repeated. ``ScriptedModel``
appends one line per model call to ``model-calls`` (fsynced), so the count
survives the process that made the call.
"""

import asyncio
import os
from pathlib import Path

from loomray import Agent, Tuning
from loomray.models import ScriptedModel

ROOT = Path(os.environ.get("LOOMRAY_RAY_TEST_DIR", "/tmp/loomray-ray-test"))
TURNS = 8


def _slow_agent(name: str, step_s: float) -> Agent:
    workdir = ROOT / name
    workdir.mkdir(parents=True, exist_ok=True)

    async def slow_step(n: int) -> str:
        """One unit of slow work (stands in for a long tool call)."""
        (workdir / f"step-{n:02d}").write_text(str(os.getpid()))
        await asyncio.sleep(step_s)
        return f"step {n} done"

    script = [{"tool": "slow_step", "args": {"n": i}} for i in range(TURNS)] + [f"{name} finished"]
    model = ScriptedModel(script, counter_path=workdir / "model-calls")
    return Agent(f"{name} agent", model=model, tools=[slow_step], tuning=Tuning(checkpoint=True), name=name)


def model_calls(name: str) -> list[int]:
    """The reply indices ScriptedModel served for agent ``name``, across all processes."""
    path = ROOT / name / "model-calls"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def steps_started(name: str) -> int:
    return len(list((ROOT / name).glob("step-*")))


#: Killed mid-run by removing its node.
nodekill = _slow_agent("nodekill", 0.4)
#: Outlives a supervisor that is killed mid-run.
orphaned = _slow_agent("orphaned", 0.4)
#: Loses its actor and its supervisor at once; a new supervisor restarts it by reference.
adopted = _slow_agent("adopted", 0.4)
#: Loses its lease to an intruder mid-run.
fenced = _slow_agent("fenced", 0.4)
#: One quick answer per turn: the source and the forks of the fan-out test.
quick = Agent("quick agent", model=ScriptedModel([f"answer {i}" for i in range(4)]),
              tuning=Tuning(checkpoint=True), name="quick")
