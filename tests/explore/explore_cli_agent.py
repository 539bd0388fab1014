"""The agent ``loomray explore --agent explore_cli_agent:agent`` runs the tests' branches with."""

from explore_agents import make_agent

agent = make_agent(None)
