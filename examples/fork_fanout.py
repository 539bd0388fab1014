"""Fan-out: fork a research session from an earlier checkpoint into parallel actors.

    python examples/fork_fanout.py [DATA_DIR]

Runs a research session on a local 2-node Ray cluster (127.0.0.1 only), then
forks it from its 3rd checkpoint with four different follow-up prompts. Each
fork is a new session (its own id, ``forked_from`` the original) running in
its own actor, at most ``max_concurrent_forks`` at once; progress is printed
as the supervisor reports it. The original session is left untouched.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

from loomray import Agent, Tuning
from loomray.models.research import ResearchModel, research_tools
from loomray.runtime import RayRuntime
from loomray.testing.cluster import local_cluster  # first: pins Ray to 127.0.0.1

SESSION = "fanout-demo"
PROMPTS = ["Focus on costs.", "Focus on latency.", "Focus on failure modes.", "Focus on operations."]


def progress(p: dict) -> None:
    print(f"  forks: {p['queued']} queued, {p['running']} running, {p['completed']} done, {p['failed']} failed")


async def main(data_dir: str) -> int:
    with local_cluster(num_nodes=2):
        runtime = RayRuntime(data_dir, max_concurrent_forks=2, on_fork_progress=progress)
        agent = Agent("You are a careful researcher.", model=ResearchModel(passes=6, delay=0.05),
                      tools=research_tools(), runtime=runtime, tuning=Tuning(checkpoint=True))
        base = await agent.run("checkpoint stores for agents", session_id=SESSION)
        metas = await agent.list_checkpoints(SESSION)
        before = [m.checkpoint_id for m in metas]
        third = next(m for m in metas if m.turn == 3)
        print(f"original: {base.turns} passes, {len(metas)} checkpoints; forking from turn {third.turn} "
              f"({third.checkpoint_id})")
        forks = await agent.fork(SESSION, from_checkpoint=third.checkpoint_id, prompts=PROMPTS)
        for prompt, f in zip(PROMPTS, forks, strict=False):
            ckpt = await agent.get_checkpoint(f.session_id)
            print(f"{f.session_id}  forked_from={ckpt.forked_from}  turns={f.turns}  {prompt!r}")
        untouched = [m.checkpoint_id for m in await agent.list_checkpoints(SESSION)] == before
        print(f"{len({f.session_id for f in forks})} forks, original untouched: {untouched}")
        runtime.close()
    ok = untouched and len(forks) == len(PROMPTS) and all(f.turns > third.turn for f in forks)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(sys.argv[1])))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(asyncio.run(main(tmp)))
