"""Placement depends on the allocation state only, and odd topologies are placed sensibly."""

from __future__ import annotations

from pathlib import Path

from gpumanager.topology import TopologyTree, choose, render_shape
from gpumanager.topology.levels import Level
from gpumanager.topology.synthetic import levels_from_groups, tree_from_levels
from tests.alloc_fixtures import MIB, FakePods, core_ids, make_allocator, make_pod, uid_of


def test_showing_the_graph_does_not_change_where_a_share_goes(tmp_path: Path) -> None:
    # /graph records each GPU's processes to print them; a process seen on GPU 0 by an earlier /graph
    # (perhaps of a pod long gone) must not steer later placements away from GPU 0.
    def place(show_graph: bool) -> tuple[int, ...]:
        pods = FakePods([make_pod("share", [("c0", 50, 4)])])
        alloc = make_allocator(tmp_path / str(show_graph), pods)
        if show_graph:
            text = alloc.graph({0: ([4242], 512 * MIB)})
            assert "4242" in text
        alloc.allocate(core_ids(0, 50))
        placed = alloc.get(uid_of("share"), "c0")
        assert placed is not None
        return placed.minors

    assert place(show_graph=True) == place(show_graph=False) == (0,)


def test_showing_the_graph_does_not_change_where_whole_gpus_go(tmp_path: Path) -> None:
    def place(show_graph: bool) -> tuple[int, ...]:
        pods = FakePods([make_pod("whole", [("c0", 200, 0)])])
        alloc = make_allocator(tmp_path / str(show_graph), pods)
        if show_graph:
            alloc.graph({0: ([1], 0), 1: ([2, 3], 0)})
        alloc.allocate(core_ids(0, 100) + core_ids(1, 100))
        placed = alloc.get(uid_of("whole"), "c0")
        assert placed is not None
        return placed.minors

    assert place(show_graph=True) == place(show_graph=False) == (0, 1)


def _bridged_tree() -> TopologyTree:
    # PCIe: switches {0,1}, {2,3}, {4,5}; {0-3} under one host bridge; all six on one CPU.
    # An NVLink bridge joins GPUs 1 and 2, across the two switches.
    levels = levels_from_groups(
        6, {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]}, default=Level.CPU
    )
    return tree_from_levels(levels, [(1, 2)])


def test_an_nvlink_bridge_across_switches_does_not_make_a_pcie_switch_group() -> None:
    tree = _bridged_tree()
    # GPUs 0 and 3 are a host bridge apart: no group may call them one switch apart.
    assert render_shape(tree) == "ROOT[CPU[PHB[0,NVL[1,2],3],PIX[4,5]]]"


def test_two_gpus_go_to_a_real_switch_pair_once_the_nvlink_pair_is_taken() -> None:
    tree = _bridged_tree()
    first = choose(tree, 200, 0)
    assert first == [1, 2]  # the NVLink pair first
    for index in first:
        tree.occupy(index, 200, 0)
    # Left: 0 and 3 (a host bridge apart) and 4, 5 (one PCIe switch): the switch pair is the closer.
    assert choose(tree, 200, 0) == [4, 5]


def _chain_tree() -> TopologyTree:
    # PCIe as in _bridged_tree; NVLink joins 0-1 and 1-2 but not 0-2 (a chain, not all-to-all).
    levels = levels_from_groups(
        6, {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]}, default=Level.CPU
    )
    return tree_from_levels(levels, [(0, 1), (1, 2)])


def test_an_nvlink_group_holds_only_gpus_linked_to_each_other() -> None:
    tree = _chain_tree()
    assert render_shape(tree) == "ROOT[CPU[PHB[NVL[0,1],PIX[2,3]],PIX[4,5]]]"


def test_two_gpus_are_not_given_as_nvlink_peers_when_they_are_not() -> None:
    tree = _chain_tree()
    assert choose(tree, 200, 0) == [0, 1]  # linked
    tree.occupy(1, 50, 0)  # GPU 1 shared: 0 and 2 are left of the chain, with no link between them
    assert choose(tree, 200, 0) == [2, 3]  # one switch, rather than 0 and 2 a host bridge apart


def test_an_nvlink_ring_is_grouped_in_linked_pairs() -> None:
    levels = levels_from_groups(4, {Level.SINGLE: [[0, 1, 2, 3]]})
    tree = tree_from_levels(levels, [(0, 1), (1, 2), (2, 3), (0, 3)])
    assert render_shape(tree) == "ROOT[PIX[NVL[0,1],NVL[2,3]]]"
    tree.occupy(0, 100, 0)
    assert choose(tree, 200, 0) == [2, 3]
