"""gpu-manager's container metrics and the /usage (PrintUsages) answer, from one usage sample.

Metrics (labels ``pod_name, namespace, node, container_name`` plus one):
``container_gpu_utilization{gpu="gpu<i>"|"total"}``,
``container_gpu_memory_total{gpu_memory="gpu<i>"|"total"}`` (MiB),
``container_request_gpu_utilization{req_of_gpu="total"}`` (cores / 100) and
``container_request_gpu_memory{req_of_gpu_memory="total"}`` (MiB; for a whole-GPU
container without a memory request, the memory of its GPUs). Request metrics
are emitted for every container of a pod that has an allocation (0 for the
others), usage metrics for containers with devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.api import display_pb2 as pb
from gpumanager.metrics.usage import ContainerUsage

BASE = ["pod_name", "namespace", "node", "container_name"]


class ContainerCollector(Collector):
    """Samples at scrape time."""

    def __init__(self, sample: Callable[[], list[ContainerUsage]]) -> None:
        self._sample = sample

    def describe(self) -> Sequence[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        util = GaugeMetricFamily("container_gpu_utilization", "gpu utilization", labels=[*BASE, "gpu"])
        mem = GaugeMetricFamily("container_gpu_memory_total", "gpu memory usage in MiB", labels=[*BASE, "gpu_memory"])
        req_util = GaugeMetricFamily(
            "container_request_gpu_utilization", "request of gpu utilization", labels=[*BASE, "req_of_gpu"]
        )
        req_mem = GaugeMetricFamily(
            "container_request_gpu_memory", "request of gpu memory in MiB", labels=[*BASE, "req_of_gpu_memory"]
        )
        usages = self._sample()
        seen_pods: dict[str, dict[str, ContainerUsage]] = {}
        for usage in usages:
            seen_pods.setdefault(podinfo.uid(usage.pod), {})[usage.container] = usage
        for by_container in seen_pods.values():
            pod = next(iter(by_container.values())).pod
            meta = pod.get("metadata") or {}
            node = str((pod.get("spec") or {}).get("nodeName", ""))
            for c in podinfo.containers(pod):
                cname = str(c.get("name", ""))
                base = [str(meta.get("name", "")), str(meta.get("namespace", "")), node, cname]
                u = by_container.get(cname)
                cores = u.cores if u else 0
                mem_mib = (u.memory_blocks * names.MEMORY_BLOCK_BYTES >> 20) if u else 0
                if u is not None and mem_mib == 0:
                    mem_mib = int(sum(d.device_mem for d in u.devices))
                req_util.add_metric([*base, "total"], cores / names.HUNDRED_CORES)
                req_mem.add_metric([*base, "total"], float(mem_mib))
                if u is None or not u.devices:
                    continue
                for d in u.devices:
                    util.add_metric([*base, f"gpu{d.index}"], d.gpu)
                    mem.add_metric([*base, f"gpu{d.index}"], d.mem)
                util.add_metric([*base, "total"], sum(d.gpu for d in u.devices))
                mem.add_metric([*base, "total"], sum(d.mem for d in u.devices))
        yield from (util, mem, req_util, req_mem)


def usage_response(usages: Sequence[ContainerUsage]) -> pb.UsageResponse:
    """PrintUsages: per pod UID, per container device usage and request."""
    out = pb.UsageResponse()
    for u in usages:
        if not u.devices:
            continue
        pod = u.pod
        stat = out.usage[podinfo.uid(pod)]
        meta = pod.get("metadata") or {}
        stat.project = str(meta.get("namespace", ""))
        stat.cluster = podinfo.pod_annotations(pod).get(names.CLUSTER_NAME_ANNOTATION, "")
        first = next(iter(podinfo.containers(pod)), {})
        stat.user = podinfo.container_env(first, "SUBMITTER") or ""
        devices = stat.stat[u.container]
        for d in u.devices:
            devices.dev.append(
                pb.DeviceInfo(
                    id=d.bus_id, card_idx=str(d.index), gpu=d.gpu, mem=d.mem, pids=list(d.pids), device_mem=d.device_mem
                )
            )
        stat.spec[u.container].gpu = u.cores / names.HUNDRED_CORES
        stat.spec[u.container].mem = float(u.memory_blocks * names.MEMORY_BLOCK_BYTES >> 20)
    return out
