"""The interceptor against races a tenant can provoke: forks while the SM limiter grows its buffers, module
images rewritten while they are loaded, captures ended while a launch is gated, and broken configurations.

The C programs are vcuda/tests/review4_fork.c and vcuda/tests/review5_*.c (built with the project's warnings,
and once more under AddressSanitizer/UBSan against the sanitizer builds of the interceptor and the simulated
driver), run in a simulated container.  Races are made deterministic with the test-only delays of a build with
-DVC_TEST_HOOKS.
"""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.test_interceptor_review2 import asan_built, build_program
from tests.test_interceptor_review4 import hooks_built, hooks_mirror, run_c
from tests.vcuda_fixtures import Container, config_bytes, container, last_json, vcuda_built

__all__ = ["asan_built", "container", "hooks_built", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_children_forked_while_the_sm_limiter_grows_its_sample_buffers_do_not_free_them_again(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """The fork handler freed the SM limiter's sample buffers in the child.  A thread of the parent growing one
    at the fork (realloc done, the new address not yet stored) left the child the old, already freed address:
    the child freed it again.  A test-only delay between the realloc and the store, with the buffers grown at
    every measurement (VCUDA_TEST_GROW_DELAY_US, in a build with -DVC_TEST_HOOKS), makes the window wide.  No
    child may crash."""
    c = container(1024, cores=30)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review4_fork", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_GROW_DELAY_US="5000")
    out, err = run_c(exe, ["2", "30"], env, sanitize)
    assert out["crashed"] == 0 and out["stuck"] == 0, f"{out}: {err[-4000:]}"
    assert out["ok"] + out["failed"] == out["forks"] == 30, f"{out}: {err[-4000:]}"


@pytest.mark.parametrize("mode", ["module", "module_ex", "fatbinary", "library"])
@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_module_image_rewritten_during_its_load_is_loaded_as_it_was_estimated(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool, mode: str
) -> None:
    """The interceptor estimated a PTX image's variables from the caller's buffer, then handed the driver the
    same buffer: another thread rewriting it in between had a 256 MiB variable loaded for the estimate of a
    16-byte one.  A test-only delay between the estimate and the load (VCUDA_TEST_LOAD_DELAY_US, in a build
    with -DVC_TEST_HOOKS) lets the rewrite land there.  What the driver loads must be what was estimated:
    `small`, never `big`."""
    c = container(1024)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review5_image", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_LOAD_DELAY_US="300000")
    out, err = run_c(exe, [mode, "50"], env, sanitize)
    assert out["load"] == 0, f"{out}: {err[-4000:]}"
    assert out["small"] == 0 and out["big"] == 500, f"the driver loaded the rewritten image: {out}"


INIT_ONLY = r"""
import ctypes, json
lib = ctypes.CDLL("libcuda.so.1")
rc = lib.cuInit(0)
count = ctypes.c_int(-1)
print(json.dumps({"init": rc, "count_rc": lib.cuDeviceGetCount(ctypes.byref(count))}))
"""

CUDA_ERROR_NOT_PERMITTED = 800

# cuda-bindings finds cuInit through cuGetProcAddress.
BINDINGS_INIT = r"""
import json
from cuda.bindings import driver as d
rc = d.cuInit(0)[0]
print(json.dumps({"init": int(rc), "count_rc": int(d.cuDeviceGetCount()[0])}))
"""


def field(content: bytes, offset: int, value: int, fmt: str = "<i") -> bytes:
    """content with one field of the config replaced."""
    buf = bytearray(content)
    struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\0" * 100, "100 bytes, expected 8240"),
        (config_bytes(1 << 30, enable=7), "enable = 7"),
        (field(config_bytes(1 << 30), 8216, 250), "utilization = 250"),
        (field(config_bytes(1 << 30), 8216, -30), "utilization = -30"),
        (field(config_bytes(1 << 30), 8220, 7), "hard_limit = 7"),
        (field(config_bytes(1 << 30), 8208, 1 << 63, "<Q"), "gpu_memory = 9223372036854775808"),
    ],
    ids=["size", "enable", "utilization-high", "utilization-negative", "hard-limit", "gpu-memory"],
)
@pytest.mark.parametrize("program", [INIT_ONLY, BINDINGS_INIT], ids=["dlsym", "cuGetProcAddress"])
def test_a_broken_config_fails_closed_naming_the_file_and_the_field(
    container: MakeContainer, content: bytes, message: str, program: str
) -> None:
    """A container that was given a share has a vcuda.config; one that cannot be used (a wrong size, a field
    out of its range) made the process run without any limit (fail-open): an isolation escape for whoever can
    corrupt it, and a share silently lost.  Upstream's library exits on a config it cannot read.  Every cuInit
    must fail (CUDA_ERROR_NOT_PERMITTED) with a stderr line naming the file and what is wrong with it."""
    c = container(1024, config=False)
    c.config_path.write_bytes(content)
    done = c.python(program, prelude=False)
    assert done.returncode == 0, done.stderr
    out = last_json(done.stdout)
    assert out == {"init": CUDA_ERROR_NOT_PERMITTED, "count_rc": 3}, f"{out}: {done.stderr}"
    assert f"{c.config_path}: {message}" in done.stderr, done.stderr
    assert "CUDA is refused" in done.stderr, done.stderr


