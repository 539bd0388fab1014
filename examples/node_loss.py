"""Node loss: a session's node is killed mid-run; the supervisor continues it on another node.

    python examples/node_loss.py [DATA_DIR]

Starts a 3-node Ray cluster on this machine (127.0.0.1 only), runs a research
session on a worker node with ``RayRuntime``, SIGKILLs that node's raylet once
the session has checkpointed a few passes, and waits for the result. The
supervisor restarts the session from its latest checkpoint on a surviving
node under a new lease epoch; journaled steps replay, so no model call is
made twice. The transcript is compared with an uninterrupted in-process run.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time

from loomray import Agent, Tuning
from loomray.models.research import ResearchModel, research_tools
from loomray.runtime import InProcRuntime, RayRuntime
from loomray.testing.cluster import local_cluster  # first: pins Ray to 127.0.0.1

SESSION = "node-loss-demo"
PROMPT = "how Ray detects a lost node"


def build(runtime) -> Agent:
    # 0.3 s per model call stands in for an LLM's latency, so there is a "mid-run" to interrupt.
    return Agent("You are a careful researcher.", model=ResearchModel(delay=0.3), tools=research_tools(),
                 runtime=runtime, tuning=Tuning(checkpoint=True))


async def main(data_dir: str) -> int:
    with local_cluster(num_nodes=3, worker_resources={"loomray_session": 10}) as lc:
        # Sessions need the resource only workers have, so the session sits on a node we can lose.
        runtime = RayRuntime(data_dir, actor_options={"resources": {"loomray_session": 1}})
        agent = build(runtime)
        t0 = time.monotonic()
        run = asyncio.create_task(agent.run(PROMPT, session_id=SESSION))
        while not (rows := runtime.store.checkpoints.list(SESSION, limit=1)) or rows[0].turn < 3:
            await asyncio.sleep(0.05)
        where = {s["session_id"]: s for s in await runtime.status()}[SESSION]["node_id"]
        print(f"turn {rows[0].turn} checkpointed on node {where[:8]} after {time.monotonic() - t0:.1f}s; "
              f"killing that node (SIGKILL)")
        t_kill = time.monotonic()
        lc.remove_node(lc.node_of(where))
        result = await run
        status = {s["session_id"]: s for s in await runtime.status()}[SESSION]
        print(f"finished {time.monotonic() - t_kill:.1f}s after the kill on node {status['node_id'][:8]}: "
              f"{result.turns} passes, epoch {status['epoch']}, restarts {status['restarts']}")
        journal = runtime.store.journal.list(SESSION, runtime.store.sessions.get(SESSION).run_id)
        model_steps = [e.step_key for e in journal if e.kind == "model"]
        print(f"model calls journaled: {len(model_steps)} for {result.turns} passes; "
              f"each once: {len(set(model_steps)) == len(model_steps) == result.turns}")
        runtime.close()
    reference = await build(InProcRuntime()).run(PROMPT, session_id=SESSION)
    same = [m.model_dump() for m in result.messages] == [m.model_dump() for m in reference.messages]
    print(f"transcript equals an uninterrupted run: {same}")
    print(result.output.splitlines()[0])
    return 0 if same and status["restarts"] == 1 and len(model_steps) == result.turns else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(asyncio.run(main(tmp)))
