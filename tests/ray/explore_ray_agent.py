"""The agent and judge a submitted exploration imports on the cluster (``explore_ray_agent:counted`` ...).

``counted`` and ``model_judge`` log every model call they serve to
``$LOOMRAY_RAY_TEST_DIR/xsub-calls`` (one line naming the branch or the judged
branch and the transcript's length: a call made twice shows as a repeated
line), and round 2's ``s1`` branch waits at its second call for the gate file
``xsub-gate`` after writing ``xsub-waiting``: the test kills the supervisor
while that call is in flight.
"""

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "explore"))

import explore_agents  # noqa: E402
from explore_agents import reply, step  # noqa: E402

from loomray import Agent, ModelJudge, Tuning  # noqa: E402
from loomray.models import ScriptedModel  # noqa: E402

# The hosts that run the branches get the agent by value: they cannot import tests/explore.
cloudpickle.register_pickle_by_value(explore_agents)


def _dir() -> Path:
    return Path(os.environ["LOOMRAY_RAY_TEST_DIR"])


def _log(line: str) -> None:
    fd = os.open(_dir() / "xsub-calls", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


async def _branch_reply(request):
    messages = request.messages
    prompts = [m.content for m in messages if m.role == "user" and m.content.startswith("variant ")]
    if prompts:
        name = prompts[-1].split()[1]
        after = len(messages) - 1 - max(i for i, m in enumerate(messages) if m.role == "user")
        if len(prompts) == 2 and name == "s1" and after == 2:  # round 2's s1, its second call
            (_dir() / "xsub-waiting").write_text(str(os.getpid()))
            deadline = time.monotonic() + 180
            while not (_dir() / "xsub-gate").exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # a dense host runs other sessions meanwhile
        _log(f"branch {name} round {len(prompts)} messages {len(messages)}")
    return reply(messages)


def _verdict(request):
    prompt = request.messages[-1].content
    _log(f"judge {prompt.splitlines()[0]}")
    return json.dumps({"score": float(re.findall(r"answer ([\d.]+)", prompt)[-1]), "reasons": "its answer"})


counted = Agent("You explore.", model=ScriptedModel([_branch_reply] * 40, name="counted"), tools=[step],
                tuning=Tuning(checkpoint=True))
model_judge = ModelJudge(ScriptedModel([_verdict] * 2, name="judge-model"), "Score the branch by its answer.")

__all__ = ["counted", "model_judge"]
