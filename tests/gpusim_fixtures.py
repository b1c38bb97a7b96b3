"""Fixtures for the simulated GPU node's own tests (vcuda/sim and simnode.gpusim*).

Programs that use the simulated driver run in subprocesses: the dynamic loader reads
LD_LIBRARY_PATH only when a process starts, and loading the simulated ``libnvidia-ml.so.1``
into the test process would shadow the name for every later test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from simnode.gpusim_state import NodeSpec, ensure_sim_built, load_spec, sim_env, spec_dir

SPEC_NAMES = ("t4-x1", "v100-pcie-x4", "h100-nvlink-x8", "h200-x16")


@dataclass
class SimNode:
    """A simulated node for one test: a spec and a fresh state file."""

    spec_path: Path
    state_path: Path
    _spec: NodeSpec | None = field(default=None, repr=False)

    @property
    def spec(self) -> NodeSpec:
        """The parsed spec (only for valid specs)."""
        if self._spec is None:
            self._spec = load_spec(self.spec_path)
        return self._spec

    def env(self, **overrides: str | None) -> dict[str, str]:
        """Environment of a process on this node; an override of None removes the variable."""
        env = sim_env(self.spec_path, self.state_path)
        for key, value in overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def python(
        self, code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        """Runs Python code in a subprocess on this node."""
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            env=dict(env) if env is not None else self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def python_json(self, code: str, *args: str, timeout: float = 30) -> Any:
        """Runs Python code in a subprocess on this node, which must exit 0; what it printed, parsed as JSON."""
        done = self.python(code, *args, timeout=timeout)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def popen_python(self, code: str, *args: str) -> subprocess.Popen[str]:
        """Starts Python code in a subprocess on this node (stdout and stderr piped)."""
        return subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def gpusim(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Runs ``python -m simnode.gpusim`` against this node."""
        return subprocess.run(
            [sys.executable, "-m", "simnode.gpusim", *args],
            env=dict(env) if env is not None else self.env(),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )


@pytest.fixture(scope="session")
def gpusim_lib() -> Path:
    """The simulated libnvidia-ml.so.1, built (once per session) if missing or stale."""
    return ensure_sim_built()


@pytest.fixture
def sim_node(gpusim_lib: Path, tmp_path: Path) -> Callable[[str | Path], SimNode]:
    """Factory: sim_node('h100-nvlink-x8') or sim_node(path/to/spec.json) -> SimNode with its own state."""
    del gpusim_lib  # only needed built
    count = 0

    def make(spec: str | Path) -> SimNode:
        nonlocal count
        count += 1
        path = spec if isinstance(spec, Path) else spec_dir() / f"{spec}.json"
        return SimNode(path, tmp_path / f"gpusim-{count}.state")

    return make
