"""Quick start: a checkpointed research session, resumed and forked (offline, no API key).

    python examples/quickstart.py [DATA_DIR]

Uses the offline ``demo:research`` model and its tools; swap in
``model="claude-opus-4-7"`` and your own tools for real work.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile

from loomray import Agent, Tuning
from loomray.models.research import research_tools
from loomray.runtime import LocalRuntime


async def main(data_dir: str) -> None:
    agent = Agent(
        "You are a careful researcher. Search, read, take notes, then report.",
        model="demo:research",
        tools=research_tools(),
        runtime=LocalRuntime(data_dir, max_checkpoints_per_session=20),
        tuning=Tuning(checkpoint=True),
    )

    result = await agent.run("durable agent sessions on Ray", session_id="research-2026-07-04")
    print(f"run:    {result.turns} passes, {result.model_calls} model calls, ${result.usage.cost_usd:.4f}")
    print(result.output.splitlines()[0])

    # Later (or after a crash): continue in place. Restored turns are not re-billed.
    more = await agent.resume("Add a section on costs.", session_id="research-2026-07-04")
    print(f"resume: {more.turns} passes in total, {more.model_calls} new model calls, "
          f"resumed_from_checkpoint={more.resumed_from_checkpoint}")

    metas = await agent.list_checkpoints("research-2026-07-04")  # newest first, no payload
    for m in metas[:3]:
        print(f"  {m.checkpoint_id}  turn={m.turn:<3} {m.execution_status}")

    older = metas[-1]  # newest first => last is the earliest kept
    fork = await agent.resume("Try a different approach from here.", session_id="research-2026-07-04",
                              from_checkpoint=older.checkpoint_id)
    print(f"fork:   new session {fork.session_id} forked from {fork.forked_from} at turn {older.turn}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        asyncio.run(main(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(main(tmp))
