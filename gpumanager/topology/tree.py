"""The GPU topology tree: how it is built and how allocations change it.

Grouping rule
-------------
For two different GPUs *i* and *j*, ``level(i, j)`` is NVML's common-ancestor
level from :class:`~gpumanager.device.types.NodeTopology` (read from the upper
triangle, ``levels[min][max]``, as upstream queries pairs ``a < b``). A level
below :attr:`Level.SINGLE` between two different GPUs is raised to ``SINGLE``:
this is upstream's fix for multi-GPU boards, which report 0 (INTERNAL); a
warning is logged when neither GPU says it sits on a multi-GPU board.

Two GPUs are *NVLink peers* when they share at least one active NVLink **and**
``level(i, j) < SYSTEM`` (NVLink across CPU sockets does not hide the NUMA
split). The NVLink groups are sets of GPUs that are all peers of each other:
each connected set of peers that is all-to-all, and a set that is not (a chain
0-1-2, a ring) split lowest index first into sets that are. The *effective
distance* ``d(i, j)`` is :attr:`Level.NVLINK` when *i* and *j* are in one NVLink
group; otherwise it is ``level(i, j)``.

For each level L of ``NVLINK, SINGLE, MULTIPLE, HOSTBRIDGE, CPU, SYSTEM``
(tightest first) the groups at L are the connected components with at least
two GPUs of the graph whose edges are the pairs with ``d(i, j) <= L``. At a
PCIe level (``SINGLE`` and looser) a component is kept only when the PCIe
pairs alone (``level(i, j) <= L``) connect it: GPUs held together at L only
through an NVLink bridge (two switch pairs with one GPU of each bridged) are
not all within L of each other over PCIe, so they are no group at L and are
grouped at the level that connects them over PCIe. A component whose members
are exactly those of a group already made at a tighter level is not repeated
(the tightest one is kept). Components at a looser level
are unions of components at tighter levels, so the groups nest and form a
proper tree; each group's children are the largest tighter groups (or lone
GPUs) it contains, and every group has at least two children. The root sits
above the top groups and GPUs in no group; a single GPU hangs directly under
the root.

For the hierarchical matrices upstream understands (each level a partition
refining the next) this gives exactly upstream's tree.

Allocation state
----------------
:meth:`TopologyTree.occupy` and :meth:`TopologyTree.free` follow upstream: any
occupation takes the GPU out of its ancestors' available sets; it returns only
when all of its cores are free again. :meth:`TopologyTree.set_healthy` takes a
GPU out of every evaluator's reach while keeping its accounting. The tree is
not thread-safe; its owner serialises access.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.topology.levels import GROUP_LEVELS, Level
from gpumanager.topology.nodes import HUNDRED_CORES, GPUNode, GroupNode, TreeNode

log = logging.getLogger(__name__)


class TopologyTree:
    """GPUs of one node arranged by topology, with their allocation state.

    Build it with :func:`build_tree`. GPUs are addressed by NVML index; every
    method raises :class:`ValueError` naming an unknown index.
    """

    def __init__(self, root: GroupNode, leaves: Iterable[GPUNode]) -> None:
        self.root = root
        self.leaves: tuple[GPUNode, ...] = tuple(sorted(leaves, key=lambda leaf: leaf.index))
        self._by_index = {leaf.index: leaf for leaf in self.leaves}
        self._by_minor = {leaf.minor: leaf for leaf in self.leaves}
        self._numa_nodes: frozenset[int] | None = _numa_nodes(self.leaves)
        #: Counts the changes the evaluators' choices depend on (allocations, health, the number of processes
        #: on a GPU, a GPU's description): a choice made at one count is the choice at the same count.
        self.version = 0

    def __len__(self) -> int:
        return len(self.leaves)

    # -- queries -------------------------------------------------------------------------------

    def leaf(self, index: int) -> GPUNode:
        """Return the GPU with NVML index ``index``."""
        try:
            return self._by_index[index]
        except (KeyError, TypeError):
            known = ", ".join(str(i) for i in self._by_index)
            raise ValueError(f"unknown GPU index {index!r} (known: {known})") from None

    def leaf_by_minor(self, minor: int) -> GPUNode:
        """Return the GPU whose device node is ``/dev/nvidia<minor>``."""
        try:
            return self._by_minor[minor]
        except (KeyError, TypeError):
            raise ValueError(f"unknown GPU minor number {minor!r}") from None

    @property
    def numa_nodes(self) -> frozenset[int] | None:
        """The NUMA nodes of the node's GPUs; None when some GPU has none (or there is no GPU). Kept
        with the tree (every share's Allocate asks), made again when a GPU's description is replaced."""
        return self._numa_nodes

    def leaf_by_device_path(self, path: str) -> GPUNode:
        """Return the GPU whose device node is ``path`` (e.g. ``/dev/nvidia3``)."""
        for leaf in self.leaves:
            if leaf.device_path == path:
                return leaf
        raise ValueError(f"unknown GPU device {path!r}")

    def groups(self) -> list[GroupNode]:
        """All groups below the root, parents before children, children by lowest GPU index."""
        found: list[GroupNode] = []
        stack: list[GroupNode] = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                found.append(node)
            subgroups = [child for child in node.children if isinstance(child, GroupNode)]
            stack.extend(sorted(subgroups, key=lambda g: g.first_index, reverse=True))
        return found

    def available_indices(self) -> list[int]:
        """Indices of the GPUs available to whole-GPU requests, ascending."""
        return self.root.available_indices

    def clone(self) -> TopologyTree:
        """Return an independent copy (for what-if evaluation): the same groups and GPUs with the same
        state, sharing only the immutable :class:`GPUInfo` of each GPU. Built node by node, not with
        :func:`copy.deepcopy` (ten times slower, and taken under the allocator's lock)."""
        copies: dict[int, GPUNode] = {}

        def copy_group(group: GroupNode, parent: GroupNode | None) -> GroupNode:
            new = GroupNode(level=group.level, leaves=(), parent=parent, is_root=group.is_root)
            for child in group.children:
                if isinstance(child, GPUNode):
                    leaf = replace(child, parent=new)
                    copies[leaf.index] = leaf
                    new.children.append(leaf)
                else:
                    new.children.append(copy_group(child, new))
            new.leaves = tuple(copies[leaf.index] for leaf in group.leaves)
            return new

        return TopologyTree(copy_group(self.root, None), copies.values())

    # -- state changes -------------------------------------------------------------------------

    def occupy(self, index: int, cores: int, memory: int) -> None:
        """Record an allocation of ``cores`` and ``memory`` bytes on GPU ``index``.

        Any occupation (even a fraction) takes the GPU out of its ancestors'
        available sets. ``cores >= 100`` takes the whole GPU; otherwise cores
        and memory are subtracted, floored at 0 (an over-commit is logged).
        """
        leaf = self.leaf(index)
        if type(cores) is not int or type(memory) is not int or cores < 0 or memory < 0:
            _check_amounts(index, cores, memory)  # plain non-negative ints pass without a call
        self.version += 1
        leaf.in_pool = False
        if cores >= HUNDRED_CORES:
            if leaf.allocatable_cores < HUNDRED_CORES:
                log.warning(
                    "GPU %d taken whole while %d cores were already allocated",
                    index,
                    HUNDRED_CORES - leaf.allocatable_cores,
                )
            leaf.allocatable_cores = 0
            leaf.allocatable_memory = 0
            return
        if cores > leaf.allocatable_cores or memory > leaf.allocatable_memory:
            log.warning(
                "GPU %d over-committed: occupying %d cores / %d bytes with %d cores / %d bytes left",
                index,
                cores,
                memory,
                leaf.allocatable_cores,
                leaf.allocatable_memory,
            )
        leaf.allocatable_cores = max(0, leaf.allocatable_cores - cores)
        leaf.allocatable_memory = max(0, leaf.allocatable_memory - memory)

    def free(self, index: int, cores: int, memory: int) -> None:
        """Release an allocation of ``cores`` and ``memory`` bytes on GPU ``index``.

        ``cores >= 100`` frees the whole GPU; otherwise cores and memory are
        added back, capped at 100 and the total (freeing more than was
        allocated is logged). The GPU becomes available again once all of its
        cores are free (and it is healthy).
        """
        leaf = self.leaf(index)
        if type(cores) is not int or type(memory) is not int or cores < 0 or memory < 0:
            _check_amounts(index, cores, memory)
        self.version += 1
        if cores >= HUNDRED_CORES:
            leaf.allocatable_cores = HUNDRED_CORES
            leaf.allocatable_memory = leaf.total_memory
        else:
            new_cores = leaf.allocatable_cores + cores
            new_memory = leaf.allocatable_memory + memory
            if new_cores > HUNDRED_CORES or new_memory > leaf.total_memory:
                log.warning(
                    "GPU %d: freeing %d cores / %d bytes, more than allocated (%d cores / %d bytes); capped",
                    index,
                    cores,
                    memory,
                    HUNDRED_CORES - leaf.allocatable_cores,
                    leaf.total_memory - leaf.allocatable_memory,
                )
            leaf.allocatable_cores = min(HUNDRED_CORES, new_cores)
            leaf.allocatable_memory = min(leaf.total_memory, new_memory)
        if leaf.allocatable_cores == HUNDRED_CORES:
            leaf.in_pool = True

    def replace_info(self, info: GPUInfo) -> None:
        """What NVML says of GPU ``info.index`` now replaces what the tree was built with (a GPU lost at
        start was described by a guess); what is allocated on it stays allocated."""
        leaf = self.leaf(info.index)
        self.version += 1
        used = leaf.total_memory - leaf.allocatable_memory
        leaf.info = info
        leaf.allocatable_memory = max(0, info.memory_total - used)
        self._by_minor = {g.minor: g for g in self.leaves}
        self._numa_nodes = _numa_nodes(self.leaves)

    def set_healthy(self, index: int, healthy: bool) -> None:
        """Mark GPU ``index`` healthy or not.

        An unhealthy GPU is offered by no evaluator; its allocation accounting
        is kept, so it becomes available again when healthy and fully free.
        """
        leaf = self.leaf(index)
        if not isinstance(healthy, bool):
            raise ValueError(f"GPU {index}: healthy must be a bool, got {healthy!r}")
        if leaf.healthy != healthy:
            log.info("GPU %d marked %s", index, "healthy" if healthy else "unhealthy")
            self.version += 1
        leaf.healthy = healthy

    def update_usage(self, index: int, pids: Sequence[int], used_memory: int) -> None:
        """Record the processes and used memory (bytes) NVML reports for GPU ``index``."""
        leaf = self.leaf(index)
        if isinstance(used_memory, bool) or not isinstance(used_memory, int) or used_memory < 0:
            raise ValueError(f"GPU {index}: used memory must be a non-negative int, got {used_memory!r}")
        new = tuple(int(pid) for pid in pids)
        if len(new) != len(leaf.pids):  # the evaluators sort by the number of processes
            self.version += 1
        leaf.pids = new
        leaf.used_memory = used_memory


def _numa_nodes(leaves: Iterable[GPUNode]) -> frozenset[int] | None:
    nodes = set()
    for leaf in leaves:
        if leaf.info.numa_node is None:
            return None
        nodes.add(leaf.info.numa_node)
    return frozenset(nodes) if nodes else None


def _check_amounts(index: int, cores: int, memory: int) -> None:
    for what, value in (("cores", cores), ("memory", memory)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"GPU {index}: {what} must be a non-negative int, got {value!r}")


# -- building ----------------------------------------------------------------------------------


def empty_tree() -> TopologyTree:
    """The tree of a node whose driver sees no GPU (all fallen off the bus before boot): nothing to place."""
    return TopologyTree(GroupNode(level=Level.UNKNOWN, leaves=(), children=[], is_root=True), ())


def build_tree(gpus: Sequence[GPUInfo], topology: NodeTopology) -> TopologyTree:
    """Arrange ``gpus`` into a :class:`TopologyTree` by the rule in this module's docstring.

    ``topology.levels`` is indexed by NVML index and must be square and cover
    every GPU's index (it may be empty for a single GPU). NVLink triples with
    no active link are ignored; those naming a GPU not in ``gpus`` are ignored
    with a warning. Raises :class:`ValueError` on malformed input.
    """
    if not gpus:
        raise ValueError("cannot build a topology tree without GPUs")
    leaves = [GPUNode(info) for info in sorted(gpus, key=lambda g: g.index)]
    _check_gpus(leaves)
    distance, pcie = _effective_distances(leaves, topology)

    # top[i]: the largest node built so far that contains GPU i.
    top: dict[int, TreeNode] = {leaf.index: leaf for leaf in leaves}
    by_index = {leaf.index: leaf for leaf in leaves}
    for level in GROUP_LEVELS:
        over_pcie = {tuple(c) for c in _components(list(by_index), pcie, level)} if level > Level.NVLINK else None
        for members in _components(list(by_index), distance, level):
            current = top[members[0]]
            if current.indices == tuple(members):
                continue  # same membership as a tighter group: keep the tightest
            if over_pcie is not None and tuple(members) not in over_pcie:
                continue  # held together at this PCIe level only through NVLink: not a group of it
            children = _distinct_by_first_index(top[i] for i in members)
            group = GroupNode(level=level, leaves=tuple(by_index[i] for i in members), children=children)
            for child in children:
                child.parent = group
            for i in members:
                top[i] = group

    root_children = _distinct_by_first_index(top.values())
    root = GroupNode(level=Level.UNKNOWN, leaves=tuple(leaves), children=root_children, is_root=True)
    for child in root_children:
        child.parent = root
    return TopologyTree(root, leaves)


def _check_gpus(leaves: Sequence[GPUNode]) -> None:
    seen_index: set[int] = set()
    seen_minor: set[int] = set()
    for leaf in leaves:
        if leaf.index < 0:
            raise ValueError(f"GPU {leaf.uuid}: negative index {leaf.index}")
        if leaf.index in seen_index:
            raise ValueError(f"duplicate GPU index {leaf.index}")
        if leaf.minor in seen_minor:
            raise ValueError(f"duplicate GPU minor number {leaf.minor} (GPU {leaf.index})")
        if leaf.total_memory < 0:
            raise ValueError(f"GPU {leaf.index}: negative total memory {leaf.total_memory}")
        seen_index.add(leaf.index)
        seen_minor.add(leaf.minor)


def _effective_distances(
    leaves: Sequence[GPUNode], topology: NodeTopology
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """``d(i, j)`` for every pair ``i < j`` of GPU indices, and the PCIe level of each pair (the
    same without NVLink)."""
    indices = [leaf.index for leaf in leaves]
    board = {leaf.index: leaf.info.multi_gpu_board for leaf in leaves}
    levels = topology.levels
    size = len(levels)
    if len(indices) > 1:
        for row_number, row in enumerate(levels):
            if len(row) != size:
                raise ValueError(f"topology levels matrix is not square: row {row_number} is {row!r}")
        if max(indices) >= size:
            raise ValueError(f"topology levels matrix is {size}x{size} but GPU index {max(indices)} exists")

    linked: set[tuple[int, int]] = set()
    known = set(indices)
    for triple in topology.nvlink:
        a, b, links = triple
        if a == b:
            raise ValueError(f"NVLink entry {triple!r} joins GPU {a} to itself")
        if a not in known or b not in known:
            log.warning("NVLink entry %r names a GPU that is not in the tree; ignored", triple)
            continue
        if links > 0:
            linked.add((min(a, b), max(a, b)))

    distance: dict[tuple[int, int], int] = {}
    pcie: dict[tuple[int, int], int] = {}
    for pos, i in enumerate(indices):
        for j in indices[pos + 1 :]:
            level = levels[i][j]
            if isinstance(level, bool) or not isinstance(level, int) or level < 0:
                raise ValueError(f"topology level between GPU {i} and GPU {j} is invalid: {level!r}")
            if level != levels[j][i]:
                log.warning(
                    "topology levels are not symmetric for GPUs %d and %d (%d vs %d); using %d",
                    i,
                    j,
                    level,
                    levels[j][i],
                    level,
                )
            if level < Level.SINGLE:
                if not (board[i] or board[j]):
                    log.warning(
                        "GPUs %d and %d report level %d without a multi-GPU board; treated as PIX",
                        i,
                        j,
                        level,
                    )
                level = Level.SINGLE
            pcie[(i, j)] = level
    nvlink_pairs = {pair for pair in linked if pcie[pair] < Level.SYSTEM}
    for clique in _linked_cliques(indices, nvlink_pairs):
        for pos, i in enumerate(clique):
            for j in clique[pos + 1 :]:
                distance[(i, j)] = Level.NVLINK
    for pair, level in pcie.items():
        distance.setdefault(pair, level)
    return distance, pcie


def _linked_cliques(indices: Sequence[int], linked: set[tuple[int, int]]) -> list[list[int]]:
    """The NVLink groups: sets of GPUs each linked to every other. NVLink that is not all-to-all (a
    chain 0-1-2, a ring) is split, lowest index first, into sets that are: GPU i with every later GPU
    linked to all of the set so far."""
    neighbours: dict[int, set[int]] = {i: set() for i in indices}
    for a, b in linked:
        neighbours[a].add(b)
        neighbours[b].add(a)
    cliques: list[list[int]] = []
    for component in _components(list(indices), {pair: Level.NVLINK for pair in linked}, Level.NVLINK):
        left = list(component)
        split = False
        while left:
            clique = [left[0]]
            for j in left[1:]:
                if all(j in neighbours[k] for k in clique):
                    clique.append(j)
            left = [i for i in left if i not in clique]
            split = split or bool(left)
            if len(clique) >= 2:
                cliques.append(clique)
        if split:
            log.info(
                "NVLink among GPUs %s is not all-to-all; NVLink groups: %s",
                component,
                [c for c in cliques if c[0] in component],
            )
    return cliques


def _components(indices: list[int], distance: dict[tuple[int, int], int], level: int) -> list[list[int]]:
    """Connected components (size >= 2) of pairs within ``level``, each sorted, by lowest index."""
    parent = {i: i for i in indices}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for (i, j), d in distance.items():
        if d <= level:
            ri, rj = find(i), find(j)
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
    groups: dict[int, list[int]] = {}
    for i in indices:
        groups.setdefault(find(i), []).append(i)
    return sorted((sorted(g) for g in groups.values() if len(g) >= 2), key=lambda g: g[0])


def _distinct_by_first_index(nodes: Iterable[TreeNode]) -> list[TreeNode]:
    unique: dict[int, TreeNode] = {}
    for node in nodes:
        unique.setdefault(id(node), node)
    return sorted(unique.values(), key=lambda n: n.first_index)
