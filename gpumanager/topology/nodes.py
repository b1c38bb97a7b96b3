"""Nodes of the topology tree: GPU leaves and the groups above them.

Sort-relevant attributes follow upstream gpu-manager: a group has no
allocatable cores or memory and minor 0 of its own, and its process list,
used and total memory are the sums over its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from gpumanager.device.types import GPUInfo
from gpumanager.topology.levels import Level, level_name

#: Cores of one whole GPU (``tencent.com/vcuda-core`` units).
HUNDRED_CORES = 100


@dataclass(eq=False)
class GPUNode:
    """A leaf of the tree: one physical GPU and its allocation state.

    ``allocatable_cores``/``allocatable_memory`` are what is left to hand out;
    ``pids``/``used_memory`` are the usage last reported by NVML. ``in_pool``
    is False from any occupation until all of the GPU's cores are free again.
    A GPU is *available* (to the group-based evaluators) when it is healthy
    and in the pool; see :meth:`gpumanager.topology.TopologyTree.occupy`.
    Change the state through the tree's methods, not directly.
    """

    info: GPUInfo
    allocatable_cores: int = HUNDRED_CORES
    allocatable_memory: int = -1  # set to the total in __post_init__
    pids: tuple[int, ...] = ()
    used_memory: int = 0
    healthy: bool = True
    parent: GroupNode | None = field(default=None, repr=False)
    in_pool: bool = field(default=True, repr=False)

    def __post_init__(self) -> None:
        if self.allocatable_memory < 0:
            self.allocatable_memory = self.info.memory_total

    @property
    def index(self) -> int:
        """NVML index of the GPU."""
        return self.info.index

    @property
    def minor(self) -> int:
        """Minor number of ``/dev/nvidia<minor>``."""
        return self.info.minor

    @property
    def uuid(self) -> str:
        """NVML UUID (``GPU-...``)."""
        return self.info.uuid

    @property
    def bus_id(self) -> str:
        """PCI bus id."""
        return self.info.pci_bus_id

    @property
    def device_path(self) -> str:
        """Host path of the GPU's device node."""
        return self.info.device_path

    @property
    def total_memory(self) -> int:
        """Total GPU memory in bytes."""
        return self.info.memory_total

    @property
    def level(self) -> Level:
        """Always :attr:`Level.INTERNAL` for a leaf."""
        return Level.INTERNAL

    @property
    def label(self) -> str:
        """Printed name, ``GPU<index>``."""
        return f"GPU{self.index}"

    @property
    def available(self) -> bool:
        """True when the GPU is healthy and wholly free (in every ancestor's available set)."""
        return self.healthy and self.in_pool

    @property
    def available_indices(self) -> list[int]:
        """``[index]`` when available, else ``[]``."""
        return [self.index] if self.available else []

    @property
    def available_count(self) -> int:
        """1 when available, else 0."""
        return 1 if self.available else 0

    @property
    def indices(self) -> tuple[int, ...]:
        """The GPU's own index, as a one-element tuple."""
        return (self.index,)

    @property
    def first_index(self) -> int:
        """Lowest GPU index under this node (the index itself)."""
        return self.index


@dataclass(eq=False)
class GroupNode:
    """A set of GPUs that are all within ``level`` of each other (or the root).

    ``leaves`` holds every GPU under the group in ascending index order;
    ``children`` the direct sub-groups and GPUs.
    """

    level: Level
    leaves: tuple[GPUNode, ...]
    children: list[TreeNode] = field(default_factory=list)
    parent: GroupNode | None = field(default=None, repr=False)
    is_root: bool = False

    @property
    def label(self) -> str:
        """Printed name: ``NVL``, ``PIX``, ``PXB``, ``PHB``, ``CPU``, ``SYS`` or ``ROOT``."""
        return "ROOT" if self.is_root else level_name(self.level)

    @property
    def indices(self) -> tuple[int, ...]:
        """Indices of all GPUs under the group, ascending."""
        return tuple(leaf.index for leaf in self.leaves)

    @property
    def first_index(self) -> int:
        """Lowest GPU index under the group."""
        return self.leaves[0].index

    @property
    def available_indices(self) -> list[int]:
        """Indices of the available GPUs under the group, ascending."""
        return [leaf.index for leaf in self.leaves if leaf.available]

    @property
    def available_count(self) -> int:
        """Number of available GPUs under the group."""
        return sum(1 for leaf in self.leaves if leaf.available)

    @property
    def pids(self) -> tuple[int, ...]:
        """Processes on the group's GPUs, in GPU index order."""
        return tuple(pid for leaf in self.leaves for pid in leaf.pids)

    @property
    def used_memory(self) -> int:
        """Sum of the GPUs' used memory in bytes."""
        return sum(leaf.used_memory for leaf in self.leaves)

    @property
    def total_memory(self) -> int:
        """Sum of the GPUs' total memory in bytes."""
        return sum(leaf.total_memory for leaf in self.leaves)

    @property
    def allocatable_cores(self) -> int:
        """Always 0: groups hold no allocation of their own (as upstream)."""
        return 0

    @property
    def allocatable_memory(self) -> int:
        """Always 0: groups hold no allocation of their own (as upstream)."""
        return 0

    @property
    def minor(self) -> int:
        """Always 0 (as upstream)."""
        return 0


#: Any node of the tree.
TreeNode: TypeAlias = GPUNode | GroupNode
