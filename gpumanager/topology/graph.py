"""Text renderings of the topology tree.

:func:`render_graph` reproduces upstream gpu-manager's ``PrintGraph`` text
(served at ``/graph``); :func:`render_shape` is a one-line summary for logs
and tests.
"""

from __future__ import annotations

from gpumanager.topology.nodes import GPUNode, GroupNode, TreeNode
from gpumanager.topology.tree import TopologyTree


def _graph_key(node: TreeNode) -> tuple[int, ...]:
    # ByType, ByAvailable, ByMinorID, then lowest index. As upstream, a GPU
    # counts as 1 available here whatever its state, so GPUs print by minor.
    available = 1 if isinstance(node, GPUNode) else node.available_count
    return (node.level, available, node.minor, node.first_index)


def _go_slice(values: tuple[int, ...]) -> str:
    return "[" + " ".join(str(v) for v in values) + "]"


def _describe(node: TreeNode) -> str:
    usage = (
        f"pids: {_go_slice(node.pids)}, usedMemory: {node.used_memory}, totalMemory: {node.total_memory}, "
        f"allocatableCores: {node.allocatable_cores}, allocatableMemory: {node.allocatable_memory}"
    )
    if isinstance(node, GPUNode):
        return f"{node.label} ({usage})"
    return f"{node.label} (aval: {node.available_count}, {usage})"


def render_graph(tree: TopologyTree) -> str:
    """Render the tree as upstream's ``PrintGraph`` text, one node per line, ending in a newline.

    ``ROOT:<available GPUs>`` comes first; a node at depth *d* is prefixed by
    *d - 1* times ``"|   "`` and then ``"|---"``. Children are ordered by
    (level, available GPUs, minor, lowest index).
    """
    lines = [f"ROOT:{tree.root.available_count}"]

    def walk(group: GroupNode, depth: int) -> None:
        for child in sorted(group.children, key=_graph_key):
            lines.append("|   " * depth + "|---" + _describe(child))
            if isinstance(child, GroupNode):
                walk(child, depth + 1)

    walk(tree.root, 0)
    return "\n".join(lines) + "\n"


def render_shape(tree: TopologyTree) -> str:
    """One-line shape of the tree, children by lowest index: e.g. ``ROOT[SYS[NVL[0,1],NVL[2,3]]]``."""

    def shape(node: TreeNode) -> str:
        if isinstance(node, GPUNode):
            return str(node.index)
        inner = ",".join(shape(child) for child in sorted(node.children, key=lambda c: c.first_index))
        return f"{node.label}[{inner}]"

    return shape(tree.root)
