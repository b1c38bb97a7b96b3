"""Latency and outcome of the kubelet's calls (Allocate, PreStartContainer), per resource."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gpumanager import names

# From 0.25 ms, closely up to 2.5 ms, where an Allocate answers (a journal write, a fraction of a millisecond
# of work): a quantile is interpolated within one bucket, and one from 0.5 to 1 ms moved a median by 0.3 ms
# between runs of the same code. Up to a minute: a NodePrepareResources waits on claim and pod reads of a
# slow API server (10 s + 5 s), and the kubelet waits longer than that; latencies past the last bound read
# as that bound in quantiles.
_ANSWER_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.0025)  # an Allocate, to 2.5 ms
_BUCKETS = (*_ANSWER_BUCKETS, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
CALLS = ("Allocate", "PreStartContainer")
#: The DRA driver's calls (``resource`` is the driver's name in DRA mode).
DRA_CALLS = ("NodePrepareResources", "NodeUnprepareResources")


class CallMetrics:
    """``gpu_manager_kubelet_call_duration_seconds{resource,call}`` and
    ``gpu_manager_kubelet_call_errors_total{resource,call}``, with a series for every resource and call
    from the start (an error counter that appears only at its first error hides that error from ``rate``).

    In DRA mode (``mode="dra"``) the calls are the DRA driver's, under ``resource=<driver>``.
    """

    def __init__(self, registry: CollectorRegistry, *, mode: str = "", driver: str = "") -> None:
        self.duration = Histogram(
            "gpu_manager_kubelet_call_duration_seconds",
            "Time spent answering the kubelet",
            ["resource", "call"],
            buckets=_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "gpu_manager_kubelet_call_errors",
            "Kubelet calls answered with an error (Allocate errors are refused allocations)",
            ["resource", "call"],
            registry=registry,
        )
        dra = mode == "dra"
        for resource in (driver,) if dra else RESOURCES:
            for call in DRA_CALLS if dra else CALLS:
                self.duration.labels(resource, call)
                self.errors.labels(resource, call)

    def observe(self, resource: str, call: str, seconds: float, ok: bool) -> None:
        """Record one call."""
        self.duration.labels(resource, call).observe(seconds)
        if not ok:
            self.errors.labels(resource, call).inc()


#: From 50 us (a flush of a local NVMe drive) to 10 s (a network disk that stalls); closely between 0.1 and
#: 1 ms, where a virtual machine's disk flushes.
_FLUSH_BUCKETS = (0.00005, 0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001)  # a flush, to 1 ms
_WRITE_BUCKETS = (*_FLUSH_BUCKETS, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)
#: The kinds of checkpoint write (gpumanager.allocation.journal.CheckpointStore.on_write).
WRITE_KINDS = ("journal", "snapshot")


class CheckpointWriteMetrics:
    """``gpu_manager_checkpoint_write_duration_seconds{kind}``: how long each durable checkpoint write took,
    ``kind="journal"`` for the record write a call that changes the state waits for before it answers (a
    write and the disk's cache flush), ``kind="snapshot"`` for the whole state, encoded and written (in the
    background, or by a call after a failed write or on a nearly full disk). Both series exist from the
    start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "gpu_manager_checkpoint_write_duration_seconds",
            "Time of one durable checkpoint write (journal: what an Allocate waits for the disk)",
            ["kind"],
            buckets=_WRITE_BUCKETS,
            registry=registry,
        )
        for kind in WRITE_KINDS:
            self.duration.labels(kind)

    def observe(self, kind: str, seconds: float) -> None:
        """Record one write."""
        self.duration.labels(kind).observe(seconds)
