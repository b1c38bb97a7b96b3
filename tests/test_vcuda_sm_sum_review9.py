"""A process that has not launched yet keeps the container's provisional charges it started with as debt, however
the sum of them falls, unless the fall is a settlement of processes that are gone.

The budget file keeps, per device, the container's provisional charges (those NVML's samples do not cover yet) as the
time they are paid off at (offset 2048).  A process that takes them back because its samples came hands its time to
the measured ledger, which a process already waiting does not read again: it counts that time only if it measures the
sample while the other still lives, and a process of one kernel exits as its kernel ends.  A waiting process that
followed such a fall took the time off twice (fresh processes of one 400 ms kernel, samples a 1/6 s period late,
read up to 38 % of a 30 % container).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from simnode.gpusim_state import GpuSimState, repo_root
from tests.test_vcuda_attacks import CHILD
from tests.vcuda_fixtures import Container, container, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

PROV_AT = 2048  # u64 per CUDA device: CLOCK_MONOTONIC ns until which the provisional charges are paid off
SLOTS_AT = 4096  # then 64-byte slots: int32 pid first
SLOT_SIZE = 64
DEBT_S = 10.0  # the provisional charges planted, in pay-off time


def budget_file(c: Container) -> Path:
    files = list(c.budget_dir.glob("*.budget"))
    assert len(files) == 1, f"budget files in {c.budget_dir}: {files}"
    return files[0]


def has_slot(path: Path, pid: int) -> bool:
    data = path.read_bytes()
    return any(
        struct.unpack_from("<i", data, at)[0] == pid for at in range(SLOTS_AT, len(data) - SLOT_SIZE + 1, SLOT_SIZE)
    )


def test_a_waiting_process_keeps_the_provisional_debt_it_began_with_when_the_sum_falls(
    container: MakeContainer,
) -> None:
    """The sum falls to nothing while a fresh process of one 400 ms kernel waits out the 10 s of provisional charges
    it began with (as when another process's samples came and it took its charges back): the process still waits,
    its kernel does not run in the next second."""
    c = container(0, cores=30)
    env = c.env()
    first = subprocess.run([sys.executable, "-c", CHILD, "spin_1ms"], env=env, cwd=repo_root(), timeout=60, check=False)
    assert first.returncode == 0
    path = budget_file(c)
    with path.open("r+b") as f:
        f.seek(PROV_AT)
        f.write(struct.pack("<Q", time.monotonic_ns() + int(DEBT_S * 1e9)))
    waiting = subprocess.Popen([sys.executable, "-c", CHILD, "spin_400ms"], env=env, cwd=repo_root())
    try:
        deadline = time.monotonic() + 30
        while not has_slot(path, waiting.pid):  # it joins the budget, then takes the ledger
            assert waiting.poll() is None and time.monotonic() < deadline, "the process never joined the budget"
            time.sleep(0.01)
        time.sleep(0.2)
        with GpuSimState(c.state_path) as st:
            a = st.timeline(0)
        with path.open("r+b") as f:
            f.seek(PROV_AT)
            f.write(struct.pack("<Q", 0))  # taken back, not by a settlement
        time.sleep(1.0)
        with GpuSimState(c.state_path) as st:
            b = st.timeline(0)
        assert waiting.poll() is None, "the process ran its kernel and exited although its debt stood"
    finally:
        waiting.kill()
        waiting.wait(timeout=30)
    assert a is not None and b is not None
    ran_ns = b.busy_ns - a.busy_ns
    assert ran_ns < 50_000_000, f"the process's kernel ran {ran_ns / 1e6:.0f} ms once the sum fell, its debt ignored"
