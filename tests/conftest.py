"""Shared fixtures; the guard that keeps the tests off the host's agent directories (tests/host_paths.py)."""

from tests.agent_fixtures import kubelet, sim_built, start_agent

pytest_plugins = ["tests.host_paths"]

__all__ = ["kubelet", "sim_built", "start_agent"]
