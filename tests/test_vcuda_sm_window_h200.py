"""The SM share where NVML answers as an H200 with driver 580.159 does (GPUSIM_PROCESS_SAMPLE_MODE=window).

Recorded there (tests/data/h200_nvml_samples.json): the driver takes one sample per 200 ms for the whole GPU, naming
the process with the most GPU time in the period, with the GPU's busy percent. A query from a recent
``lastSeenTimeStamp`` answers ONE sample per process named since, at its newest period's time, averaged over all
the window's periods: two busy processes read 50 and 50 when each was named once in the window, 99 when one was
named in both; a 30 % container alone reads 30. A query from 0 gives the driver's whole buffer, one sample per
period. So the limiter sees per-process sampling, and a container held to a few percent beside a busier one is never
named: on the H200, a 30 % container beside a 70 % one ran at 7 % of the GPU (63 kernels/s of 1 ms) with a cost per
launch learnt at 8.1 ms from its first sample (the whole GPU's time over its first launches) or kept at the 5 ms
guess, and never relearnt.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.test_vcuda_compute import BUILD, Node, core_config, loop_built, node, run_python, shares
from tests.vcuda_fixtures import last_json, vcuda_built

__all__ = ["loop_built", "node", "vcuda_built"]  # fixtures

H200 = {"GPUSIM_PROCESS_SAMPLE_MODE": "window", "GPUSIM_PROCESS_SAMPLE_PERIOD_US": "200000"}
RECORDED = Path(__file__).parent / "data" / "h200_nvml_samples.json"


def _run(node: Node, plan: dict[str, bytes | None], seconds: float, settle: float, measure: float) -> dict[str, float]:
    """Each process's share of GPU 8 (by the simulated timeline, not by NVML); a None config: no interceptor."""
    procs: dict[str, tuple[int, subprocess.Popen[str]]] = {}
    for name, config in plan.items():
        plain = {"LD_LIBRARY_PATH": str(BUILD / "sim")} if config is None else {}
        procs[name] = (8, node.loop(name, 8, seconds, config, **H200, **plain))
    return shares(node, procs, settle, measure)


def test_the_simulated_driver_answers_a_window_as_the_h200_did(node: Node) -> None:
    """Two unlimited processes: a query from 0.5 s back holds at most one sample per process, their averages add up
    to the GPU's busy percent, and a query from 0 holds one sample per period."""
    sim = {"LD_LIBRARY_PATH": str(BUILD / "sim"), **H200}
    loops = [node.loop(f"p{i}", 3, 3.2, None, **sim) for i in range(2)]
    env = node.env("reader", None)
    env.update(sim)
    done = run_python(
        r"""
import time, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(3)
time.sleep(2.3)
since = int(time.time() * 1e6) - 500_000
window = [(s.pid, s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(h, since)]
whole = [(s.pid, s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(h, 0)]
print(json.dumps({"window": window, "whole": whole}))
""",
        env,
    )
    for p in loops:
        p.communicate(timeout=60)
    assert done.returncode == 0, done.stderr
    r = last_json(done.stdout)
    assert isinstance(r, dict)
    window, whole = r["window"], r["whole"]
    pids = [pid for pid, _ts, _util in window]
    assert 1 <= len(window) <= 2 and len(set(pids)) == len(pids), window  # one sample per process named
    assert set(pids) <= {p.pid for p in loops}
    assert 95 <= sum(util for _pid, _ts, util in window) <= 100, window  # the busy GPU, split by namings
    stamps = sorted(ts for _pid, ts, _util in whole)
    assert len(whole) >= 4 and {b - a for a, b in itertools.pairwise(stamps)} == {200_000}, whole
    assert {util for _pid, _ts, util in whole} == {100}, whole


