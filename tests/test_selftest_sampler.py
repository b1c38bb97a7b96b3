"""The self-test's NVML sampler against a recorded pattern of GPU time, and the launch loops' end.

The fake NVML below answers nvmlDeviceGetProcessUtilization as the simulated driver does
(vcuda/sim/sim_timeline.c, sim_tl_process_util) and as NVIDIA documents it: one sample per running
process that had non-zero utilisation since ``lastSeenTimeStamp`` (its own CLOCK_REALTIME us
timestamp, a moment of a 10 ms sampling period; its SM percent averaged from ``lastSeenTimeStamp``,
at most a second back), NOT_FOUND when no process has one, nothing for a process that has exited.
The clock is the test's: the sampler's thread is not started, each poll is the test's call.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gpumanager.selftest import checks, programs

S = 1_000_000  # us
T0 = 1_800_000_000 * S  # CLOCK_REALTIME, us
NOT_FOUND = 6
PERIOD = 10_000  # the sampling period, us


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


@dataclass
class Busy:
    """``pid`` kept the GPU ``fraction`` busy from ``start`` to ``end`` (seconds after T0)."""

    pid: int
    start: float
    end: float
    fraction: float


class FakeNVML:
    NVMLError = FakeNVMLError
    NVML_ERROR_NOT_FOUND = NOT_FOUND

    def __init__(self, busy: Sequence[Busy], exits: dict[int, float], offsets: dict[int, int]) -> None:
        self.busy, self.exits, self.offsets = list(busy), exits, offsets
        self.now = T0

    def busy_us(self, pid: int, lo: int, hi: int) -> float:
        return sum(b.fraction * max(0, min(hi, T0 + int(b.end * S)) - max(lo, T0 + int(b.start * S)))
                   for b in self.busy if b.pid == pid)  # fmt: skip

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "gpu0"

    def nvmlDeviceGetProcessUtilization(self, handle: str, last_seen: int) -> list[SimpleNamespace]:
        checkpoint = self.now - (self.now - T0) % PERIOD
        first = max(last_seen, self.now - S)
        samples = []
        for pid, offset in self.offsets.items():
            if T0 + self.exits.get(pid, 1e9) * S <= self.now:
                continue  # not running: NVML tells nothing of it
            at = checkpoint - offset
            busy = self.busy_us(pid, first, at)
            if at > last_seen and at > first and busy > 0:
                samples.append(SimpleNamespace(pid=pid, timeStamp=at, smUtil=round(100 * busy / (at - first))))
        if not samples:
            raise FakeNVMLError(NOT_FOUND)
        return samples


def sampled(nvml: FakeNVML, polls: Sequence[float], window: tuple[float, float], pid: int) -> tuple[float, float]:
    """(the sampler's share of ``pid`` over ``window``, the true one): sampling from T0, a poll at each of
    ``polls`` (seconds), the last one being the sampler's stop."""
    sampler = checks.UtilSampler(0, nvml=nvml, clock=lambda: nvml.now / S)
    sampler.begin()
    for at in polls[:-1]:
        nvml.now = T0 + int(at * S)
        sampler.poll()
    nvml.now = T0 + int(polls[-1] * S)
    sampler.stop()
    lo, hi = T0 + int(window[0] * S), T0 + int(window[1] * S)
    got = sampler.share(pid, (lo, hi))
    assert got is not None
    return got, 100 * nvml.busy_us(pid, lo, hi) / (hi - lo)


def test_a_limited_process_held_idle_at_the_end_of_its_window_is_counted_idle_there() -> None:
    """As seen under a loaded suite (limit 30 %, throughput 30 %, NVML 81 %): the limiter let the process
    run flat out for 0.45 s, then held it idle for the rest of its window. NVML has no sample of a
    process that was idle (NOT_FOUND), so the samples ended at the burst, and the share was read
    over the burst alone: 64 % for the window's 32 %."""
    pid = 4242
    busy = [Busy(pid, 0.3, 1.0, 1.0), Busy(pid, 1.0, 2.25, 0.1), Busy(pid, 2.25, 2.7, 1.0)]
    nvml = FakeNVML(busy, exits={pid: 3.9}, offsets={pid: 3_000})
    # Every 0.25 s; the stop (the launch loop still running) NVML's lag after the window's end.
    polls = [0.25 * k for k in range(1, 15)] + [3.5 + checks.SAMPLE_LAG]
    got, true = sampled(nvml, polls, (2.0, 3.5), pid)
    assert true == pytest.approx(31.7, abs=0.1)
    assert got == pytest.approx(true, abs=2)


def test_a_long_idle_stretch_inside_the_window_is_not_credited_with_the_next_bursts_rate() -> None:
    """Idle for 1.5 s (NVML: NOT_FOUND at every poll), then a burst: the burst's sample is NVML's mean
    over at most the last second; credited from the sample before the idle stretch, that mean was
    spread over 1.75 s, three quarters of a second of which it does not describe (31 % for 26 %)."""
    pid = 77
    busy = [Busy(pid, 0.1, 0.5, 1.0), Busy(pid, 2.0, 2.5, 1.0), Busy(pid, 2.5, 3.0, 0.3)]
    nvml = FakeNVML(busy, exits={}, offsets={pid: 7_000})
    polls = [0.25 * k for k in range(1, 13)] + [3.25]
    got, true = sampled(nvml, polls, (0.5, 3.0), pid)
    assert got == pytest.approx(true, abs=2)


def test_two_processes_one_idle_at_the_end() -> None:
    """Two containers: the one whose last stretch of its window was idle is not read as busier than it was."""
    a, b = 100, 200
    busy = [Busy(a, 0.2, 3.0, 0.3), Busy(b, 0.2, 1.8, 0.9)]
    nvml = FakeNVML(busy, exits={}, offsets={a: 1_000, b: 6_000})
    polls = [0.25 * k for k in range(1, 13)] + [3.3]
    for pid in (a, b):
        nvml.now = T0
        got, true = sampled(nvml, polls, (1.0, 3.0), pid)
        assert got == pytest.approx(true, abs=2), pid


def test_an_nvml_error_other_than_not_found_tells_nothing() -> None:
    """Only NOT_FOUND says that no process ran; another error (the GPU lost) leaves the time unsampled."""

    class Failing(FakeNVML):
        def nvmlDeviceGetProcessUtilization(self, handle: str, last_seen: int) -> list[SimpleNamespace]:
            raise FakeNVMLError(999)

    nvml = Failing([], exits={}, offsets={1: 0})
    sampler = checks.UtilSampler(0, nvml=nvml, clock=lambda: nvml.now / S)
    sampler.begin()
    nvml.now = T0 + 2 * S
    sampler.stop()
    assert sampler.share(1, (T0, T0 + S)) is None


# ---- the launch loops end after the last poll ------------------------------------------------------

#: A launch loop without CUDA: it reports a window that ended just now, then does what SPIN does after
#: its report.
FAKE_SPIN_HEAD = r"""
import json, os, sys, time
class d:  # launches that take 2 ms each
    @staticmethod
    def cuLaunchKernel(*args):
        time.sleep(0.002)
        return (0,)
fn = stream = params = None
print("running", flush=True)
time.sleep(0.05)
now = int(time.time() * 1e6)
print(json.dumps({"rate": 300.0, "pid": os.getpid(), "from_us": now - 100000, "to_us": now}), flush=True)
"""


class _Watcher:
    """A sampler that records, at its stop (its last poll), which launch loops were still running and when it
    came, and the windows it was asked about."""

    pids: list[int] = []
    stops: list[tuple[list[bool], float]] = []
    windows: list[tuple[int, int]] = []

    def __init__(self, gpu_index: int) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        self.stops.append(([_running(pid) for pid in self.pids], time.time()))

    def share(self, pid: int, window: tuple[int, int]) -> float | None:
        self.windows.append(window)
        return 30.0

    def others(self, pids: set[int], window: tuple[int, int]) -> dict[int, float]:
        return {}


def record_started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """subprocess.Popen patched to note the PID of each process it starts; the list they are noted in."""
    started: list[int] = []
    popen = subprocess.Popen

    def recording_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = popen(*args, **kwargs)
        started.append(proc.pid)
        return proc

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    return started


def fake_setup(tmp_path: Path, **env: str) -> checks.Setup:
    """A selftest set-up of a 16 GiB GPU-x with 0.1 s windows, its files in tmp_path, env added to PATH."""
    return checks.Setup(uuid="GPU-x", gpu_index=0, gpu_total=1 << 34, work=tmp_path, mirror=tmp_path,
                        direct=tmp_path, cap=1 << 30, settle=0.1, measure=0.1, tolerance=3.0, calls=10,
                        base_env={"PATH": os.environ.get("PATH", ""), **env})  # fmt: skip


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_last_poll_comes_after_nvmls_lag_while_the_launch_loops_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NVML has no sample of a process that has exited, so a loop that ended before the last poll lost its
    last stretch; and a poll sooner than NVML's sampling lag after the windows' end cannot tell whether
    they were idle at their end."""
    hold = "def hold(" + programs.PRELUDE.split("def hold(", 1)[1]
    tail = programs.SPIN.split("report(rate=", 1)[1].split("\n", 1)[1]  # what SPIN does after its report
    monkeypatch.setattr(programs, "SPIN", FAKE_SPIN_HEAD + hold + tail)
    started = record_started(monkeypatch)
    _Watcher.pids, _Watcher.stops, _Watcher.windows = started, [], []
    setup = fake_setup(tmp_path)
    results = checks._spin(setup, [setup.plain(), setup.plain()], _Watcher(0))  # type: ignore[arg-type]
    assert results == [(300.0, 30.0), (300.0, 30.0)]
    ((alive, stopped_at),) = _Watcher.stops
    assert alive == [True, True]
    assert stopped_at * 1e6 >= max(end for _, end in _Watcher.windows) + checks.SAMPLE_LAG * 1e6
    assert not any(_running(pid) for pid in started)  # released and reaped after the last poll
