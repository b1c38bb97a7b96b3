"""Shared fixtures."""

from tests.agent_fixtures import kubelet, sim_built, start_agent

__all__ = ["kubelet", "sim_built", "start_agent"]
