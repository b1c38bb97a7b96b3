"""A tenant's attempts to hold more GPU memory than its container's limit (vcuda/tests/review11_mem.c).

Each scenario runs the C program in a container-like set-up: a driver mirror whose ``libcuda.so.1`` and
``libnvidia-ml.so.1`` are the interceptor in front of the simulated driver, a ``vcuda.config`` with a memory limit,
a budget directory of its own.  The program pushes one allocation path as far as the interceptor lets it and
prints what NVML accounts to it on the GPU (the simulated driver's record of what the GPU holds): never above the
limit, at the end and at the GPU's peak (the simulated node's record).  Every scenario also runs against the
ASan/UBSan builds of the interceptor and of the simulated driver.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.vcuda_scenario import VCUDA, build_programs, container_env

SOURCE = VCUDA / "tests" / "review11_mem.c"
LIMIT_MIB = 1024


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    return build_programs(tmp_path_factory.mktemp("review11-bin"), SOURCE)


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str) -> tuple[int, int]:
    """Runs one scenario; returns the MiB NVML accounts to the program on the GPU at its end, and the GPU's peak."""
    env = container_env(tmp_path, variant, pod_uid="pod-review11", memory_mib=LIMIT_MIB)
    done = subprocess.run(
        [str(programs[variant]), scenario, str(LIMIT_MIB)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{scenario} ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    m = re.search(r"^held (\d+)$", done.stdout, re.M)
    assert m is not None, f"{scenario} ({variant}): no report\n{done.stdout}\n{done.stderr}"
    with GpuSimState(str(tmp_path / "node.state")) as st:
        peak = st.snapshot(1).gpus[0].used_peak
    return int(m.group(1)), peak >> 20


SCENARIOS = [
    "base",
    "pitch-wrap",
    "arrays",
    "getproc",
    "graphs",
    "fork",
    "contexts",
    "vmm",
    "threads",
    "frees",
    "pool-switch",
    "graph-phantom",
    "graph-refused",
    "library-phantom",
    "library-kernel",
]


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_gpu_never_holds_more_than_the_limit(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    held, peak = _run(programs, tmp_path, variant, scenario)
    assert held <= LIMIT_MIB, f"{scenario} ({variant}): the GPU holds {held} MiB for a {LIMIT_MIB} MiB container"
    assert peak <= LIMIT_MIB, f"{scenario} ({variant}): the GPU held {peak} MiB at its peak"
