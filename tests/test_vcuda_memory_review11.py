"""A tenant's attempts to hold more GPU memory than its container's limit (vcuda/tests/review11_mem.c).

Each scenario runs the C program in a container-like set-up: a driver mirror whose ``libcuda.so.1`` and
``libnvidia-ml.so.1`` are the interceptor in front of the simulated driver, a ``vcuda.config`` with a memory limit,
a budget directory of its own.  The program pushes one allocation path as far as the interceptor lets it and
prints what NVML accounts to it on the GPU (the simulated driver's record of what the GPU holds): never above the
limit, at the end and at the GPU's peak (the simulated node's record).  Every scenario also runs against the
ASan/UBSan builds of the interceptor and of the simulated driver.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gpumanager.vmanager import files
from simnode.gpusim_state import GpuSimState

ROOT = Path(__file__).resolve().parents[1]
VCUDA = ROOT / "vcuda"
BUILD = VCUDA / "build"
SPEC = ROOT / "deploy" / "sim" / "t4-x1.json"
SOURCE = VCUDA / "tests" / "review11_mem.c"
DRIVER_VERSION = "550.54.15"
LIMIT_MIB = 1024
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]


def _include_dirs() -> list[str]:
    out = subprocess.run(
        ["make", "-s", "-C", str(VCUDA), "--eval=print-inc:\n\t@echo $(CUDA_INCLUDE) $(NVML_INCLUDE)", "print-inc"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(VCUDA),
            "sim",
            "interceptor",
            "build/asan/libcuda-control.so",
            "build/sim-asan/libcuda.so.1",
            "build/sim-asan/libnvidia-ml.so.1",
        ],
        check=True,
        capture_output=True,
    )
    out = tmp_path_factory.mktemp("review11-bin")
    incs = [f"-I{d}" for d in _include_dirs()]
    built = {}
    for variant, extra in (("plain", []), ("asan", SAN_FLAGS)):
        exe = out / f"review11_mem_{variant}"
        subprocess.run(
            [
                "cc",
                "-std=c11",
                "-D_GNU_SOURCE",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-O1",
                "-g",
                *extra,
                *incs,
                "-o",
                str(exe),
                str(SOURCE),
                "-ldl",
                "-pthread",
            ],
            check=True,
        )
        built[variant] = exe
    return built


def _mirror(where: Path, variant: str) -> Path:
    """A driver mirror as the agent makes it: the interceptor under the sonames, the driver under its full names."""
    where.mkdir()
    interceptor = BUILD / ("asan" if variant == "asan" else "") / "libcuda-control.so"
    sim = BUILD / ("sim-asan" if variant == "asan" else "sim")
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (where / soname).symlink_to(interceptor)
    (where / f"libcuda.so.{DRIVER_VERSION}").symlink_to(sim / "libcuda.so.1")
    (where / f"libnvidia-ml.so.{DRIVER_VERSION}").symlink_to(sim / "libnvidia-ml.so.1")
    return where


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str) -> tuple[int, int]:
    """Runs one scenario; returns the MiB NVML accounts to the program on the GPU at its end, and the GPU's peak."""
    mirror = _mirror(tmp_path / "mirror", variant)
    config = tmp_path / "config" / "vcuda.config"
    config.parent.mkdir()
    config.write_bytes(
        files.pack(
            files.VcudaConfig(pod_uid="pod-review11", container_name="c", gpu_memory=LIMIT_MIB << 20, utilization=0)
        )
    )
    budget = tmp_path / "budget"
    budget.mkdir()
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=str(mirror),
        GPUSIM_SPEC=str(SPEC),
        GPUSIM_STATE=str(tmp_path / "node.state"),
        VCUDA_CONFIG_PATH=str(config),
        VCUDA_BUDGET_DIR=str(budget),
        ASAN_OPTIONS="detect_leaks=0",
    )
    env.pop("LD_PRELOAD", None)
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
