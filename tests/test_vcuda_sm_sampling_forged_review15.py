"""The sampling a container's processes learnt lives in its budget file, which the tenant can write.

A process started later takes the per-GPU sampling period from there (header field ``core_sampling`` at offset
2560, 8 bytes a device), and charges each per-GPU sample over at most that period. A tenant who writes a period of
2 us there makes each sample cost next to nothing: fresh processes then took the GPU's whole time they asked for.
What a process takes from the file is a hint it checks against the driver's own answer over a whole window at its
first measurement, never a figure it charges by.
"""

from __future__ import annotations

import mmap
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.test_vcuda_attacks import fresh_one_kernel_share
from tests.test_vcuda_sm_per_gpu_review14 import LIMIT, PER_GPU, ROOM
from tests.vcuda_fixtures import Container, container, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

SAMPLING_AT = 2560  # the budget header's core_sampling[0]
FORGED_PERIOD_US = 2


@contextmanager
def forging(budget_dir: Path, value: int) -> Iterator[list[int]]:
    """A tenant's thread that writes ``value`` into device 0's learnt sampling every 2 ms, from the moment
    the container's first process made the budget file; yields the number of writes."""
    stop = threading.Event()
    writes = [0]

    def run() -> None:
        while not stop.is_set():
            files = list(budget_dir.glob("*.budget"))
            if files and files[0].stat().st_size > SAMPLING_AT + 8:
                break
            stop.wait(0.01)
        if stop.is_set():
            return
        with files[0].open("r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            while not stop.wait(0.002):
                struct.pack_into("<Q", mm, SAMPLING_AT, value)
                writes[0] += 1

    thread = threading.Thread(target=run, name="forger", daemon=True)
    thread.start()
    try:
        yield writes
    finally:
        stop.set()
        thread.join(5)


SAMPLINGS = {
    "per-gpu-200ms": PER_GPU,
    # A per-process driver answers one sample per busy process: a whole window's answer never shows per-GPU
    # sampling, so the forged hint is never confirmed nor refuted, and two processes' samples at their own moments
    # must not be read as a period.
    "per-process": {"GPUSIM_PROCESS_SAMPLE_MODE": "process"},
}


@pytest.mark.timing  # a share of GPU time against a tight bound (make test runs it apart)
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_a_sampling_period_forged_in_the_budget_file_buys_no_gpu_time(
    container: Callable[..., Container], sampling: str
) -> None:
    """Fresh processes of one 400 ms kernel each, two at a time, in a 30 % container, the file's period forged to
    2 us all along: the container gets its 30 %, sampled as the H200 is (one process named per 200 ms) and
    sampled per process."""
    c = container(4096, cores=30)
    with forging(c.budget_dir, FORGED_PERIOD_US) as writes:
        share, started = fresh_one_kernel_share(c, c.env(GPUSIM_PROCESS_SAMPLE_DELAY_US="0", **SAMPLINGS[sampling]))
    assert writes[0] > 100
    assert started >= 6
    assert share <= LIMIT + ROOM, f"fresh processes beside a forged sampling period got {share:.1%}"
