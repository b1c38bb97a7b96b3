"""The node's GPUs as ResourceSlice devices: attributes, consumable capacities, taints.

One device per GPU, named ``gpu-<index>``, shareable (``allowMultipleAllocations``):
``cores`` is 100 (policy: default 100, 1..100 in steps of 1) and ``memory`` the GPU's
memory floored to 256 MiB (policy: default all of it, from 256 MiB in steps of 256 MiB;
the API server refuses a default off the step grid; a GPU with less than one step, as one lost
at start and never seen whole, publishes its memory without a policy). Attributes: ``uuid``,
``productName``, ``index``, ``minor``, ``nvlinkGroup`` (GPUs joined by NVLink, directly
or through others, share the lowest index of their group; a GPU without NVLink has none),
and the standard ``resource.kubernetes.io/pcieRoot`` and ``resource.kubernetes.io/numaNode``
where known. An unhealthy GPU carries a ``NoSchedule`` taint whose value names the cause.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import constants as c
from gpumanager.dra.quantity import format_bytes

log = logging.getLogger(__name__)

JSON = dict[str, Any]
_LABEL_UNSAFE = re.compile(r"[^a-z0-9._-]+")


@dataclass(frozen=True)
class Taint:
    """Why a GPU is out of service, and since when (RFC 3339)."""

    reason: str
    since: str


#: The longest string attribute value the API server takes, in bytes (UTF-8).
MAX_STRING_ATTRIBUTE = 64


def _string(text: str) -> JSON:
    """A string attribute cut to the API server's 64 bytes (on a character boundary): its limit is in
    bytes, and one value over it fails the node's whole slice."""
    return {"string": text.encode()[:MAX_STRING_ATTRIBUTE].decode("utf-8", "ignore")}


def published_memory(gpu: GPUInfo) -> int:
    """The GPU's memory floored to the 256 MiB step (what the slice publishes), bytes."""
    return gpu.memory_total // c.MEMORY_STEP * c.MEMORY_STEP


def nvlink_groups(gpus: Sequence[GPUInfo], topology: NodeTopology) -> dict[int, int]:
    """GPU index -> its NVLink group (the lowest index of the GPUs it reaches over NVLink)."""
    parent = {g.index: g.index for g in gpus}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    linked: set[int] = set()
    for a, b, links in topology.nvlink:
        if links <= 0 or a not in parent or b not in parent:
            continue
        linked.update((a, b))
        ra, rb = find(a), find(b)
        parent[max(ra, rb)] = min(ra, rb)
    return {i: find(i) for i in sorted(linked)}


def pcie_root(bus_id: str, sysfs_root: Path) -> str | None:
    """The PCIe root complex of a GPU (``pci0000:00``), from sysfs; None when it cannot be read."""
    bdf = bus_id.lower()
    if len(bdf.split(":")[0]) == 8:  # NVML's 8-digit domain; sysfs uses 4
        bdf = bdf[4:]
    try:
        resolved = (sysfs_root / "bus" / "pci" / "devices" / bdf).resolve(strict=True)
    except OSError:
        return None
    for part in resolved.parts:
        if part.startswith("pci") and ":" in part:
            return part
    return None


#: Health reasons that name the same cause as another, by the value of that one: a GPU lost while the agent
#: runs is ``lost``, and found lost again by the agent's next start (``lost at start``) it is the same GPU
#: in the same state, so its taint keeps its value (a claim placed there tolerating ``lost`` stays
#: prepared, and the slice is not rewritten for a restart).
_SAME_CAUSE = {"lost at start": "lost"}


def taint_value(reason: str) -> str:
    """A health reason as a label value (``XID 79`` -> ``xid-79``), at most 63 characters."""
    reason = _SAME_CAUSE.get(reason.strip().lower(), reason)
    value = _LABEL_UNSAFE.sub("-", reason.strip().lower()).strip("-._")
    return value[:63].rstrip("-._") or "unhealthy"


def _memory_capacity(amount: int) -> JSON:
    """The ``memory`` capacity of a GPU with ``amount`` bytes published. Less than one step (a GPU
    lost at start and never seen whole is known with 0 bytes) gets no request policy: a range from
    one step up to less than that is one the API server refuses, and with it the node's whole slice."""
    memory = format_bytes(amount)
    if amount < c.MEMORY_STEP:
        return {"value": memory}
    step = format_bytes(c.MEMORY_STEP)
    return {
        "value": memory,
        "requestPolicy": {"default": memory, "validRange": {"min": step, "max": memory, "step": step}},
    }


def device(
    gpu: GPUInfo,
    *,
    driver: str,
    nvlink_group: int | None,
    pcie: str | None,
    taint: Taint | None,
) -> JSON:
    """The ResourceSlice device of one GPU (API field names)."""
    attributes: JSON = {
        c.ATTR_UUID: _string(gpu.uuid),
        c.ATTR_PRODUCT: _string(gpu.name),
        c.ATTR_INDEX: {"int": gpu.index},
        c.ATTR_MINOR: {"int": gpu.minor},
    }
    if nvlink_group is not None:
        attributes[c.ATTR_NVLINK_GROUP] = {"int": nvlink_group}
    if pcie:
        attributes[c.ATTR_PCIE_ROOT] = _string(pcie)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attributes[c.ATTR_NUMA_NODE] = {"int": gpu.numa_node}
    out: JSON = {
        "name": c.device_name(gpu.index),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            c.CORES: {
                "value": "100",
                "requestPolicy": {"default": "100", "validRange": {"min": "1", "max": "100", "step": "1"}},
            },
            c.MEMORY: _memory_capacity(published_memory(gpu)),
        },
    }
    if taint is not None:
        out["taints"] = [
            {
                "key": c.taint_key(driver),
                "value": taint_value(taint.reason),
                "effect": c.TAINT_EFFECT,
                "timeAdded": taint.since,
            }
        ]
    return out


def slice_spec(
    *,
    node: str,
    driver: str,
    gpus: Sequence[GPUInfo],
    topology: NodeTopology,
    taints: Mapping[int, Taint],
    generation: int,
    sysfs_root: Path,
) -> JSON:
    """The spec of the node's one ResourceSlice (its pool is named after the node)."""
    groups = nvlink_groups(gpus, topology)
    return {
        "driver": driver,
        "nodeName": node,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
        "devices": [
            device(
                g,
                driver=driver,
                nvlink_group=groups.get(g.index),
                pcie=pcie_root(g.pci_bus_id, sysfs_root),
                taint=taints.get(g.index),
            )
            for g in sorted(gpus, key=lambda g: g.index)
        ],
    }
