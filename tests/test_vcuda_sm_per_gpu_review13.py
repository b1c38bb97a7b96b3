"""The SM share where NVML names one process per sampling period (GPUSIM_PROCESS_SAMPLE_MODE=gpu).

On an H200 with driver 580.159, nvmlDeviceGetProcessUtilization gives one sample per 200 ms for the whole GPU. Each
sample names one process, the one resident when it was taken, and its smUtil is the whole GPU's busy percent: two
unlimited processes were named in turn, each at 99 %. There, a 30 % container beside an unlimited process ran at
6.5 % of the GPU and was never named, and a 30/70 pair ran at 15.5/66.5 %. The limiter charged each sample over
the time since the container's own previous one (up to a second at 99 %), and never counted the periods named for
others as idle. The simulator, in that mode, reproduces it: 1.9 % and 6.7/63.7 %.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.test_vcuda_compute import BUILD, Node, core_config, loop_built, node, run_python, shares
from tests.vcuda_fixtures import last_json, vcuda_built

__all__ = ["loop_built", "node", "vcuda_built"]  # fixtures

# The real driver's sampling: one process per 200 ms period, the GPU's busy percent.
PER_GPU = {"GPUSIM_PROCESS_SAMPLE_MODE": "gpu", "GPUSIM_PROCESS_SAMPLE_PERIOD_US": "200000"}


def _run(
    node: Node, plan: dict[str, bytes | None], seconds: float, settle: float, measure: float, period_us: int = 200_000
) -> dict[str, float]:
    """Each process's share of GPU 8 (by the simulated timeline, not by NVML); a None config: no interceptor."""
    procs: dict[str, tuple[int, subprocess.Popen[str]]] = {}
    for name, config in plan.items():
        plain = {"LD_LIBRARY_PATH": str(BUILD / "sim")} if config is None else {}
        sampling = {**PER_GPU, "GPUSIM_PROCESS_SAMPLE_PERIOD_US": str(period_us)}
        procs[name] = (8, node.loop(name, 8, seconds, config, **sampling, **plain))
    return shares(node, procs, settle, measure)


def test_the_simulated_driver_names_one_process_per_period_with_the_gpus_busy_percent(node: Node) -> None:
    """Two unlimited processes: every sample names one of them, one sample per period, each at the GPU's 100 %."""
    sim = {"LD_LIBRARY_PATH": str(BUILD / "sim"), **PER_GPU}
    loops = [node.loop(f"p{i}", 3, 3.0, None, **sim) for i in range(2)]
    env = node.env("reader", None)
    env.update(sim)
    done = run_python(
        r"""
import time, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(3)
time.sleep(2.2)
since = int(time.time() * 1e6) - 1_500_000
samples = [(s.pid, s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(h, since)]
print(json.dumps({"samples": samples}))
""",
        env,
    )
    for p in loops:
        p.communicate(timeout=60)
    assert done.returncode == 0, done.stderr
    r = last_json(done.stdout)
    assert isinstance(r, dict)
    samples = r["samples"]
    stamps = [ts for _pid, ts, _util in samples]
    assert len(samples) >= 4 and len(set(stamps)) == len(stamps), samples  # one process per sample
    steps = {b - a for a, b in zip(sorted(stamps), sorted(stamps)[1:], strict=False)}
    assert steps == {200_000}, samples  # one per period
    assert {util for _pid, _ts, util in samples} == {100}, samples  # the GPU's busy percent, not the process's
    assert {pid for pid, _ts, _util in samples} <= {p.pid for p in loops}


@pytest.mark.timing
def test_a_container_beside_an_unlimited_process_keeps_its_share(node: Node) -> None:
    """At the real driver's 200 ms: 8 s are 40 samples, each naming one process, so the share read over them
    swings by several points from run to run; before, the container ran at 2 %."""
    got = _run(node, {"30": core_config(30), "plain": None}, 13.0, 3.0, 8.0)
    assert 15 <= got["30"] <= 45, got


@pytest.mark.timing
def test_two_containers_split_30_70(node: Node) -> None:
    """At a 50 ms period (160 samples in the window: a fourth of the swing of 200 ms samples)."""
    got = _run(node, {"30": core_config(30), "70": core_config(70)}, 13.0, 3.0, 8.0, period_us=50_000)
    assert 22 <= got["30"] <= 38 and 62 <= got["70"] <= 78, got
