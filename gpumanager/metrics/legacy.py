"""tkestack gpu-manager's four ``container_*`` families, byte for byte as it wrote them (``--legacy-metrics``).

For clusters upgrading in place whose dashboards and alerts read them. As upstream:

- ``container_gpu_utilization{gpu="gpu<i>"|"total"}``: SM utilisation percent (every
  sample of the container's processes added up), per GPU and in total;
- ``container_gpu_memory_total{gpu_memory="gpu<i>"|"total"}``: MiB used by its processes;
- ``container_request_gpu_utilization{req_of_gpu="total"}``: ``vcuda-core`` / 100;
- ``container_request_gpu_memory{req_of_gpu_memory="total"}``: ``vcuda-memory`` x 256 MiB,
  for a whole-GPU container without a memory request the memory of its GPUs (MiB).

All carry ``pod_name, namespace, node, container_name``. The request families cover every
container of a pod that holds GPUs (0 for the others), the usage families the containers
with GPUs (without a GPU NVML cannot read, and then without the container's ``total``).
The text is what upstream's Go client library wrote: families sorted by name, label pairs
by label name, series by label values, numbers as Go formats them. These
families do not follow Prometheus naming rules (a gauge ending in ``_total``, a ``total``
series that a ``sum`` counts twice, MiB), which is why they are off by default.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.metrics import textformat
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage

_HELP = {
    "container_gpu_memory_total": "gpu memory usage in MiB",
    "container_gpu_utilization": "gpu utilization",
    "container_request_gpu_memory": "request of gpu memory in MiB",
    "container_request_gpu_utilization": "request of gpu utilization",
}
_EXTRA_LABEL = {
    "container_gpu_memory_total": "gpu_memory",
    "container_gpu_utilization": "gpu",
    "container_request_gpu_memory": "req_of_gpu_memory",
    "container_request_gpu_utilization": "req_of_gpu",
}
BASE = ("pod_name", "namespace", "node", "container_name")


def _request_mib(u: ContainerUsage) -> int:
    """``vcuda-memory`` x 256 MiB; for a whole GPU without a memory request the memory of its GPUs."""
    mib = (u.allocation.memory >> 28) * (names.MEMORY_BLOCK_BYTES >> 20)
    return mib or sum(d.gpu.memory_total >> 20 for d in u.devices)


def merged_devices(held: Sequence[ContainerUsage]) -> list[DeviceUsage]:
    """The GPUs of a container's allocations, each once (what its processes use there is the container's,
    the same in each allocation on that GPU)."""
    seen: set[int] = set()
    out: list[DeviceUsage] = []
    for u in held:
        for d in u.devices:
            if d.gpu.index not in seen:
                seen.add(d.gpu.index)
                out.append(d)
    return out


def render(usages: Sequence[ContainerUsage], node: str = "") -> str:
    """The four families for ``usages``; a family without series is left out, as upstream's registry did.

    ``node`` (the agent's node) labels a pod the agent knows only from its allocations (its checkpoint,
    while the pods cannot be listed): its containers are those allocations' containers, so it keeps its
    series under the names the allocations recorded.
    """
    series: dict[str, list[tuple[dict[str, str], float]]] = {name: [] for name in _HELP}
    # A container using several DRA claims has an allocation for each: its figures are their sums.
    by_pod: dict[str, dict[str, list[ContainerUsage]]] = {}
    for u in usages:
        by_pod.setdefault(podinfo.uid(u.pod), {}).setdefault(u.container, []).append(u)
    for by_container in by_pod.values():
        pod = next(iter(by_container.values()))[0].pod
        meta = pod.get("metadata") or {}
        pod_node = str((pod.get("spec") or {}).get("nodeName", "")) or node
        listed = [str(c.get("name", "")) for c in podinfo.containers(pod)] or list(by_container)
        for cname in listed:
            base = dict(
                zip(BASE, (str(meta.get("name", "")), str(meta.get("namespace", "")), pod_node, cname), strict=True)
            )
            held = by_container.get(cname, [])
            cores = sum(u.allocation.cores for u in held)
            mem_mib = sum(_request_mib(u) for u in held)
            series["container_request_gpu_utilization"].append(({**base, "req_of_gpu": "total"}, cores / 100))
            series["container_request_gpu_memory"].append(({**base, "req_of_gpu_memory": "total"}, float(mem_mib)))
            devices = merged_devices(held)
            if not devices:
                continue
            for d in devices:
                if not d.measured:
                    continue  # a lost GPU: its usage is unknown, not 0
                series["container_gpu_utilization"].append(({**base, "gpu": f"gpu{d.gpu.index}"}, d.sm_samples_sum))
                series["container_gpu_memory_total"].append(
                    ({**base, "gpu_memory": f"gpu{d.gpu.index}"}, float(d.used_bytes >> 20))
                )
            if not all(d.measured for d in devices):
                continue  # no total that leaves a GPU out
            util_total = sum(d.sm_samples_sum for d in devices)
            mem_total = sum(float(d.used_bytes >> 20) for d in devices)
            series["container_gpu_utilization"].append(({**base, "gpu": "total"}, util_total))
            series["container_gpu_memory_total"].append(({**base, "gpu_memory": "total"}, mem_total))
    parts: list[str] = []
    for name in sorted(series):
        if not series[name]:
            continue
        label_names = sorted((*BASE, _EXTRA_LABEL[name]))
        rows = sorted((tuple(labels[n] for n in label_names), value) for labels, value in series[name])
        parts.append(textformat.header(name, _HELP[name], "gauge"))
        for values, value in rows:
            parts.append(f"{name}{textformat.labels(label_names, values)} {textformat.go_float(value)}\n")
    return "".join(parts)
