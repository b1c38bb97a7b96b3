"""The SM limiter holds its share whatever period and spread NVML's per-process samples have.

NVML samples each process at its own moment of its sampling period (GPUSIM_PROCESS_SAMPLE_PERIOD_US:
10 ms by default in the simulator, about 1/6 s on real datacenter GPUs; GPUSIM_PROCESS_SAMPLE_SPREAD_US:
how far before the period's end at most, jittering from one period to the next).  Spreads of 9.5 ms
or more (and the default 8 ms, for some PIDs) made the budget controller's pacing swing with several
processes in a container, and a 1/6 s period made it swing between 0 and 100 % for everyone.  Each
case runs ``launch_loop`` processes of one container under a hard limit and reads from the simulated
timeline the container's share over consecutive windows; every window and the whole must stay near
the limit.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.test_vcuda_compute import PER_PROCESS, Node, core_config, loop_built, neighbours, node
from tests.vcuda_fixtures import vcuda_built

__all__ = ["loop_built", "node", "vcuda_built"]  # fixtures

# Shares of GPU time measured against tight bounds: make test runs these apart from the CPU-heavy rest.
pytestmark = pytest.mark.timing

SETTLE_S = 2.0
WINDOW_S = 0.5
LONG_KERNEL_WINDOW_S = 1.0  # the windows of 50 ms kernels
LONG_PERIOD_SETTLE_S = 5.0  # before the windows, at a 1 s sampling period
WINDOWS = 6
WHOLE_PP = 4.0  # the whole measured span: within this many points of the limit
WINDOW_PP = 8.0  # every window (10 ms sampling period)
WINDOW_PP_LONG = 20.0  # every window at a 1/6 s period: three samples a window; a swing goes 0 <-> 100


def window_shares(
    node: Node,
    gpu: int,
    pids: set[int],
    *,
    settle: float = SETTLE_S,
    windows: int = WINDOWS,
    window: float = WINDOW_S,
) -> list[float]:
    """The processes' share (percent) of the GPU's time in ``windows`` consecutive windows of ``window`` seconds
    after ``settle`` seconds."""
    time.sleep(settle)
    out = []
    with GpuSimState(node.state) as st:
        before = st.timeline(gpu)
        for _ in range(windows):
            time.sleep(window)
            after = st.timeline(gpu)
            assert before is not None and after is not None
            out.append(100.0 * (after.busy_of(pids) - before.busy_of(pids)) / (after.now_ns - before.now_ns))
            before = after
    return out


CASES = [
    # (limit, kernel, processes, spread us, period us: "" for the timeline's 10 ms, the simulator's default and
    # kinder than an H200's 200 ms, which the cases with a period of 200000 use)
    (10, "spin_1ms", 4, "10000", ""),
    (30, "spin_1ms", 4, "9500", ""),
    (50, "spin_1ms", 4, "", ""),
    (70, "spin_1ms", 4, "10000", ""),
    (70, "spin_1ms", 3, "9500", ""),
    (30, "spin_50ms", 3, "10000", ""),
    (50, "spin_10us", 3, "10000", ""),
    (30, "spin_1ms", 1, "10000", ""),
    (10, "spin_1ms", 1, "", "166667"),
    (50, "spin_50ms", 1, "20000", "166667"),
    # Several processes at a 1/6 s period: each learnt its cost per launch at any sample of the container's, and
    # a process just started (a sliver of time) over a period's launches made the cost microseconds: a flood.
    (30, "spin_1ms", 4, "40000", "166667"),
    (70, "spin_1ms", 3, "40000", "166667"),
    (50, "spin_1ms", 3, "", "166667"),
    (30, "spin_1ms", 4, "", "200000"),
    (30, "spin_50ms", 3, "10000", "200000"),
    # NVML's longest documented sampling period, 1 s: more provisional charges a period than the ring's slots, and
    # the full ring's merges into its newest slot left a period's charges unrefunded (50 % gave about 30 %).
    (50, "spin_1ms", 1, "", "1000000"),
    (90, "spin_1ms", 1, "", "1000000"),
    # 50 ms kernels against the first guess of the cost (5 ms) flooded the GPU for a period, then held it at 0 %.
    (30, "spin_50ms", 1, "20000", "1000000"),
    (50, "spin_1ms", 3, "", "1000000"),
]


@pytest.mark.parametrize(("limit", "kernel", "processes", "spread", "period"), CASES)
def test_the_share_holds_at_wide_sample_spreads(
    node: Node, tmp_path: Path, limit: int, kernel: str, processes: int, spread: str, period: str
) -> None:
    sim = {"GPUSIM_PROCESS_SAMPLE_SPREAD_US": spread} if spread else {}
    # No period: the timeline's 10 ms, which these cases (and their tighter bound) were made for, whatever the default.
    sim["GPUSIM_PROCESS_SAMPLE_PERIOD_US"] = period or "0"
    # A window holds a few kernels of a 50 ms kernel's processes at most (3 at 30 % of 0.5 s): one kernel more or
    # less is 10 points, so their windows are 1 s (a process's pause and its catching up, one window each, read
    # 0 and 64 once in a serial run on a quiet machine while the whole held 30.2).
    window = LONG_KERNEL_WINDOW_S if kernel == "spin_50ms" else WINDOW_S
    # At a 1 s period the samples that teach each process its cost come a second apart, and where one process is
    # named per period a process waits for its own: 3 processes read 36-44 % in the first half-seconds after 2 s
    # (50 % limit) and rose to 53-57 %, so the whole of 3 s read 42.8-47.5 %. They are read after 5 s, over 1 s
    # windows (a window holds one sample).
    settle = LONG_PERIOD_SETTLE_S if period == "1000000" else SETTLE_S
    if period == "1000000":
        window = max(window, LONG_KERNEL_WINDOW_S)
    seconds = settle + window * WINDOWS + 1.0
    gpu = 8
    procs = [
        node.loop("c", gpu, seconds, core_config(limit) if k == 0 else None, kernel=kernel, pids=None, **sim)
        for k in range(processes)
    ]
    got = window_shares(node, gpu, {p.pid for p in procs}, settle=settle, window=window)
    for p in procs:
        _out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
    whole = sum(got) / len(got)
    print(limit, kernel, processes, spread, period, f"whole {whole:.1f}", " ".join(f"{g:.1f}" for g in got))  # for -s
    assert abs(whole - limit) <= WHOLE_PP, (whole, got)
    bound = WINDOW_PP_LONG if period else WINDOW_PP
    if kernel == "spin_50ms" and not period:
        # The gate admits whole kernels: at a window's edge each of three processes may start a 50 ms kernel on the
        # credit it holds, and the next window pays for them. One window read 39.8 then 20.1 (and 46 then 20 once)
        # while the pair held 30: these cases are held to the share of each two windows in a row.
        got = [(a + b) / 2 for a, b in itertools.pairwise(got)]
    assert all(abs(g - limit) <= bound for g in got), (limit, got)


def test_a_neighbours_frequent_samples_do_not_shrink_the_cost_before_the_containers_first_sample(node: Node) -> None:
    """At a 1/6 s sampling period a neighbour's samples (here every 5 ms) came long before the container's first:
    each halved the learnt cost per launch as if NVML saw no time for the launches completed, so the launches
    flooded the GPU and the debt then held the container at 0 %.  The cost now learns from the container's own
    samples only (sampled per process, as the neighbour is)."""
    p = node.loop(
        "a",
        4,
        SETTLE_S + WINDOW_S * WINDOWS + 1.0,
        core_config(30),
        GPUSIM_PROCESS_SAMPLE_PERIOD_US="166667",
        GPUSIM_PROCESS_SAMPLE_MODE=PER_PROCESS,
    )
    with neighbours(node.state, 4, 1, period=0.005):
        got = window_shares(node, 4, {p.pid})
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    whole = sum(got) / len(got)
    assert abs(whole - 30) <= WHOLE_PP, (whole, got)
    assert all(abs(g - 30) <= WINDOW_PP_LONG for g in got), got
