"""The container's PID list as the SM limiter sees it when the agent rewrites it, and processes forked while
other threads use the interceptor.

Each case is a C program (vcuda/tests/review4_*.c, built with the project's warnings, and once more under
AddressSanitizer/UBSan against the sanitizer builds of the interceptor and the simulated driver) run in a
simulated container.
"""

from __future__ import annotations

import os
import queue
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.make_lock import run_make
from tests.test_interceptor_review2 import asan_built, asan_mirror, build_program
from tests.vcuda_fixtures import VCUDA, Container, container, last_json, make_mirror, vcuda_built

__all__ = ["asan_built", "container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]


def write_pids_as_the_agent(path: Path, pids: list[int], mtime_ns: int) -> None:
    """pids.config replaced by rename (a new inode), its mtime that of the one it replaces."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(struct.pack(f"<{len(pids)}i", *pids))
    os.replace(tmp, path)
    os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_pids_config_rewritten_within_one_mtime_tick_is_read_again(
    container: MakeContainer, asan_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """The agent replaces pids.config by rename; on a file system with coarse timestamps (or two rewrites in
    one tick) the new file has the old one's mtime.  The SM limiter re-read the list only when the mtime
    changed: it kept counting the old PIDs as the container's.  Each rewrite must be read again: one that
    grows the list, then one of the same size (only the inode and ctime differ)."""
    c = container(1024, cores=50)
    exe = build_program("review4_pids", tmp_path, sanitize)
    env = c.env(LOGGER_LEVEL="5")
    if sanitize:
        env["LD_LIBRARY_PATH"] = str(asan_mirror(c, asan_built))
        env["ASAN_OPTIONS"] = "detect_leaks=0"
    pids = c.config_path.parent / "pids.config"
    pids.write_bytes(struct.pack("<2i", 1, 2))
    mtime = pids.stat().st_mtime_ns
    proc = subprocess.Popen([str(exe)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def read() -> None:
        for line in proc.stderr or []:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(text: str) -> bool:
        """Whether the interceptor logs text (a hang guard of 20 s: not seen by then, never; it re-reads a
        changed list within 100 ms)."""
        deadline = time.monotonic() + 20
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return False
            log.append(line)
            if text in line:
                return True

    try:
        assert wait_for("pids.config: 2 PIDs"), "".join(log)
        write_pids_as_the_agent(pids, [1, 2, 3], mtime)
        assert wait_for("pids.config: 3 PIDs"), f"a rewrite with the same mtime was not read: {''.join(log)}"
        write_pids_as_the_agent(pids, [4, 5, 6], mtime)
        assert wait_for("pids.config: 3 PIDs"), f"a same-size rewrite with the same mtime was not read: {''.join(log)}"
    finally:
        out, err = proc.communicate("stop\n", timeout=60)
    assert proc.returncode == 0, out + err + "".join(log)
    assert isinstance(last_json(out), dict)


@pytest.fixture(scope="module")
def hooks_built(vcuda_built: Path) -> Path:
    """The interceptor (and its sanitizer build) with the test-only hooks (-DVC_TEST_HOOKS): under
    vcuda/build/t_VC_TEST_HOOKS/."""
    del vcuda_built
    name = "t_VC_TEST_HOOKS"
    command = ["make", "-C", str(VCUDA), f"BUILD=build/{name}", "CFLAGS=-O2 -g -DVC_TEST_HOOKS", "interceptor",
               f"build/{name}/asan/libcuda-control.so", f"PYTHON={sys.executable}"]  # fmt: skip
    done = run_make(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return VCUDA / "build" / name


def hooks_mirror(c: Container, hooks: Path, sanitize: bool) -> Path:
    """c's driver tree with the test-hook build of the interceptor (and the sanitizer builds when sanitize)."""
    if sanitize:
        return asan_mirror(c, hooks / "asan" / "libcuda-control.so")
    mirror = c.root / "hooks-lib64"
    make_mirror(mirror, hooks / "libcuda-control.so")
    return mirror


def run_c(exe: Path, args: list[str], env: dict[str, str], sanitize: bool) -> tuple[dict[str, int], str]:
    """Runs a test program; its last JSON line (numbers) and its stderr."""
    if sanitize:
        env = {**env, "ASAN_OPTIONS": "detect_leaks=0"}
    done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    out = last_json(done.stdout)
    assert isinstance(out, dict) and all(isinstance(v, int) for v in out.values()), done.stdout
    return {str(k): int(v) for k, v in out.items()}, done.stderr


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_a_handover_to_the_reconciliation_loses_no_concurrent_charge_or_credit(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """A raised context limit's bytes are handed over to the reconciliation with NVML: taken off the process's
    slot.  The slot was read, and the difference written back, while other threads charged and credited it
    without the lock: what they did in between was lost, and the process stayed charged for memory it had
    freed (or was charged less than it held).  A test-only delay between the read and the write
    (VCUDA_TEST_SETTLE_DELAY_US, in a build with -DVC_TEST_HOOKS) makes the window wide.  Once every
    thread has freed what it allocated, the slot must be back where it was."""
    c = container(1024)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review4_settle", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_SETTLE_DELAY_US="20000")
    budget = c.budget_dir / "0b6e6e0c-1f4a-4c1e-9c53-6d1b2c3d4e5f_main.budget"
    out, err = run_c(exe, [str(budget), "4", "10"], env, sanitize)
    assert out["rounds_ok"] == 10, f"{out}: {err}"
    assert out["after"] == out["before"], f"the slot lost concurrent updates: {out}"


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "asan"])
def test_children_forked_while_threads_create_contexts_launch_and_ask_nvml_neither_hang_nor_crash(
    container: MakeContainer, asan_built: Path, hooks_built: Path, tmp_path: Path, sanitize: bool
) -> None:
    """A process whose threads create and destroy contexts (each creation looks up the device's NVML handle
    under a lock), launch under the SM limit and ask NVML for the GPU's memory forks children one by one;
    each asks NVML, creates a context and allocates.  A child forked while a thread held the NVML handle
    lock inherited it held by a thread it does not have: its first context creation waited forever.  A
    test-only delay with that lock held (VCUDA_TEST_NVML_DELAY_US, in a build with -DVC_TEST_HOOKS) makes
    the window wide.  No child may hang or crash."""
    c = container(1024, cores=50)
    del asan_built
    mirror = hooks_mirror(c, hooks_built, sanitize)
    exe = build_program("review4_fork", tmp_path, sanitize)
    env = c.env(LD_LIBRARY_PATH=str(mirror), VCUDA_TEST_NVML_DELAY_US="2000")
    out, err = run_c(exe, ["2", "20"], env, sanitize)
    assert out["stuck"] == 0 and out["crashed"] == 0, f"{out}: {err[-4000:]}"
    assert out["ok"] + out["failed"] == out["forks"] == 20, f"{out}: {err[-4000:]}"
