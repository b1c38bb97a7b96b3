"""Per-container metrics and the ``/usage`` (PrintUsages) answer, from one usage sample.

Families (labels ``namespace, pod, container, gpu, uuid``; one series per GPU the
container holds, present from allocation to release; the two usage families leave
out a GPU NVML cannot read, as ``gpu_manager_gpu_memory_used_bytes`` does):

- ``gpu_manager_container_gpu_memory_limit_bytes``: memory the container may use on
  the GPU (``vcuda-memory`` x 256 MiB for a share, the GPU's memory for a whole GPU);
- ``gpu_manager_container_gpu_core_limit_ratio``: share of the GPU's compute it is
  allotted (``vcuda-core`` / 100, 1 for a whole GPU);
- ``gpu_manager_container_gpu_memory_used_bytes``: memory its processes use there;
- ``gpu_manager_container_gpu_utilization_ratio``: their SM utilisation (0-1).

A container using several DRA claims has an allocation for each; it has one series per GPU all
the same, with the limits of its claims on that GPU added up (at most the whole GPU).

DRA mode also has ``gpu_manager_claim_gpu_memory_used_bytes`` (labels as
``gpu_manager_claim_gpu_memory_bytes``: ``namespace, claim, claim_uid, gpu, uuid, share``): the
memory the processes of all the containers using a claim use on one of its GPUs together. A
claim's limits are enforced on its containers together (one ``vcuda.config``, all their PIDs in
its ``pids.config``), so two containers may fill a claim while neither is near its limit alone.
Left out while NVML cannot read the GPU.

A container's lines are rendered again only when its usage, allocation or pod changed.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import display_pb2 as pb
from gpumanager.metrics import textformat
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage

LABELS = ("namespace", "pod", "container", "gpu", "uuid")

FAMILIES = (
    (
        "gpu_manager_container_gpu_memory_limit_bytes",
        "GPU memory the container may use on this GPU (vcuda-memory x 256 MiB; the GPU's memory for a whole GPU)",
    ),
    (
        "gpu_manager_container_gpu_core_limit_ratio",
        "Share of this GPU's compute allotted to the container (vcuda-core / 100; 1 for a whole GPU)",
    ),
    ("gpu_manager_container_gpu_memory_used_bytes", "GPU memory used by the container's processes on this GPU"),
    (
        "gpu_manager_container_gpu_utilization_ratio",
        "SM utilisation of the container's processes on this GPU over the sample period (0-1)",
    ),
)

_HEADERS = tuple(textformat.header(name, help_text, "gauge") for name, help_text in FAMILIES)

CLAIM_USED = "gpu_manager_claim_gpu_memory_used_bytes"
CLAIM_LABELS = ("namespace", "claim", "claim_uid", "gpu", "uuid", "share")
_CLAIM_HEADER = textformat.header(
    CLAIM_USED,
    "GPU memory the processes of all containers using a prepared ResourceClaim use on this GPU together "
    "(the claim's memory limit is enforced on them together)",
    "gauge",
)


def limited(alloc: ContainerAllocation) -> bool:
    """Whether the container's use of its GPU is limited: a share of fewer than 100 cores, or a DRA
    claim's share (consumed capacity; its memory is limited even with all 100 cores). A DRA container
    holding whole GPUs has no memory recorded (:func:`gpumanager.dra.consumers.container_allocations`)."""
    return alloc.shared or ("claim_uid" in alloc.extra and alloc.memory > 0)


def limits(usage: ContainerUsage, device: DeviceUsage) -> tuple[int, float]:
    """(memory limit in bytes, core share 0-1) of a container on one of its GPUs."""
    alloc = usage.allocation
    if limited(alloc):
        return alloc.memory, min(alloc.cores, names.HUNDRED_CORES) / names.HUNDRED_CORES
    return device.gpu.memory_total, 1.0


_Labels = tuple[tuple[tuple[str, ...], str], ...]  # per GPU of a container: (label values, rendered label set)


class ContainerFamilies:
    """Renders the per-container families in the text format.

    A container's lines are kept while the sampler hands out the same ContainerUsage for it (nothing
    about it changed), and its label sets while it keeps its GPUs, so a scrape formats only what changed.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], tuple[tuple[ContainerUsage, ...], tuple[str, ...], _Labels]] = {}
        self._last: tuple[Sequence[ContainerUsage], str] = ((), "")

    def render(self, usages: Sequence[ContainerUsage]) -> str:
        """The four families for ``usages`` (header lines even when there is no container)."""
        last_usages, last_text = self._last
        if last_text and len(last_usages) == len(usages) and all(map(operator.is_, last_usages, usages)):
            return last_text  # the same objects: nothing changed
        # A container using several DRA claims has an allocation for each: one set of series for all.
        grouped: dict[tuple[str, str], list[ContainerUsage]] = {}
        for u in usages:
            grouped.setdefault(u.allocation.key, []).append(u)
        known = self._entries
        current: dict[tuple[str, str], tuple[tuple[ContainerUsage, ...], tuple[str, ...], _Labels]] = {}
        columns: tuple[list[str], ...] = tuple([] for _ in FAMILIES)
        for key, held in grouped.items():
            entry = known.get(key)
            if entry is None or len(entry[0]) != len(held) or not all(map(operator.is_, entry[0], held)):
                devices = _merged(held)
                label_sets = _label_sets(held[0], devices, entry[2] if entry is not None else ())
                entry = (tuple(held), _lines(devices, label_sets), label_sets)
            current[key] = entry
            for column, text in zip(columns, entry[1], strict=True):
                column.append(text)
        self._entries = current
        parts: list[str] = []
        for head, lines in zip(_HEADERS, columns, strict=True):
            parts.append(head)
            parts.extend(lines)
        parts.append(_claims_used(usages))
        text = "".join(parts)
        self._last = (tuple(usages), text)
        return text


