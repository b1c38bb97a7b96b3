"""GPU topology tree (NVML levels + NVLink) and the link/fragment/share evaluators.

Typical use::

    tree = build_tree(gpus, topology)
    picked = choose(tree, cores=200, memory_bytes=0)   # NVML indices
    for index in picked:
        tree.occupy(index, 200, 0)
    print(render_graph(tree))
"""

from gpumanager.topology.evaluators import MEMORY_BLOCK, choose, fragment, link, share
from gpumanager.topology.graph import render_graph, render_shape
from gpumanager.topology.levels import GROUP_LEVELS, Level, level_name
from gpumanager.topology.nodes import HUNDRED_CORES, GPUNode, GroupNode, TreeNode
from gpumanager.topology.tree import TopologyTree, build_tree, empty_tree

__all__ = [
    "GROUP_LEVELS",
    "HUNDRED_CORES",
    "MEMORY_BLOCK",
    "GPUNode",
    "GroupNode",
    "Level",
    "TopologyTree",
    "TreeNode",
    "build_tree",
    "choose",
    "empty_tree",
    "fragment",
    "level_name",
    "link",
    "render_graph",
    "render_shape",
    "share",
]
