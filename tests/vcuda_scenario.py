"""The interceptor's C scenario programs (``vcuda/tests/review*.c``) and the container they run in.

A scenario program is built twice, plain and under ASan/UBSan, once the interceptor and the simulated driver are
built (both variants of each). It runs in a container-like set-up: a driver mirror whose ``libcuda.so.1`` and
``libnvidia-ml.so.1`` are the interceptor in front of the simulated driver, a ``vcuda.config`` with the
container's limits, and a budget directory of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpumanager.vmanager import files
from tests.make_lock import run_make

ROOT = Path(__file__).resolve().parents[1]
VCUDA = ROOT / "vcuda"
BUILD = VCUDA / "build"
SPEC = ROOT / "deploy" / "sim" / "t4-x1.json"
DRIVER_VERSION = "550.54.15"
SAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
_MAKE_TARGETS = [
    "sim",
    "interceptor",
    "build/asan/libcuda-control.so",
    "build/sim-asan/libcuda.so.1",
    "build/sim-asan/libnvidia-ml.so.1",
]


def include_dirs() -> list[str]:
    """The CUDA and NVML header directories the interceptor's Makefile found."""
    out = run_make(
        ["make", "-s", "-C", str(VCUDA), "--eval=print-inc:\n\t@echo $(CUDA_INCLUDE) $(NVML_INCLUDE)", "print-inc"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def build_programs(out: Path, source: Path) -> dict[str, Path]:
    """``source`` built into ``out`` as ``{"plain": ..., "asan": ...}``, the interceptor and the simulated driver
    (plain and ASan/UBSan) built first."""
    run_make(["make", "-s", "-C", str(VCUDA), *_MAKE_TARGETS], check=True, capture_output=True)
    incs = [f"-I{d}" for d in include_dirs()]
    built = {}
    for variant, extra in (("plain", []), ("asan", SAN_FLAGS)):
        exe = out / f"{source.stem}_{variant}"
        flags = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-g", *extra, *incs]
        subprocess.run(["cc", *flags, "-o", str(exe), str(source), "-ldl", "-pthread"], check=True)
        built[variant] = exe
    return built


#: The interceptor built with -DVC_TEST_HOOKS (the test-only delays): vcuda/build/t_VC_TEST_HOOKS/libcuda-control.so.
HOOKS_INTERCEPTOR = BUILD / "t_VC_TEST_HOOKS" / "libcuda-control.so"


def build_hooks_interceptor() -> Path:
    """Builds the interceptor with -DVC_TEST_HOOKS (HOOKS_INTERCEPTOR) and returns it."""
    command = ["make", "-s", "-C", str(VCUDA), f"BUILD=build/{HOOKS_INTERCEPTOR.parent.name}",
               "CFLAGS=-O2 -g -DVC_TEST_HOOKS", "interceptor", f"PYTHON={sys.executable}"]  # fmt: skip
    done = run_make(command, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return HOOKS_INTERCEPTOR


def mirror(where: Path, variant: str, interceptor: Path | None = None) -> Path:
    """A driver mirror as the agent makes it: the interceptor under the sonames, the driver under its full names.
    ``variant`` "asan" takes the ASan/UBSan builds; ``interceptor`` replaces the interceptor library."""
    where.mkdir()
    if interceptor is None:
        interceptor = BUILD / ("asan" if variant == "asan" else "") / "libcuda-control.so"
    sim = BUILD / ("sim-asan" if variant == "asan" else "sim")
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        (where / soname).symlink_to(interceptor)
    (where / f"libcuda.so.{DRIVER_VERSION}").symlink_to(sim / "libcuda.so.1")
    (where / f"libnvidia-ml.so.{DRIVER_VERSION}").symlink_to(sim / "libnvidia-ml.so.1")
    return where


def container_env(
    tmp_path: Path,
    variant: str,
    *,
    pod_uid: str,
    memory_mib: int = 0,
    share: int = 0,
    interceptor: Path | None = None,
) -> dict[str, str]:
    """The environment of a process in a container with ``memory_mib`` of GPU memory (0: no limit) and an SM
    ``share`` in percent (0: none), made under ``tmp_path``; the node's state file is ``tmp_path/node.state``."""
    where = mirror(tmp_path / "mirror", variant, interceptor)
    config = tmp_path / "config" / "vcuda.config"
    config.parent.mkdir()
    config.write_bytes(
        files.pack(
            files.VcudaConfig(pod_uid=pod_uid, container_name="c", gpu_memory=memory_mib << 20, utilization=share)
        )
    )
    budget = tmp_path / "budget"
    budget.mkdir()
    env = dict(os.environ)
    env.update(
        LD_LIBRARY_PATH=str(where),
        GPUSIM_SPEC=str(SPEC),
        GPUSIM_STATE=str(tmp_path / "node.state"),
        VCUDA_CONFIG_PATH=str(config),
        VCUDA_BUDGET_DIR=str(budget),
        ASAN_OPTIONS="detect_leaks=0",
    )
    env.pop("LD_PRELOAD", None)
    return env
