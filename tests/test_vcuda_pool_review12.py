"""A tenant's attempts to hold more GPU memory than its container's limit through memory pools
(vcuda/tests/review12_pool.c).

Each scenario runs the C program in a container-like set-up (the driver mirror, ``vcuda.config`` and budget
directory of tests/test_vcuda_memory_review11.py): the interceptor in front of the simulated driver, plain and
under ASan/UBSan.  What NVML accounts to the program at its end, and the GPU's peak, must stay within the limit.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.vcuda_scenario import VCUDA, build_programs, container_env

SOURCE = VCUDA / "tests" / "review12_pool.c"
LIMIT_MIB = 1024


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    return build_programs(tmp_path_factory.mktemp("review12-bin"), SOURCE)


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str) -> tuple[int, int, str]:
    """Runs one scenario; returns the MiB NVML accounts to the program at its end, the GPU's peak, and stderr."""
    env = container_env(tmp_path, variant, pod_uid="pod-review12", memory_mib=LIMIT_MIB)
    done = subprocess.run(
        [str(programs[variant]), scenario, str(LIMIT_MIB)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{scenario} ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    m = re.search(r"^held (\d+)$", done.stdout, re.M)
    assert m is not None, f"{scenario} ({variant}): no report\n{done.stdout}\n{done.stderr}"
    with GpuSimState(str(tmp_path / "node.state")) as st:
        peak = st.snapshot(1).gpus[0].used_peak
    return int(m.group(1)), peak >> 20, done.stderr


SCENARIOS = ["switch-race", "destroy-race", "getproc", "max-size"]


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_gpu_never_holds_more_than_the_limit(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    held, peak, err = _run(programs, tmp_path, variant, scenario)
    assert held <= LIMIT_MIB, f"{scenario} ({variant}): the GPU holds {held} MiB for a {LIMIT_MIB} MiB container\n{err}"
    assert peak <= LIMIT_MIB, f"{scenario} ({variant}): the GPU held {peak} MiB at its peak\n{err}"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_pool_keeps_within_its_max_size_and_a_refused_allocation_returns_its_reservation(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """The simulated pool refuses to grow beyond CUmemPoolProps.maxSize (the program exits 4 otherwise); the
    interceptor gives back what it reserved for the refused allocation, so cuMemAlloc then fills the limit."""
    held, _, err = _run(programs, tmp_path, variant, "max-size")
    assert held >= LIMIT_MIB - 8, f"max-size ({variant}): {held} MiB held at the end, the limit is {LIMIT_MIB}\n{err}"
