"""A driver of the chaos checker in a process of its own, so that ``kill_driver`` is a real SIGKILL.

    python chaos_driver.py ADDRESS STORE PLACEMENT KIND SESSION

Connects to the cluster and builds the runtime the in-process drivers use
(:func:`chaos_scenario.runtime`), prints ``ready``, waits for a line on stdin
(the scenario starts every session at the same moment), then runs the session
and prints how its run ended. The checker kills it with SIGKILL mid-hand-off
or mid-wait: its Ray job ends with it, as when a user's laptop dies.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (str(HERE), str(HERE.parents[1])):
    if p not in sys.path:
        sys.path.insert(0, p)


async def drive(address: str, store: str, placement: str, kind: str, session_id: str) -> str:
    """Run ``session_id`` once told to; how its run ended (the run's own failure is an answer too)."""
    from loomray.runtime.connection import apply_ray_env_defaults, connect

    apply_ray_env_defaults()  # before Ray is imported: bind to 127.0.0.1 like the rest of the cluster
    from chaos_scenario import driver_agent, runtime

    rt = runtime(placement, store, address=address)
    await asyncio.to_thread(connect, address)
    await asyncio.to_thread(rt.supervisor)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    try:
        result = await driver_agent(kind, rt).run(session_id, session_id=session_id)
    except Exception as e:
        return f"raised {type(e).__name__}"
    return f"returned {result.stop_reason}"


def main(argv: list[str]) -> int:
    print(asyncio.run(drive(*argv)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