@pytest.mark.parametrize("program", [INIT_ONLY, BINDINGS_INIT], ids=["dlsym", "cuGetProcAddress"])
def test_a_container_without_a_config_still_runs_without_limits(container: MakeContainer, program: str) -> None:
    """No vcuda.config anywhere (a container that was not given a share): pass-through, as before."""
    c = container(1024, config=False)
    done = c.python(program, prelude=False)
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout) == {"init": 0, "count_rc": 0}, done.stderr
    assert "refused" not in done.stderr


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_launch_whose_capture_another_thread_ended_meanwhile_is_charged_to_the_sm_limit(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """The SM gate lets a launch on a capturing stream through unlimited: it is recorded into a graph, whose
    launch is gated.  Another thread ending the capture between that check and the launch made the launch run
    at once, never counted: a loop of such launches ran beside the limit.  A test-only delay after the check
    (VCUDA_TEST_CAPTURE_DELAY_US, in a build with -DVC_TEST_HOOKS) lets the capture end there, and the build
    reports at exit how many launches the gate counted (VCUDA_TEST_REPORT_LAUNCHES).  Each launch that ran must
    have been counted."""
    c = container(1024, cores=30)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review5_capture", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_CAPTURE_DELAY_US="300000", VCUDA_TEST_REPORT_LAUNCHES="1")
    out, err = run_c(exe, ["5", "20"], env, sanitize)
    assert out["ok"] == out["rounds"] == 5, f"{out}: {err[-4000:]}"
    counted = [int(line.split()[5]) for line in err.splitlines() if line.startswith("vcuda test: device 0 counted")]
    assert counted == [out["ok"]], f"launches that ran outside the gate: {out}, counted {counted}: {err[-4000:]}"


@pytest.mark.parametrize("mode", ["ex", "multi"])
@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_launch_description_rewritten_during_the_launch_runs_where_the_gate_looked(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool, mode: str
) -> None:
    """cuLaunchKernelEx and cuLaunchCooperativeKernelMultiDevice take the launch's stream in the caller's memory:
    the gate read it (a capturing stream: let through, recorded into a graph) and the driver read it again.
    Another thread rewriting it in between (to a stream that is not capturing) had the kernel run at once,
    ungated.  A test-only delay after the capture check (VCUDA_TEST_CAPTURE_DELAY_US, in a build with
    -DVC_TEST_HOOKS) lets the rewrite land there.  The kernel must go where the gate looked: into the capture,
    so the other stream stays idle."""
    c = container(1024, cores=30)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review5_launchex", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_CAPTURE_DELAY_US="200000")
    out, err = run_c(exe, [mode, "20"], env, sanitize)
    assert out["launch"] == 0, f"{out}: {err[-4000:]}"
    assert out["s2_busy"] == 0, f"the kernel ran on the stream written after the gate's check: {out}"


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_an_allocation_whose_capture_another_thread_ended_meanwhile_stays_within_the_cap(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """cuMemAllocAsync on a capturing stream is charged as a memory node of the capturing graph, given back when
    the graph goes.  Another thread ending the capture between that check and the call made the allocation real
    (the stream's pool) while it was charged as the graph's: destroying the graph returned the charge and the
    memory stayed, round after round beyond the cap.  A test-only delay after the capture check
    (VCUDA_TEST_CAPTURE_DELAY_US, in a build with -DVC_TEST_HOOKS) lets the capture end there.  Whatever the
    interleaving, the GPU must never hold more for the container than its cap (1024 MiB; 6 x 300 MiB asked)."""
    c = container(1024)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review5_galloc", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_CAPTURE_DELAY_US="200000")
    if sanitize:
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    proc = subprocess.Popen([str(exe), "6", "300", "20"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        with GpuSimState(os.fspath(c.state_path)) as st:
            held = st.snapshot().used_bytes(0)
    finally:
        out, err = proc.communicate("stop\n", timeout=120)
    assert proc.returncode == 0, line + out + err[-4000:]
    got = last_json(line)
    assert isinstance(got, dict) and got["rounds"] == 6, line + err[-4000:]
    assert held <= c.limit_bytes, f"the GPU holds {held >> 20} MiB for a 1024 MiB container: {got}"