def test_the_recording_shows_what_the_simulator_plays() -> None:
    """The H200's own answers (recorded with the self-test's programs): windows of 300 ms hold one sample per
    process; two busy processes named once each read about 50 and 50; a 30 % container alone reads about 30."""
    data = json.loads(RECORDED.read_text())
    pair = [a for _t, a in data["pair_unlimited"]["recent"] if isinstance(a, list)]
    assert pair and all(len({s[0] for s in a}) == len(a) for a in pair)  # one sample per process
    both = [a for a in pair if len(a) == 2]
    assert both and all(sum(s[2] for s in a) in range(95, 102) and all(40 <= s[2] <= 60 for s in a) for a in both)
    alone = [a for _t, a in data["alone_30"]["recent"] if isinstance(a, list) and len(a) == 1]
    steady = [a[0][2] for a in alone[4:]]  # after the first second (the loop starts)
    assert steady and all(27 <= util <= 33 for util in steady), steady


def _costs(stderr: str) -> list[tuple[float, bool]]:
    """The cost per launch (us) and whether it is still the guess, from each DEBUG line of the limiter."""
    found = re.findall(r"cost ([0-9.]+) us( \(guess\))?", stderr)
    return [(float(cost), bool(guess)) for cost, guess in found]


@pytest.mark.timing
def test_a_container_never_named_paces_by_its_wall_time_not_the_guess(node: Node) -> None:
    """A 30 % container beside an unlimited process is rarely named, so NVML never tells its cost per launch: it kept
    the 5 ms guess for its 1 ms kernels and ran at 7 % of the GPU (the H200: 7 %, 63-85 kernels/s). The wall time its
    launches are outstanding bounds their cost: 3-4.6 ms here (each waits for the other's 1 ms time slice, and the
    launches still outstanding when the bound is set count in its wall time), about 1.2 ms on the H200, where it then
    ran at 12.6 %. Not over its limit either way."""
    config = core_config(30)
    limited = node.loop("30", 8, 9.0, config, **H200, LOGGER_LEVEL="5")
    plain = node.loop("plain", 8, 9.0, None, LD_LIBRARY_PATH=str(BUILD / "sim"), **H200)
    time.sleep(3.0)
    with GpuSimState(node.state) as st:
        before = st.timeline(8)
        time.sleep(5.0)
        after = st.timeline(8)
    assert before is not None and after is not None
    share = 100.0 * (after.busy_of({limited.pid}) - before.busy_of({limited.pid})) / (after.now_ns - before.now_ns)
    _out, err = limited.communicate(timeout=60)
    plain.communicate(timeout=60)
    assert limited.returncode == 0, err
    costs = _costs(err)
    print("beside an unlimited process", share, costs[-4:])
    assert len(costs) >= 6, err[-2000:]
    late = [cost for cost, _guess in costs[len(costs) // 2 :]]
    # 5000 (the guess) all along before; the bound is dropped for a moment (the guess again) when launches take twice
    # longer than it allows, as a queue of longer kernels would
    assert sum(late) / len(late) <= 4200, costs
    assert share <= 33, share


@pytest.mark.timing
def test_a_pair_keeps_each_container_under_its_limit(node: Node) -> None:
    """30/70: neither goes over its limit (the H200: 30.1/69.9 % of the pair's GPU time in the self-test, 92 % of what
    two containers without a limit ran; 9.7/90.3 % and 74.8 % before)."""
    got = _run(node, {"30": core_config(30), "70": core_config(70)}, 13.0, 3.0, 8.0)
    print("30/70", got)
    assert got["30"] <= 33 and got["70"] <= 73, got


@pytest.mark.timing
@pytest.mark.xfail(
    reason="known: in the simulator a 30 % container beside a 70 % one gets 10-12 % of the GPU; the wall bound of its "
    "cost is 2.6 ms for 1 ms kernels there (each waits for the other's 1 ms time slice), 1.2-1.4 ms on the H200 "
    "(where the pair split 30.1/69.9)",
    strict=False,
)
def test_a_pair_splits_30_70(node: Node) -> None:
    got = _run(node, {"30": core_config(30), "70": core_config(70)}, 13.0, 3.0, 8.0)
    assert 22 <= got["30"] <= 33 and 62 <= got["70"] <= 73, got
