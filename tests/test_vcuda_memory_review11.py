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
from tests.vcuda_scenario import HOOKS_INTERCEPTOR, VCUDA, build_hooks_interceptor, build_programs, container_env

SOURCE = VCUDA / "tests" / "review11_mem.c"
LIMIT_MIB = 1024


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    return build_programs(tmp_path_factory.mktemp("review11-bin"), SOURCE)


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str, **extra: str) -> tuple[int, int, str]:
    """Runs one scenario (``extra``: more environment); returns the MiB NVML accounts to the program on the GPU at
    its end, the GPU's peak, and what the program wrote to stderr.  ``variant`` "hooks": the plain program in front
    of the interceptor built with -DVC_TEST_HOOKS (the ``hooks`` fixture)."""
    interceptor = HOOKS_INTERCEPTOR if variant == "hooks" else None
    env = container_env(
        tmp_path, "plain" if variant == "hooks" else variant, pod_uid="pod-review11", memory_mib=LIMIT_MIB,
        interceptor=interceptor,
    )  # fmt: skip
    env.update(extra)
    program = programs["plain" if variant == "hooks" else variant]
    done = subprocess.run(
        [str(program), scenario, str(LIMIT_MIB)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"{scenario} ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    m = re.search(r"^held (\d+)$", done.stdout, re.M)
    assert m is not None, f"{scenario} ({variant}): no report\n{done.stdout}\n{done.stderr}"
    with GpuSimState(str(tmp_path / "node.state")) as st:
        peak = st.snapshot(1).gpus[0].used_peak
    return int(m.group(1)), peak >> 20, done.stderr


#: A graph of a kernel with a 64 KiB frame: as a node, recorded by a capture, in a child graph 3 deep, and 40 deep.
GRAPH_FRAMES = ["graph-frame", "graph-frame-capture", "graph-frame-child", "graph-frame-deep"]

#: An exec made to run a kernel of a 64 KiB frame: updated from a graph, or its kernel node given that kernel, through
#: CUDA 12's calls, their CUDA 10-11 ABIs (by name, and through cuGetProcAddress at 11.4), and CUDA 12.2's generic
#: node call.
EXEC_CHANGES = [
    "exec-update",
    "exec-node-params",
    "exec-update-v1",
    "exec-node-params-v1",
    "exec-update-proc-v1",
    "exec-node-params-proc-v1",
    "exec-node-set-params",
    "exec-child-params",
    "exec-child-set-params",
]

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
    "free-async-context-destroyed",
    "free-async-context-destroyed-watched",
    "pool-switch",
    "graph-phantom",
    "graph-refused",
    "library-phantom",
    "library-kernel",
    "local-frame",
    "local-frame-full",
    "streams",
    *GRAPH_FRAMES,
    "graph-no-context",
    "graph-other-context",
    "child-graph-destroyed",
    "graph-in-capture",
    "graph-shrink",
    *EXEC_CHANGES,
]


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_gpu_never_holds_more_than_the_limit(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    held, peak, _ = _run(programs, tmp_path, variant, scenario)
    assert held <= LIMIT_MIB, f"{scenario} ({variant}): the GPU holds {held} MiB for a {LIMIT_MIB} MiB container"
    assert peak <= LIMIT_MIB, f"{scenario} ({variant}): the GPU held {peak} MiB at its peak"


def test_no_event_of_a_destroyed_context_is_asked_for_after_the_destroy(
    programs: dict[str, Path], tmp_path: Path
) -> None:
    """A free queued behind a long kernel in a context then destroyed, while another thread asks for the memory
    view (which looks at the queued frees first).  The driver frees the context's events in its destroy; the
    interceptor forgot the free's event only after it returned, and the other thread could ask for it in between:
    the simulated driver stops the process.  A test-only delay right after the driver's destroy
    (VCUDA_TEST_DESTROY_DELAY_US, -DVC_TEST_HOOKS) holds that moment open."""
    build_hooks_interceptor()
    held, peak, _ = _run(
        programs, tmp_path, "hooks", "free-async-context-destroyed-watched", VCUDA_TEST_DESTROY_DELAY_US="100000"
    )
    assert held <= LIMIT_MIB and peak <= LIMIT_MIB, f"the GPU holds {held} MiB (peak {peak}) on {LIMIT_MIB}"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_launch_that_would_grow_the_stack_past_the_limit_is_refused(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """A kernel with a 64 KiB local frame, launched in a container at its limit: the driver would grow the stack by
    63 KiB for every thread the GPU holds (2520 MiB on the simulated T4, 16632 MiB on an H200); the launch is
    refused with CUDA_ERROR_OUT_OF_MEMORY (2), as the driver refuses one whose stack it cannot make."""
    held, peak, err = _run(programs, tmp_path, variant, "local-frame-full")
    assert "launch: 2" in err, f"local-frame-full ({variant}): {err}"
    assert held <= LIMIT_MIB and peak <= LIMIT_MIB, f"local-frame-full ({variant}): {held} / peak {peak} MiB"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_stack_grown_by_a_launch_counts_toward_the_limit(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """An 8 KiB frame fits (7 KiB more for each of the simulated T4's 40960 resident threads: 280 MiB): the launch
    goes, and what the container allocates after it stops at the limit with the grown stack counted, once."""
    held, peak, err = _run(programs, tmp_path, variant, "local-frame")
    assert "launch: 0" in err, f"local-frame ({variant}): {err}"
    assert LIMIT_MIB - 8 <= held <= LIMIT_MIB, f"local-frame ({variant}): {held} MiB held at the end"
    assert peak <= LIMIT_MIB, f"local-frame ({variant}): the GPU held {peak} MiB at its peak"


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", GRAPH_FRAMES)
def test_a_graph_whose_kernels_would_grow_the_stack_past_the_limit_is_refused(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    """A graph of a kernel with a 64 KiB local frame (added as a node, or recorded by a capture), instantiated in a
    container at its limit: its launch would grow the stack as the kernel's own launch would; the instantiation is
    refused with CUDA_ERROR_OUT_OF_MEMORY (2)."""
    held, peak, err = _run(programs, tmp_path, variant, scenario)
    assert "instantiate: 2" in err, f"{scenario} ({variant}): {err}"
    assert held <= LIMIT_MIB and peak <= LIMIT_MIB, f"{scenario} ({variant}): {held} / peak {peak} MiB"


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", EXEC_CHANGES)
def test_an_exec_made_to_run_a_kernel_that_would_grow_the_stack_past_the_limit_is_refused(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    """An instantiated graph, in a container at its limit, updated from a graph of a kernel with a 64 KiB local frame
    (or its node given that kernel): its next launch would grow the stack; the update is refused with
    CUDA_ERROR_OUT_OF_MEMORY (2) and the exec keeps running what it ran."""
    held, peak, err = _run(programs, tmp_path, variant, scenario)
    assert "update: 2" in err and "launch: 0" in err, f"{scenario} ({variant}): {err}"
    assert held <= LIMIT_MIB and peak <= LIMIT_MIB, f"{scenario} ({variant}): {held} / peak {peak} MiB"
