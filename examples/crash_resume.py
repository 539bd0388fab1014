"""Crash and resume: a process running a session is SIGKILLed mid-run; a new process finishes it.

    python examples/crash_resume.py [DATA_DIR]

The first child process kills itself (SIGKILL, no cleanup) right after the
model's 5th answer, before that pass's checkpoint. A second process re-issues
the same ``agent.run(prompt, session_id=...)``: it restores the latest
checkpoint, answers the already-paid model call from the journal, and
continues. The model is called once per pass across both processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile

from loomray import Agent, Tuning
from loomray.models.research import research_tools
from loomray.runtime import LocalRuntime

SESSION = "crash-demo"
PROMPT = "consistency models of object stores"


def build(data_dir: str) -> Agent:
    return Agent("You are a careful researcher.", model="demo:research", tools=research_tools(),
                 runtime=LocalRuntime(data_dir), tuning=Tuning(checkpoint=True))


def child(data_dir: str, crash: bool) -> None:
    calls_file = os.path.join(data_dir, "model_calls.txt")
    answers = {"n": 0}

    def emit(event) -> None:
        if event.type == "model_response" and not event.replayed:
            with open(calls_file, "a") as f:
                f.write(f"{event.turn}\n")
                f.flush()
                os.fsync(f.fileno())
            answers["n"] += 1
            if crash and answers["n"] == 5:
                os.kill(os.getpid(), signal.SIGKILL)  # the model answered; its pass never checkpointed

    result = asyncio.run(build(data_dir).run(PROMPT, session_id=SESSION, emit=emit))
    print(f"resumed_from_checkpoint={result.resumed_from_checkpoint} turns={result.turns} "
          f"new_model_calls={result.model_calls} replayed_steps={result.replayed_steps}")


def main(data_dir: str) -> None:
    script = os.path.abspath(__file__)
    first = subprocess.run([sys.executable, script, "--child", data_dir, "--crash"])
    print(f"first process exited with {first.returncode} (SIGKILL is {-signal.SIGKILL})")
    second = subprocess.run([sys.executable, script, "--child", data_dir], check=True)
    with open(os.path.join(data_dir, "model_calls.txt")) as f:
        turns = [int(x) for x in f.read().split()]
    ckpt = asyncio.run(build(data_dir).get_checkpoint(SESSION))
    print(f"model calls across both processes: {len(turns)} for {ckpt.turn} passes; "
          f"each pass billed once: {sorted(turns) == list(range(ckpt.turn))}")
    print(f"latest checkpoint: turn {ckpt.turn}, {ckpt.execution_status}")
    if sorted(turns) != list(range(ckpt.turn)) or ckpt.execution_status != "completed" or second.returncode:
        sys.exit(1)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(sys.argv[sys.argv.index("--child") + 1], crash="--crash" in sys.argv)
    elif len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
