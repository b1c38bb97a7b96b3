"""Fixtures that run the real agent process against the kubelet simulator on a simulated GPU node."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.gpusim_state import ensure_sim_built, sim_env
from simnode.kubelet import KubeletSimulator

StartAgent = Callable[..., AgentProcess]


@pytest.fixture(scope="session")
def sim_built() -> Path:
    """Build vcuda/ (the simulated driver) once per test session."""
    return ensure_sim_built()


def spec_path(name: str) -> Path:
    """A shipped node spec by file stem, e.g. 'h100-nvlink-x8'."""
    return SPEC_DIR / f"{name}.json"


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[KubeletSimulator]:
    """A running kubelet simulator serving tmp_path/device-plugins/kubelet.sock."""
    sim = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0, fill="sorted")
    sim.start()
    yield sim
    sim.stop()


@pytest.fixture
def start_agent(tmp_path: Path, sim_built: Path) -> Iterator[StartAgent]:
    """Factory: start_agent(spec='h100-nvlink-x8', *flags) -> a started AgentProcess; all are stopped after."""
    agents: list[AgentProcess] = []

    def start(spec: str = "h100-nvlink-x8", *flags: str, workdir: Path | None = None) -> AgentProcess:
        agent = AgentProcess(workdir or tmp_path, spec_path(spec), extra_args=flags)
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        agent.stop()


def gpusim(agent: AgentProcess, *args: str) -> str:
    """Run ``python -m simnode.gpusim`` against the agent's simulated node."""
    done = subprocess.run(
        [sys.executable, "-m", "simnode.gpusim", *args],
        env=sim_env(agent.spec, agent.state),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
