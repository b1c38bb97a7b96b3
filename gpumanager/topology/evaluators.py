"""Choosing GPUs for a request: the link, fragment and share evaluators.

Pure functions over a :class:`~gpumanager.topology.tree.TopologyTree`; none
of them changes the tree. Each returns NVML indices in ascending order, or an
empty list when nothing fits. The sort keys are upstream gpu-manager's (each
ascending); every tie left after them is broken by the lowest GPU index (of
the group, for groups), so the same state always gives the same answer.
"""

from __future__ import annotations

from gpumanager.topology.nodes import HUNDRED_CORES, GroupNode, TreeNode
from gpumanager.topology.tree import TopologyTree

#: Memory is compared in blocks of this many bytes (``tencent.com/vcuda-memory`` unit).
MEMORY_BLOCK = 256 * 1024 * 1024

_SortKey = tuple[int, ...]


def _memory_blocks(node: TreeNode) -> int:
    return node.allocatable_memory // MEMORY_BLOCK


def _link_key(node: TreeNode) -> _SortKey:
    # ByType, ByAvailable, ByAllocatableMemory, ByPids, ByMinorID, then lowest index.
    return (
        node.level,
        node.available_count,
        _memory_blocks(node),
        len(node.pids),
        node.minor,
        node.first_index,
    )


def _fragment_key(node: TreeNode) -> _SortKey:
    # ByAvailable, ByAllocatableMemory, ByPids, ByMinorID, then lowest index.
    return (node.available_count, _memory_blocks(node), len(node.pids), node.minor, node.first_index)


def _whole_gpus(cores: int, evaluator: str) -> int:
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise ValueError(f"{evaluator}: cores must be an int, got {cores!r}")
    if cores < HUNDRED_CORES or cores % HUNDRED_CORES:
        raise ValueError(f"{evaluator}: cores must be a positive multiple of {HUNDRED_CORES}, got {cores}")
    return cores // HUNDRED_CORES


def link(tree: TopologyTree, cores: int) -> list[int]:
    """Pick ``cores // 100`` whole GPUs that are as close to each other as possible.

    From every GPU, walk up towards the root (not including it); the first
    node with at least that many available GPUs is a candidate. The
    candidates are sorted by (level, available GPUs, allocatable memory,
    process count, minor, lowest index): the tightest level that can host the
    request, then the smallest such group. The root is the only candidate
    when there is none. The first GPUs of the winner are returned.

    ``cores`` must be a multiple of 100 (the dispatcher uses it above 100).
    """
    num = _whole_gpus(cores, "link")
    candidates: dict[int, TreeNode] = {}
    for leaf in tree.leaves:
        node: TreeNode | None = leaf
        while node is not None and node is not tree.root:
            if node.available_count >= num:
                candidates.setdefault(id(node), node)
                break
            node = node.parent
    chosen: TreeNode = min(candidates.values(), key=_link_key) if candidates else tree.root
    available = chosen.available_indices
    return available[:num] if len(available) >= num else []


def fragment(tree: TopologyTree, cores: int = HUNDRED_CORES) -> list[int]:
    """Pick ``cores // 100`` whole GPUs from the most used part of the tree.

    Starting at the root, descend into the first sub-group (children sorted by
    available GPUs, allocatable memory, process count, minor, lowest index)
    that still has at least that many available GPUs; stop when there is none
    and return the first available GPUs of where the descent ended. This keeps
    large free groups intact for later multi-GPU requests. The dispatcher
    calls it for exactly 100 cores.
    """
    num = _whole_gpus(cores, "fragment")
    candidate: GroupNode = tree.root
    while True:
        subgroups = [
            child
            for child in sorted(candidate.children, key=_fragment_key)
            if isinstance(child, GroupNode) and child.available_count >= num
        ]
        if not subgroups:
            break
        candidate = subgroups[0]
    available = candidate.available_indices
    return available[:num] if len(available) >= num else []


def share(tree: TopologyTree, cores: int, memory_bytes: int) -> list[int]:
    """Pick one healthy GPU with at least ``cores`` (1-99) and ``memory_bytes`` left.

    GPUs are sorted by (allocatable cores, allocatable memory in 256 MiB
    blocks, process count, minor, index), so the tightest fit wins.
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or not 0 < cores < HUNDRED_CORES:
        raise ValueError(f"share: cores must be between 1 and {HUNDRED_CORES - 1}, got {cores!r}")
    _check_memory(memory_bytes, "share")
    return _tightest(tree, cores, memory_bytes)


def _tightest(tree: TopologyTree, cores: int, memory_bytes: int) -> list[int]:
    """:func:`share` for a request already checked."""
    # The first that fits in that order is the least key among those that fit (the index makes keys
    # unique): one pass, no sort, no key function per GPU (this runs on every share's Allocate).
    best: tuple[int, int, int, int, int] | None = None
    for leaf in tree.leaves:
        if leaf.healthy and leaf.allocatable_cores >= cores and leaf.allocatable_memory >= memory_bytes:
            info = leaf.info
            key = (
                leaf.allocatable_cores,
                leaf.allocatable_memory // MEMORY_BLOCK,
                len(leaf.pids),
                info.minor,
                info.index,
            )
            if best is None or key < best:
                best = key
    return [best[4]] if best is not None else []


def _check_memory(memory_bytes: int, evaluator: str) -> None:
    if isinstance(memory_bytes, bool) or not isinstance(memory_bytes, int) or memory_bytes < 0:
        raise ValueError(f"{evaluator}: memory must be a non-negative number of bytes, got {memory_bytes!r}")


def choose(tree: TopologyTree, cores: int, memory_bytes: int) -> list[int]:
    """Dispatch a request: over 100 cores to :func:`link`, exactly 100 to :func:`fragment`,
    fewer to :func:`share`.

    Raises :class:`ValueError` for ``cores <= 0``, for more than 100 cores that
    are not a multiple of 100, and for negative memory.
    """
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise ValueError(f"cores must be an int, got {cores!r}")
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    if cores > HUNDRED_CORES and cores % HUNDRED_CORES:
        raise ValueError(f"cores are greater than 100, must be multiple of 100: {cores}")
    _check_memory(memory_bytes, "choose")
    if cores > HUNDRED_CORES:
        return link(tree, cores)
    if cores == HUNDRED_CORES:
        return fragment(tree, cores)
    return _tightest(tree, cores, memory_bytes)  # checked above: cores 1-99 (ints), memory >= 0
