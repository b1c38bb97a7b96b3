"""The node's GPUs at start: what NVML answers, a lost GPU counted as last saved, all of it logged.

A GPU that is lost when the agent starts keeps its place (and its device IDs): it is described
from the inventory saved beside the checkpoint, or shaped like its peers on a new node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager.device import inventory, nvml
from gpumanager.device.types import GPUInfo, NodeTopology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeGPUs:
    """The driver, every GPU (lost ones included), the indexes of the lost ones, their topology, the
    places whose GPU is another one than the saved inventory says (index -> the UUID saved there), and
    the saved inventory itself (index -> the GPU as last seen whole; empty on a new node)."""

    driver: nvml.DriverInfo
    gpus: list[GPUInfo]
    lost: list[int]
    topology: NodeTopology
    replaced: dict[int, str] = field(default_factory=dict)
    was: dict[int, GPUInfo] = field(default_factory=dict)


def discover(checkpoint_dir: Path) -> NodeGPUs:
    """Ask NVML (already initialised) for the node's GPUs; the saved inventory in ``checkpoint_dir``
    describes a lost one. Raises NVMLError when NVML cannot answer."""
    known, saved_topology = inventory.load(checkpoint_dir / inventory.FILE)
    driver = nvml.driver_info()
    gpus, lost = nvml.discover(known)
    replaced = {
        g.index: known[g.index].uuid
        for g in gpus
        if g.index in known and g.index not in lost and known[g.index].uuid != g.uuid
    }
    node = NodeGPUs(driver, gpus, lost, nvml.topology(gpus, lost, saved_topology), replaced, known)
    _log(node)
    return node


def _log(node: NodeGPUs) -> None:
    """The driver and every GPU, one line each (a lost one marked)."""
    if not node.gpus:
        log.warning("NVML reports no GPU on this node; advertising no devices")
    log.info(
        "driver %s (CUDA %d.%d), %d GPUs",
        node.driver.driver_version,
        node.driver.cuda_driver_version // 1000,
        node.driver.cuda_driver_version % 1000 // 10,
        len(node.gpus),
    )
    for g in node.gpus:
        log.info(
            "GPU %d: %s %s minor=%d memory=%d MiB bus=%s numa=%s%s",
            g.index,
            g.name,
            g.uuid,
            g.minor,
            g.memory_total >> 20,
            g.pci_bus_id,
            g.numa_node,
            " (LOST)" if g.index in node.lost else "",
        )
