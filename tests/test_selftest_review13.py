"""The self-test's "two containers 30/70" rows on a real, time-sliced GPU: judged by GPU time, not by NVML.

Figures recorded on an NVIDIA H200 (driver 580.159.04, cuda-bindings 13.3.1):

- two plain processes launching ``spin_1000us`` (1 ms of ``%globaltimer``) back to back at once completed 668/s
  each, against 999/s for one alone: the GPU time-slices between their contexts and a spin preempted mid-way
  ends as soon as it resumes (its timer ran on), so kernels/s of a timer spin are not GPU time.  A plain
  ``%clock64`` spin read the same 668/s each: the SM cycle counter also runs on while a context is out;
- ``spin_cycles_1000us`` (cycles counted only while its context runs) completed 465/s each in the same pair:
  930/s together, its GPU time (two contexts lose about 7 % of the GPU to switching);
- NVML's per-process utilisation gives one sample per 200 ms period for the whole GPU, naming one process with the
  whole GPU's busy percent: over a few seconds a container's figure is 0 or 99 by the luck of a few samples;
- the interceptor's 30/70 pair, measured with the cycle spin: 64/s and 630/s.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from gpumanager.selftest import checks, programs

TIMER_ALONE = 999.0  # spin_1000us, one plain process alone
TIMER_EACH_OF_TWO = 668.0  # spin_1000us, each of two plain processes at once
CYCLES_EACH_OF_TWO = 465.0  # spin_cycles_1000us, each of two plain processes at once


class _NoSampler:
    def __init__(self, gpu_index: int) -> None:
        pass


def _limit_of(env: Mapping[str, str]) -> int:
    """The SM limit a container's environment was given (0: none), from its vcuda.config as the agent writes it."""
    from gpumanager.vmanager.files import unpack

    return int(unpack(Path(env["VCUDA_CONFIG_PATH"]).read_bytes()).utilization)


def _recorded(
    monkeypatch: pytest.MonkeyPatch,
    timer: Mapping[int, tuple[float, float | None]],
    cycles: Mapping[int, tuple[float, float | None]],
) -> list[tuple[str, list[int]]]:
    """Replaces the launch loops by recorded figures, per kernel and per container limit (0: none); with two
    containers at once, the figures of a pair.  Returns the runs asked for: (kernel, the containers' limits)."""
    runs: list[tuple[str, list[int]]] = []

    def spin(s: checks.Setup, envs: Sequence[Mapping[str, str]], sampler: object, program: str | None = None):  # type: ignore[no-untyped-def]
        kernel = "cycles" if program is not None and program is getattr(programs, "SPIN_CYCLES", None) else "timer"
        limits = [_limit_of(env) for env in envs]
        runs.append((kernel, limits))
        table = cycles if kernel == "cycles" else timer
        if len(envs) == 2 and limits == [0, 0]:
            return [table[-1], table[-1]]  # each of two without a limit
        return [table[limit] for limit in limits]

    monkeypatch.setattr(checks, "_spin", spin)
    monkeypatch.setattr(checks, "UtilSampler", _NoSampler)
    return runs


def _setup(tmp_path: Path, tolerance: float = 3.0) -> checks.Setup:
    return checks.Setup(uuid="GPU-x", gpu_index=0, gpu_total=1 << 34, work=tmp_path, mirror=tmp_path, direct=tmp_path,
                        cap=1 << 30, settle=0.1, measure=0.1, tolerance=tolerance, calls=10,
                        base_env={"PATH": os.environ.get("PATH", "")})  # fmt: skip


def _pair_rows(rows: Sequence[checks.Row]) -> dict[str, checks.Row]:
    return {r.name: r for r in rows if r.name.startswith("two containers")}


def _percent(text: str) -> float:
    match = re.search(r"(\d+\.\d) % of the pair's GPU time", text)
    assert match, text
    return float(match.group(1))


# The single-container rows, as they passed on the H200 (throughput and NVML agree when one container runs).
SINGLE = {0: (TIMER_ALONE, 99.0), 30: (304.0, 30.1), 70: (703.0, 70.1)}


