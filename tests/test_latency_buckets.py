"""The latency histograms resolve the range where an Allocate and a journal write live.

A quantile read from a histogram (Prometheus's ``histogram_quantile``, the allocation benchmark's figure of
the agent's own time) is interpolated within one bucket, as if its observations were spread evenly there.
Calls are not: most take about the same time and a few far longer. With bounds at 0.5, 1 and 2.5 ms, the
median of Allocates that mostly took 0.55 to 0.65 ms read as 0.9 ms, and it moved by 0.3 ms between runs of
the same code. These tests observe such latencies into the exported histograms and read the median back as
Prometheus would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from gpumanager import names
from gpumanager.metrics.calls import CallMetrics, CheckpointWriteMetrics


def _buckets(registry: CollectorRegistry, metric: str, labels: dict[str, str]) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of one histogram series, in order."""
    out = []
    for family in registry.collect():
        for sample in family.samples:
            if sample.name != metric + "_bucket":
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                out.append((float(sample.labels["le"]), sample.value))
    return sorted(out)


def _median(buckets: list[tuple[float, float]]) -> float:
    """The median as histogram_quantile(0.5, ...) interpolates it."""
    total = buckets[-1][1]
    rank, lower, below = 0.5 * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    raise AssertionError("no bucket holds the median")


def _clustered(rng: random.Random, low_ms: float, high_ms: float, tail_ms: float) -> list[float]:
    """Seconds as calls take them: most in a narrow band, the rest spread up to a tail."""
    cluster = [rng.uniform(low_ms, high_ms) / 1000 for _ in range(121)]
    tail = [rng.uniform(high_ms, tail_ms) / 1000 for _ in range(80)]
    return sorted(cluster + tail)


@pytest.mark.parametrize("low_ms, high_ms", [(0.26, 0.32), (0.55, 0.65), (0.7, 0.8), (1.05, 1.2), (1.7, 1.9)])
def test_the_median_allocate_reads_back_within_a_quarter_millisecond(low_ms: float, high_ms: float) -> None:
    registry = CollectorRegistry()
    calls = CallMetrics(registry)
    rng = random.Random(f"{low_ms}-{high_ms}")
    taken = _clustered(rng, low_ms, high_ms, 3.0)
    for seconds in taken:
        calls.observe(names.VCORE_RESOURCE, "Allocate", seconds, True)
    buckets = _buckets(
        registry,
        "gpu_manager_kubelet_call_duration_seconds",
        {"resource": names.VCORE_RESOURCE, "call": "Allocate"},
    )
    read = _median(buckets)
    assert abs(read - taken[100]) <= 0.00025, (read, taken[100], buckets)


@pytest.mark.parametrize("low_ms, high_ms", [(0.2, 0.26), (0.27, 0.3), (0.42, 0.46), (0.6, 0.7)])
def test_the_median_journal_write_reads_back_within_a_tenth_of_a_millisecond_below_half_one(
    low_ms: float, high_ms: float
) -> None:
    registry = CollectorRegistry()
    writes = CheckpointWriteMetrics(registry)
    rng = random.Random(f"{low_ms}-{high_ms}")
    taken = _clustered(rng, low_ms, high_ms, 2.5)
    for seconds in taken:
        writes.observe("journal", seconds)
    buckets = _buckets(registry, "gpu_manager_checkpoint_write_duration_seconds", {"kind": "journal"})
    read = _median(buckets)
    # Within the bucket that holds it: 0.1 ms wide up to 0.5 ms, 0.25 ms up to 1 ms.
    allowed = 0.0001 if taken[100] < 0.0005 else 0.00025
    assert abs(read - taken[100]) <= allowed, (read, taken[100], buckets)


def test_every_call_and_write_series_still_ends_at_its_longest_bound() -> None:
    registry = CollectorRegistry()
    CallMetrics(registry)
    CheckpointWriteMetrics(registry)
    calls = _buckets(
        registry,
        "gpu_manager_kubelet_call_duration_seconds",
        {"resource": names.VMEMORY_RESOURCE, "call": "PreStartContainer"},
    )
    writes = _buckets(registry, "gpu_manager_checkpoint_write_duration_seconds", {"kind": "snapshot"})
    # A Prepare waiting on a slow API server (15 s) and a stalled network disk still land in a finite bucket.
    assert [le for le, _ in calls][-2:] == [60.0, float("inf")]
    assert [le for le, _ in writes][-2:] == [10.0, float("inf")]
