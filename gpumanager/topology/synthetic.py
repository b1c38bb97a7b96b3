"""Small builders of made-up topologies, for tests, benchmarks and the demo.

They produce the same :class:`~gpumanager.device.types.GPUInfo` and
:class:`~gpumanager.device.types.NodeTopology` values the NVML layer would,
so the tree is built by the production code path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.topology.levels import Level
from gpumanager.topology.tree import TopologyTree, build_tree

#: Default memory of a made-up GPU: 16 GiB.
DEFAULT_MEMORY = 16 * 1024**3


def make_gpus(
    count: int,
    *,
    memory_total: int = DEFAULT_MEMORY,
    multi_gpu_board: bool = False,
    name: str = "Simulated GPU",
) -> list[GPUInfo]:
    """Return ``count`` GPUs with index = minor = 0..count-1 and distinct UUIDs and bus ids."""
    if count < 1:
        raise ValueError(f"GPU count must be at least 1, got {count}")
    return [
        GPUInfo(
            index=i,
            uuid=f"GPU-00000000-0000-0000-0000-{i:012x}",
            name=name,
            minor=i,
            memory_total=memory_total,
            pci_bus_id=f"00000000:{0x10 + i:02X}:00.0",
            multi_gpu_board=multi_gpu_board,
        )
        for i in range(count)
    ]


def levels_from_groups(
    count: int,
    groups: Mapping[int, Iterable[Iterable[int]]],
    *,
    default: int = Level.SYSTEM,
) -> tuple[tuple[int, ...], ...]:
    """Build a ``count`` x ``count`` levels matrix from named groups.

    ``groups`` maps a level to sets of GPU indices that are within that level
    of each other; ``level(i, j)`` is the smallest level of a set holding both,
    else ``default``. The diagonal is :attr:`Level.INTERNAL`. For example the
    6-GPU upstream test node is
    ``levels_from_groups(6, {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]},
    default=Level.CPU)``.
    """
    matrix = [[int(default)] * count for _ in range(count)]
    for i in range(count):
        matrix[i][i] = Level.INTERNAL
    for level, sets in groups.items():
        for members in sets:
            ids = list(members)
            for i in ids:
                for j in ids:
                    if not (0 <= i < count and 0 <= j < count):
                        raise ValueError(f"GPU index out of range 0..{count - 1} in group {ids}")
                    if i != j:
                        matrix[i][j] = min(matrix[i][j], int(level))
    return tuple(tuple(row) for row in matrix)


def all_pairs(indices: Iterable[int], links: int = 1) -> tuple[tuple[int, int, int], ...]:
    """NVLink triples joining every pair of ``indices`` with ``links`` active links."""
    ids = sorted(indices)
    return tuple((a, b, links) for pos, a in enumerate(ids) for b in ids[pos + 1 :])


def tree_from_levels(
    levels: Sequence[Sequence[int]],
    nvlink: Iterable[tuple[int, int] | tuple[int, int, int]] = (),
    *,
    memory_total: int = DEFAULT_MEMORY,
    multi_gpu_board: bool = False,
) -> TopologyTree:
    """Build a tree for ``len(levels)`` made-up GPUs from a levels matrix and NVLink pairs.

    NVLink entries may be ``(a, b)`` (one link) or ``(a, b, links)``.
    """
    triples = tuple((t[0], t[1], t[2] if len(t) == 3 else 1) for t in nvlink)
    topology = NodeTopology(levels=tuple(tuple(row) for row in levels), nvlink=triples)
    gpus = make_gpus(len(levels), memory_total=memory_total, multi_gpu_board=multi_gpu_board)
    return build_tree(gpus, topology)