#: One GPU of a container: what its processes use there, its memory limit (bytes) and core share (0-1).
_Device = tuple[DeviceUsage, int, float]


def _merged(held: Sequence[ContainerUsage]) -> list[_Device]:
    """Each GPU of a container's allocations once: the limits of all of them on it added up (at most the
    whole GPU), the usage of its processes there as measured (the same in each allocation)."""
    out: dict[int, _Device] = {}
    for u in held:
        for d in u.devices:
            memory, cores = limits(u, d)
            before = out.get(d.gpu.index)
            if before is not None:
                memory = min(before[1] + memory, d.gpu.memory_total)
                cores = min(before[2] + cores, 1.0)
                d = before[0]
            out[d.gpu.index] = (d, memory, cores)
    return list(out.values())


def _label_sets(u: ContainerUsage, devices: Sequence[_Device], before: _Labels) -> _Labels:
    """The label set of each of the container's GPUs (rendered again only when its values changed)."""
    meta = u.pod.get("metadata") or {}
    namespace = str(meta.get("namespace", "")) or u.allocation.namespace
    pod_name = str(meta.get("name", "")) or u.allocation.pod_name
    known = dict(before)
    out = []
    for d, _, _ in devices:
        values = (namespace, pod_name, u.container, str(d.gpu.index), d.gpu.uuid)
        text = known.get(values)
        out.append((values, text if text is not None else textformat.labels(LABELS, values)))
    return tuple(out)


def _lines(devices: Sequence[_Device], label_sets: _Labels) -> tuple[str, ...]:
    """The container's lines in each family, one per GPU it holds."""
    out: tuple[list[str], ...] = tuple([] for _ in FAMILIES)
    for (d, memory_limit, core_limit), (_, label_text) in zip(devices, label_sets, strict=True):
        values = (float(memory_limit), core_limit, float(d.used_bytes), d.sm_ratio)
        for lines, (name, _), value in zip(out, FAMILIES[: 4 if d.measured else 2], values, strict=False):
            lines.append(f"{name}{label_text} {value!r}\n")
    return tuple("".join(lines) for lines in out)


def _claims_used(usages: Sequence[ContainerUsage]) -> str:
    """``gpu_manager_claim_gpu_memory_used_bytes``: per DRA claim and GPU, what the processes of its
    containers use there together; nothing (not even the header) without a claim."""
    used: dict[tuple[str, int], tuple[tuple[str, ...], int, bool]] = {}  # (claim UID, GPU) -> labels, bytes, known
    counted: set[tuple[str, int, tuple[str, str]]] = set()  # each container once per claim and GPU
    for u in usages:
        alloc = u.allocation
        claim_uid = str(alloc.extra.get("claim_uid") or "")
        if not claim_uid:
            continue
        share = "true" if limited(alloc) else "false"
        for d in u.devices:
            seen = (claim_uid, d.gpu.index, alloc.key)
            if seen in counted:
                continue
            counted.add(seen)
            key = (claim_uid, d.gpu.index)
            values: tuple[str, ...] = (
                alloc.namespace,
                str(alloc.extra.get("claim", "")),
                claim_uid,
                str(d.gpu.index),
                d.gpu.uuid,
                share,
            )
            _, total, known = used.get(key, (values, 0, True))
            used[key] = (values, total + d.used_bytes, known and d.measured)
    if not used:
        return ""
    lines = [_CLAIM_HEADER]
    for _, (values, total, known) in sorted(used.items()):
        if known:  # a GPU NVML cannot read: the claim's use there is unknown, not 0
            lines.append(f"{CLAIM_USED}{textformat.labels(CLAIM_LABELS, values)} {float(total)!r}\n")
    return "".join(lines)


def usage_response(usages: Sequence[ContainerUsage]) -> pb.UsageResponse:
    """PrintUsages: per pod UID, per container device usage and request (gpu-manager's units: MiB, percent)."""
    out = pb.UsageResponse()
    listed: dict[tuple[str, str], set[int]] = {}  # (pod UID, container) -> GPUs in its dev list
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
        seen = listed.setdefault(u.allocation.key, set())
        for d in u.devices:
            if not d.measured or d.gpu.index in seen:
                continue  # a lost GPU (its usage is unknown), or one listed for another claim of the container
            seen.add(d.gpu.index)
            devices.dev.append(
                pb.DeviceInfo(
                    id=d.gpu.pci_bus_id,
                    card_idx=str(d.gpu.index),
                    gpu=d.sm_samples_sum,
                    mem=float(d.used_bytes >> 20),
                    pids=list(d.pids),
                    device_mem=float(d.gpu.memory_total >> 20),
                )
            )
        # A container using several DRA claims has an allocation for each: its request is their sum.
        stat.spec[u.container].gpu += u.allocation.cores / names.HUNDRED_CORES
        stat.spec[u.container].mem += float(u.allocation.memory >> 20)
    return out
