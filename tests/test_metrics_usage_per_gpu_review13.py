"""The usage metrics' SM share where NVML names one process per sampling period.

On an H200 with driver 580.159, each 200 ms sample of nvmlDeviceGetProcessUtilization names one process, with the
whole GPU's busy percent as its smUtil. Averaged over its own samples, a container's process named once in a second
read 99 %, whatever its share.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from gpumanager.metrics import usage


def _answer(samples: list[tuple[int, int, int]]) -> list[Any]:
    return [SimpleNamespace(pid=pid, timeStamp=ts, smUtil=sm) for pid, ts, sm in samples]


@pytest.fixture
def nvml_answers(monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    answers: list[list[Any]] = []
    monkeypatch.setattr(usage.nvml, "handle", lambda index: index)
    monkeypatch.setattr(
        pynvml,
        "nvmlDeviceGetComputeRunningProcesses",
        lambda handle: [SimpleNamespace(pid=pid, usedGpuMemory=1 << 20) for pid in (11, 22)],
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetProcessUtilization", lambda handle, since: answers.pop(0))
    return answers


def _share(sample: usage._GPUSample, pid: int) -> float:
    return sample.sm_sum.get(pid, 0.0) / sample.sm_count[pid] if pid in sample.sm_count else 0.0


def test_a_process_named_once_in_five_periods_reads_a_fifth(nvml_answers: list[list[Any]]) -> None:
    now = 1_000_000_000
    # One second of 200 ms periods: process 22 ran 4 of them, process 11 one; each named at the GPU's 99 %.
    nvml_answers.append(_answer([(22, now - 800_000, 99), (22, now - 600_000, 99), (11, now - 400_000, 99),
                                 (22, now - 200_000, 99), (22, now, 99)]))  # fmt: skip
    got = usage._sample_gpu(0, now - 1_000_000, now_us=now)
    assert _share(got, 11) == pytest.approx(19.8, abs=0.5)
    assert _share(got, 22) == pytest.approx(79.2, abs=0.5)


def test_per_process_samples_keep_their_own_average(nvml_answers: list[list[Any]]) -> None:
    """Sampled per process (each process's own share, once per answer), a sample is its process's average."""
    now = 1_000_000_000
    nvml_answers.append(_answer([(11, now - 3_000, 30), (22, now - 1_000, 70)]))
    got = usage._sample_gpu(0, now - 1_000_000, now_us=now)
    assert _share(got, 11) == pytest.approx(30)
    assert _share(got, 22) == pytest.approx(70)
