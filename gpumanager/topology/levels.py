"""Topology levels: how far apart two GPUs are, from tightest to loosest.

The values are NVML's ``nvmlGpuTopologyLevel_t`` (step 10) with one addition of
our own: :attr:`Level.NVLINK` (5) sits between a GPU itself and a shared PCIe
switch, so that GPUs joined by NVLink group together before anything else.
"""

from __future__ import annotations

from enum import IntEnum


class Level(IntEnum):
    """Distance between two GPUs; a smaller value means a closer pair."""

    INTERNAL = 0  # the GPU itself (leaves of the tree)
    NVLINK = 5  # ours: at least one active NVLink (printed "NVL")
    SINGLE = 10  # one PCIe switch (nvidia-smi "PIX")
    MULTIPLE = 20  # several PCIe switches (nvidia-smi "PXB")
    HOSTBRIDGE = 30  # one PCIe host bridge (nvidia-smi "PHB")
    CPU = 40  # one NUMA node / CPU socket (nvidia-smi "NODE", printed "CPU" as upstream)
    SYSTEM = 50  # across NUMA nodes (nvidia-smi "SYS")
    UNKNOWN = 60


#: The levels at which groups are formed, tightest first.
GROUP_LEVELS: tuple[Level, ...] = (
    Level.NVLINK,
    Level.SINGLE,
    Level.MULTIPLE,
    Level.HOSTBRIDGE,
    Level.CPU,
    Level.SYSTEM,
)

_NAMES: dict[int, str] = {
    Level.INTERNAL: "GPU",
    Level.NVLINK: "NVL",
    Level.SINGLE: "PIX",
    Level.MULTIPLE: "PXB",
    Level.HOSTBRIDGE: "PHB",
    Level.CPU: "CPU",
    Level.SYSTEM: "SYS",
}


def level_name(level: int) -> str:
    """Return the printed name of a group at ``level`` (``"ROOT"`` for anything else).

    Leaves print as ``GPU<index>``; this returns the bare ``"GPU"`` for
    :attr:`Level.INTERNAL`.
    """
    return _NAMES.get(level, "ROOT")
