"""A tenant of a 1 GiB container keeping device memory past its cap on driver paths the hooks follow only in part.

Each attack is a C program (vcuda/tests/review2_*.c, built here with the project's warnings, and once more
under AddressSanitizer/UBSan against the sanitizer builds of the interceptor and the simulated driver) run
in a simulated container.  The judge is the simulated GPU: the most device memory it held at once.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.make_lock import run_make
from tests.vcuda_fixtures import BUILD, DRIVER_VERSION, MIB, VCUDA, Container, container, last_json, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

WARN = ["-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror", "-Wshadow", "-Wstrict-prototypes", "-Wformat=2"]
SAN = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]


def cuda_include() -> Path:
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    assert spec is not None and spec.submodule_search_locations, "nvidia-cuda-runtime-cu12 is not installed"
    for loc in spec.submodule_search_locations:
        if (Path(loc) / "include" / "cuda.h").is_file():
            return Path(loc) / "include"
    raise AssertionError("cuda.h not found")


@pytest.fixture(scope="module")
def asan_built(vcuda_built: Path) -> Path:
    """The sanitizer builds of the interceptor and the simulated driver (make test's)."""
    del vcuda_built
    targets = ["build/asan/libcuda-control.so", "build/sim-asan/libcuda.so.1", "build/sim-asan/libnvidia-ml.so.1"]
    done = run_make(["make", "-C", str(VCUDA), *targets, f"PYTHON={sys.executable}"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return BUILD / "asan" / "libcuda-control.so"


def build_program(name: str, out: Path, sanitize: bool) -> Path:
    exe = out / (name + ("-asan" if sanitize else ""))
    cmd = ["cc", *WARN, "-O1", "-g", *(SAN if sanitize else []), f"-I{cuda_include()}", "-o", str(exe),
           str(VCUDA / "tests" / f"{name}.c"), "-ldl"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return exe


def asan_mirror(c: Container, interceptor: Path) -> Path:
    """c's driver tree once more, with the sanitizer builds."""
    mirror = c.root / "asan-lib64"
    mirror.mkdir()
    for name in ("libcuda.so.1", "libcuda.so", "libnvidia-ml.so.1", "libnvidia-ml.so"):
        (mirror / name).symlink_to(interceptor)
    for lib in ("libcuda.so", "libnvidia-ml.so"):
        (mirror / f"{lib}.{DRIVER_VERSION}").symlink_to(BUILD / "sim-asan" / f"{lib}.1")
    return mirror


def run_program(c: Container, exe: Path, args: list[str], mirror: Path | None = None) -> dict[str, object]:
    env = c.env()
    if mirror is not None:
        env["LD_LIBRARY_PATH"] = str(mirror)
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = last_json(done.stdout)
    assert isinstance(out, dict)
    return out


def peak(c: Container) -> int:
    with GpuSimState(os.fspath(c.state_path)) as st:
        return st.snapshot(1).gpus[0].used_peak


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_handle_imported_into_its_own_process_keeps_its_memory_charged(
    container: MakeContainer, asan_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """cuMemCreate 256 MiB, export it as a file descriptor, import that fd in the same process, release the
    created handle, map the imported one: the memory lives on (the driver frees it with the last handle and
    mapping of the allocation, whichever process holds them).  Eight rounds put 2 GiB on the GPU of a 1 GiB
    container while the interceptor credited every release; the memory must stay charged, and come back once
    the imported handles are gone."""
    c = container(1024)
    exe = build_program("review2_shareable", tmp_path, sanitize)
    mirror = asan_mirror(c, asan_built) if sanitize else None
    out = run_program(c, exe, ["8", "256", "700"], mirror)
    held = peak(c)
    assert held <= c.limit_bytes, f"the GPU held {held >> 20} MiB for a 1024 MiB container ({out})"
    # 250 MiB of context + 3 x 256 MiB fit in 1024 MiB; the fourth is refused
    assert out["rounds"] == (c.limit_bytes - c.context_bytes) // (256 * MIB), out
    assert out["refused"] == 2, out  # CUDA_ERROR_OUT_OF_MEMORY
    assert out["after"] == 0, f"the memory stayed charged after the imported handles were released: {out}"


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_memory_freed_in_stream_order_stays_charged_until_the_stream_gets_there(
    container: MakeContainer, asan_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """cuMemAlloc_v2 256 MiB, cuMemFreeAsync of it on a stream still running a 3 s kernel: the GPU frees it only
    when the stream reaches the free.  Eight rounds while the kernel ran put 2 GiB on the GPU of a 1 GiB
    container while the interceptor credited every free at the call; the memory must stay charged until the
    stream got there, and come back then."""
    c = container(1024, cores=0)  # no SM limit: the memory cap alone
    exe = build_program("review2_free_async", tmp_path, sanitize)
    mirror = asan_mirror(c, asan_built) if sanitize else None
    out = run_program(c, exe, ["8", "256", "700", "spin_3000ms"], mirror)
    held = peak(c)
    assert held <= c.limit_bytes, f"the GPU held {held >> 20} MiB for a 1024 MiB container ({out})"
    # 250 MiB of context + 2 MiB of module + 3 x 256 MiB fit in 1024 MiB; the fourth is refused
    assert out["rounds"] == 3, out
    assert out["refused"] == 2, out  # CUDA_ERROR_OUT_OF_MEMORY
    assert out["after"] == 0, f"the freed memory stayed charged after the stream reached the frees: {out}"
