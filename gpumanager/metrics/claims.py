"""Prometheus metrics of prepared ResourceClaims (DRA mode): per namespace, claim, device and pod."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.pods import Pod
from gpumanager.dra.consumers import consumers


class ClaimCollector(Collector):
    """``gpu_manager_claim_cores`` / ``gpu_manager_claim_memory_bytes`` (what each claim consumes of each
    device; a whole GPU counts 100 cores and all its memory) and ``gpu_manager_claim_containers``
    (the containers of each pod that use a claim)."""

    def __init__(self, claims: Callable[[], list[ClaimAllocation]], pods: Callable[[], list[Pod]]) -> None:
        self._claims = claims
        self._pods = pods

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "claim", "claim_uid", "device", "share"]
        cores = GaugeMetricFamily(
            "gpu_manager_claim_cores", "cores (100 per GPU) a prepared claim consumes", labels=labels
        )
        memory = GaugeMetricFamily(
            "gpu_manager_claim_memory_bytes", "GPU memory a prepared claim consumes", labels=labels
        )
        users = GaugeMetricFamily(
            "gpu_manager_claim_containers",
            "containers of a pod that use a prepared claim",
            labels=["namespace", "claim", "pod"],
        )
        pods = self._pods()
        for claim in self._claims():
            for d in claim.devices:
                values = [claim.namespace, claim.name, claim.uid, d.device, "false" if d.whole else "true"]
                cores.add_metric(values, float(d.cores))
                memory.add_metric(values, float(d.memory))
            per_pod: dict[str, int] = {}
            for pod, _container in consumers(claim, pods):
                name = str((pod.get("metadata") or {}).get("name", ""))
                per_pod[name] = per_pod.get(name, 0) + 1
            for name, count in sorted(per_pod.items()):
                users.add_metric([claim.namespace, claim.name, name], float(count))
        yield from (cores, memory, users)
