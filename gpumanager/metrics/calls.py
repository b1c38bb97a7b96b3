"""Latency and outcome of the kubelet's calls (Allocate, PreStartContainer), per resource."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gpumanager import names

# Up to a minute: a NodePrepareResources waits on claim and pod reads of a slow API server (10 s + 5 s),
# and the kubelet waits longer than that; latencies past the last bound read as that bound in quantiles.
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
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