def test_two_containers_whose_limiters_do_nothing_read_half_each_of_the_gpu_time_not_two_thirds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two containers that each take what the GPU gives them (no limiter at work): with the timer spin each completed
    668/s against 999/s alone, which read "throughput 66.9 %" for both: two thirds of the GPU each, 133 % of it
    together, and within 4 points of the 70 % one's limit.  In GPU time each had half of it."""
    _recorded(monkeypatch, timer={**SINGLE, 30: (TIMER_EACH_OF_TWO, 99.0), 70: (TIMER_EACH_OF_TWO, 0.0),
                                  -1: (TIMER_EACH_OF_TWO, 99.0)},
              cycles={0: (998.7, 99.0), 30: (CYCLES_EACH_OF_TWO, 99.0), 70: (CYCLES_EACH_OF_TWO, 0.0),
                      -1: (CYCLES_EACH_OF_TWO, 99.0)})  # fmt: skip
    rows = _pair_rows(checks.sm_shares(_setup(tmp_path, tolerance=4.0), [30, 70]))
    low, high = rows["two containers: the 30 % one"], rows["two containers: the 70 % one"]
    assert not low.ok and not high.ok, (low, high)
    assert _percent(low.result) == pytest.approx(50.0) and _percent(high.result) == pytest.approx(50.0)
    together = rows["two containers together"]
    assert together.ok, together  # they kept the GPU busy: only the split is wrong
    assert "100.0 %" in together.result


