"""A driver process for the kill test: explores session ``base`` on a LocalRuntime, and may SIGKILL itself.

    python explore_child.py DATA_DIR EXPLORATION_ID OUT_JSON [kill | killjudge]

Three rounds (keep 1) of the variants ``short1``, ``short2`` and ``long``
(which wins every round); a :class:`~loomray.ModelJudge` scores each branch.
Both models are ScriptedModels whose file-backed counters (``DATA_DIR/model_calls``,
``DATA_DIR/judge_calls``) survive the kill. With ``kill``, the round-2 ``long``
branch's second model call waits until its two siblings finished, then kills
the process: the exploration dies mid-round, with branches finished, one
running, and nothing judged yet in that round. With ``killjudge``, the process kills
itself inside the judge's first model call (once per DATA_DIR): the judge's
call is in flight, its answer not journaled.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

from explore_agents import reply, step, variant

from loomray import Agent, ModelJudge, Tuning
from loomray.models import ScriptedModel
from loomray.runtime import LocalRuntime

VARIANTS = [variant("short1", 0.3), variant("short2", 0.5), variant("long", 0.9, 2)]


def main(data_dir: str, exploration_id: str, out: str, kill: bool, kill_judge: bool = False) -> None:
    runtime = LocalRuntime(Path(data_dir) / "store")
    store = runtime.store

    async def answer(request):
        messages = request.messages
        longs = [m for m in messages if m.role == "user" and m.content.startswith("variant long")]
        after = len(messages) - 1 - max(i for i, m in enumerate(messages) if m.role == "user")
        if kill and len(longs) == 2 and after == 2:  # round 2's long branch, about to make its second call
            siblings = [f"{exploration_id}-r2-000", f"{exploration_id}-r2-001"]
            deadline = time.monotonic() + 60
            while not all((rows := store.checkpoints.list(s, limit=1)) and rows[0].execution_status == "completed"
                          for s in siblings):
                if time.monotonic() > deadline:
                    raise TimeoutError("the siblings never finished")
                await asyncio.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        return reply(messages)

    model = ScriptedModel([answer] * 20, counter_path=Path(data_dir) / "model_calls")
    def verdict(request):
        marker = Path(data_dir) / "judge_killed"
        if kill_judge and not marker.exists():
            marker.write_text("killed in the judge's call")
            os.kill(os.getpid(), signal.SIGKILL)
        return json.dumps({"score": float(re.findall(r"q=([\d.]+)", request.messages[-1].content)[-1]), "reasons": "q"})

    judge_model = ScriptedModel([verdict] * 2, counter_path=Path(data_dir) / "judge_calls")
    agent = Agent("You explore.", model=model, tools=[step], runtime=runtime, tuning=Tuning(checkpoint=True))
    if not store.checkpoints.list("base", limit=1):
        agent.run_sync("task", session_id="base")
    result = agent.explore_sync("base", variants=VARIANTS, judge=ModelJudge(judge_model, "Score by quality."),
                                rounds=3, keep=1, exploration_id=exploration_id)
    Path(out).write_text(json.dumps({
        "winner": result.winner, "spend_usd": result.spend_usd, "stop_reason": result.stop_reason,
        "branches": [[b.session_id, b.round, b.score, b.stop_reason, b.spend_usd] for b in result.branches]}))


if __name__ == "__main__":
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    main(sys.argv[1], sys.argv[2], sys.argv[3], mode == "kill", mode == "killjudge")
