"""The agent and judge a submitted exploration imports on the cluster (``explore_ray_agent:agent``)."""

import sys
from pathlib import Path

from ray import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "explore"))

import explore_agents  # noqa: E402
from explore_agents import judge, make_agent  # noqa: E402

# The hosts that run the branches get the agent by value: they cannot import tests/explore.
cloudpickle.register_pickle_by_value(explore_agents)

agent = make_agent(None, delay=0.2)

__all__ = ["agent", "judge"]