def test_the_interceptors_pair_on_the_h200_is_read_as_the_gpu_time_each_container_had(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The interceptor's 30/70 pair completed 64 and 630 cycle spins/s: 9.2 and 90.8 % of the pair's GPU time, and
    together 75 % of what two containers without a limit had.  NVML's figures (0 and 70) are shown, not judged."""
    _recorded(monkeypatch, timer=SINGLE,
              cycles={30: (64.0, 0.0), 70: (630.0, 70.3), -1: (CYCLES_EACH_OF_TWO, 99.0)})  # fmt: skip
    rows = _pair_rows(checks.sm_shares(_setup(tmp_path), [30, 70]))
    low, high = rows["two containers: the 30 % one"], rows["two containers: the 70 % one"]
    together = rows["two containers together"]
    assert not low.ok and "OFF: 9.2 % of the pair's GPU time (64 of 694 kernels/s; limit 30 %)" in low.result
    assert not high.ok and _percent(high.result) == pytest.approx(90.8)
    assert "NVML 0.0 %" in low.result and "not judged" in low.result
    assert not together.ok and "74.6 %" in together.result and "694 of 930" in together.result


def test_a_pair_that_splits_the_gpu_30_70_passes_whatever_nvmls_samples_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NVML names one process per 200 ms period, with the whole GPU's busy percent: over a measurement window
    the 30 % container may get no sample at all (0 %) and the 70 % one all of them (99 %).  No limiter can meet
    a 3-point check on that; the pair's GPU time, counted by cycle spins, is what is judged."""
    _recorded(monkeypatch, timer=SINGLE,
              cycles={30: (279.0, 0.0), 70: (651.0, 99.0), -1: (CYCLES_EACH_OF_TWO, 99.0)})  # fmt: skip
    rows = _pair_rows(checks.sm_shares(_setup(tmp_path), [30, 70]))
    assert all(r.ok for r in rows.values()), rows
    assert _percent(rows["two containers: the 30 % one"].result) == pytest.approx(30.0)
    assert _percent(rows["two containers: the 70 % one"].result) == pytest.approx(70.0)
    assert "NVML 0.0 %" in rows["two containers: the 30 % one"].result


def test_the_pair_runs_the_cycle_spin_and_the_single_containers_the_timer_spin(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    runs = _recorded(monkeypatch, timer=SINGLE,
                     cycles={30: (279.0, 30.0), 70: (651.0, 70.0), -1: (CYCLES_EACH_OF_TWO, 99.0)})  # fmt: skip
    checks.sm_shares(_setup(tmp_path), [30, 70])
    assert runs == [("timer", [0]), ("timer", [30]), ("timer", [70]), ("cycles", [0, 0]), ("cycles", [30, 70])]


def test_a_limited_pair_above_two_unlimited_containers_is_no_fault() -> None:
    """Two limited contexts can switch less often than two unlimited ones, and lose less of the GPU to it."""
    rows = _pair_rows(checks.judge_pair(930.0, [(300.0, None), (699.0, None)], 3.0))
    assert all(r.ok for r in rows.values()), rows
    assert "107.4 %" in rows["two containers together"].result
    assert "no NVML sample" in rows["two containers: the 30 % one"].result


def test_a_pair_that_completed_nothing_fails_every_row() -> None:
    rows = _pair_rows(checks.judge_pair(930.0, [(0.0, None), (0.0, None)], 3.0))
    assert [r.ok for r in rows.values()] == [False, False, False]


def test_no_cycle_spin_completed_without_a_limit_is_an_error_row(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _recorded(monkeypatch, timer=SINGLE, cycles={-1: (0.0, None)})
    rows = checks.sm_shares(_setup(tmp_path), [30])
    assert rows[-1].name == "two containers 30/70" and not rows[-1].ok
    assert "error:" in rows[-1].result and "two containers without a limit" in rows[-1].result


def _entry(name: str) -> str:
    return programs.PTX.split(f".entry {name}(", 1)[1].split("\n}", 1)[0]


def test_the_cycle_spin_counts_only_the_cycles_its_context_ran() -> None:
    """A %clock64 spin that counts every cycle since it started ends early when preempted (the counter runs on
    while the context is out: 668/s each of two on the H200, as the timer spin); this one leaves out any gap
    between two reads longer than a running warp's, and its name gives the simulated GPU its length (1 ms)."""
    body = _entry("spin_cycles_1000us")
    assert "%clock64" in body and "%globaltimer" not in body
    assert re.search(r"setp\.lt\.u64 %p\d, %rd4, 65536;", body)  # the gap between two reads, bounded
    assert re.search(r"@%p\d add\.s64 %rd5, %rd5, %rd4;", body)  # counted only when within the bound
    assert "spin_cycles_1000us" in programs.SPIN_CYCLES and "CLOCK_RATE" in programs.SPIN_CYCLES


def test_the_cycle_spin_lasts_its_named_millisecond_on_the_simulated_gpu(tmp_path: Path) -> None:
    """The simulated driver gives a kernel the duration its name ends in; two plain processes at once share the
    simulated GPU's time, each completing half of what one alone does, as the cycle spin does on a real GPU."""
    from simnode.gpusim_state import sim_env, spec_dir
    from tests.vcuda_fixtures import BUILD

    if not (BUILD / "sim" / "libcuda.so.1").exists():
        pytest.skip("the simulated driver is not built (make build)")
    env = sim_env(spec_dir() / "t4-x1.json", tmp_path / "node.state")
    spec = json.loads((spec_dir() / "t4-x1.json").read_text())
    uuid = spec["gpus"][0]["uuid"]
    setup = checks.Setup(uuid=uuid, gpu_index=0, gpu_total=1 << 34, work=tmp_path, mirror=tmp_path, direct=tmp_path,
                         cap=1 << 30, settle=0.3, measure=1.0, tolerance=3.0, calls=10, base_env=env)  # fmt: skip
    setup.plain = lambda: dict(env)  # type: ignore[method-assign]

    class Sampler:
        def start(self) -> None:
            pass

        def stop(self) -> None:
            pass

        def share(self, pid: int, window: tuple[int, int]) -> float | None:
            return None

    (alone,) = checks._spin(setup, [setup.plain()], Sampler(), programs.SPIN_CYCLES)  # type: ignore[arg-type]
    pair = checks._spin(setup, [setup.plain(), setup.plain()], Sampler(), programs.SPIN_CYCLES)  # type: ignore[arg-type]
    assert alone[0] == pytest.approx(1000.0, rel=0.1)  # 1 ms each
    assert [rate for rate, _ in pair] == [pytest.approx(500.0, rel=0.15)] * 2
