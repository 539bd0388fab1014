"""An agent to submit by reference: ``loomray submit examples.demo_agent:agent "topic" --session s1``.

Run the command from the repository root (the CLI imports ``module:attr``
with the current directory on ``sys.path``); every node of the cluster must be
able to import the module too (same checkout and working directory, or
``PYTHONPATH``). The model is the offline research model, slowed down a
little (``LOOMRAY_DEMO_DELAY`` seconds per model call) so a run lasts long
enough to watch with ``loomray status``.
"""

import os

from loomray import Agent, Tuning
from loomray.models import resolve_model
from loomray.models.research import research_tools

agent = Agent(
    "You are a careful research assistant.",
    model=resolve_model("demo:research", passes=8, delay=float(os.environ.get("LOOMRAY_DEMO_DELAY", "0.5"))),
    tools=research_tools(),
    tuning=Tuning(checkpoint=True),
    name="demo-agent",
)
