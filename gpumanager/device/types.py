"""Plain data describing the GPUs of a node, as discovered through NVML."""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1 << 20


@dataclass(frozen=True)
class GPUInfo:
    """One physical GPU as NVML reports it.

    ``index`` is the NVML index, ``minor`` the number of ``/dev/nvidia<minor>``.
    ``numa_node`` is ``None`` when the platform does not report one.
    """

    index: int
    uuid: str
    name: str
    minor: int
    memory_total: int  # bytes
    pci_bus_id: str
    numa_node: int | None = None
    multi_gpu_board: bool = False

    @property
    def device_path(self) -> str:
        """Host path of the GPU's device node."""
        return f"/dev/nvidia{self.minor}"


@dataclass(frozen=True)
class NodeTopology:
    """How the GPUs of a node are connected.

    ``levels[i][j]`` is NVML's common-ancestor level between GPUs i and j
    (0 internal, 10 single switch, 20 multiple switches, 30 host bridge,
    40 NUMA node / CPU, 50 system). ``nvlink`` holds ``(a, b, active_links)``
    triples with ``a < b`` for every pair joined by at least one active link.
    """

    levels: tuple[tuple[int, ...], ...]
    nvlink: tuple[tuple[int, int, int], ...] = field(default=())
