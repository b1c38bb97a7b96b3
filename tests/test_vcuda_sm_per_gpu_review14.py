"""The SM share of fresh processes where NVML names one process per sampling period.

Such a driver (an H200 with driver 580.159: one sample per 200 ms, naming one process, with the whole GPU's busy
percent) shows a PID at two times in one answer only when the answer spans several periods. A process that measures
every period gets one new sample per answer, so where no neighbour's periods held its base back the limiter never
learnt the sampling. It then charged each sample since the query's start or that PID's own previous sample, spans
that hold the periods named for the container's other processes too: fresh processes of one 400 ms kernel each, two
at a time, got 19-21 % of a 30 % container. Each process now looks at a whole window's answer once a second while it
assumes per-process sampling, and what it learns is kept in the container's budget file for the processes after it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.test_vcuda_attacks import fresh_one_kernel_share
from tests.vcuda_fixtures import Container, container, vcuda_built

__all__ = ["container", "vcuda_built"]  # fixtures

PER_GPU = {"GPUSIM_PROCESS_SAMPLE_MODE": "gpu", "GPUSIM_PROCESS_SAMPLE_PERIOD_US": "200000"}
LIMIT, ROOM = 0.30, 0.06  # the bound of the other fresh-process tests (tests/test_vcuda_sm_realistic_review9.py)


@pytest.mark.timing  # a share of GPU time against a tight bound (make test runs it apart)
def test_fresh_processes_of_one_long_kernel_keep_the_share_where_nvml_names_one_process_per_period(
    container: Callable[..., Container],
) -> None:
    """Samples as the H200 gave them (200 ms, seen within 0.1 s of their time): the container gets its 30 %."""
    c = container(4096, cores=30)
    share, started = fresh_one_kernel_share(c, c.env(GPUSIM_PROCESS_SAMPLE_DELAY_US="0", **PER_GPU))
    assert started >= 6
    assert LIMIT - ROOM <= share <= LIMIT + ROOM, f"fresh processes of one 400 ms kernel each got {share:.1%}"
