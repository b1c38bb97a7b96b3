"""Fresh processes of one long kernel each keep the container's share when NVML's samples come late.

A real driver shows a process's utilisation sample 0.7 s or more after the time it covers, at a sampling period of
about 1/6 s (GPUSIM_PROCESS_SAMPLE_DELAY_US / GPUSIM_PROCESS_SAMPLE_PERIOD_US in the simulated NVML).  A tenant that
starts process after process, each launching one 400 ms kernel and exiting once it ran, has each process gone
before its kernel's samples arrive: the container's debt must still reach the next process.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.test_vcuda_attacks import fresh_one_kernel_share
from tests.vcuda_fixtures import Container, container, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

MakeContainer = Callable[..., Container]

DELAY_US = "700000"  # a real driver's sample lag
PERIOD_US = "166667"  # a datacenter GPU's per-process sampling period


@pytest.mark.timing  # a share of GPU time against a tight bound (make test runs it apart)
@pytest.mark.parametrize("limit_mib", [4096, 0], ids=["memory-limit", "no-memory-limit"])
def test_one_long_kernel_per_fresh_process_at_late_samples(container: MakeContainer, limit_mib: int) -> None:
    """Each fresh process exits before its kernel's samples arrive: what it was charged provisionally must reach
    the container's ledger, so the next process starts with that debt (and the late samples, once they come, must
    not count the same time again)."""
    c = container(limit_mib, cores=30)
    env = c.env(GPUSIM_PROCESS_SAMPLE_DELAY_US=DELAY_US, GPUSIM_PROCESS_SAMPLE_PERIOD_US=PERIOD_US)
    share, started = fresh_one_kernel_share(c, env)
    print(f"SHARE {share:.3f} started {started}")  # for -s
    assert started >= 6
    assert share <= 0.36, f"processes of one long kernel each got {share:.1%} of the GPU in a 30 % container"
