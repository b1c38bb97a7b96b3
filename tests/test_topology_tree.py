"""Building the topology tree and changing its allocation state."""

from __future__ import annotations

import logging

import pytest

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.topology import GPUNode, GroupNode, Level, TopologyTree, build_tree, render_shape
from gpumanager.topology.synthetic import (
    DEFAULT_MEMORY,
    all_pairs,
    levels_from_groups,
    make_gpus,
    tree_from_levels,
)

GIB = 1024**3


def upstream_six() -> TopologyTree:
    """Upstream's test node: PIX{0,1},{2,3},{4,5}, PHB{0-3}, SOC (CPU level) between all."""
    levels = levels_from_groups(
        6,
        {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]},
        default=Level.CPU,
    )
    return tree_from_levels(levels)


def h100x8() -> TopologyTree:
    """8 x H100: PXB pairs, NODE within NUMA 0-3 / 4-7, SYS across, NVLink between every pair."""
    levels = levels_from_groups(
        8,
        {Level.MULTIPLE: [[0, 1], [2, 3], [4, 5], [6, 7]], Level.CPU: [[0, 1, 2, 3], [4, 5, 6, 7]]},
        default=Level.SYSTEM,
    )
    return tree_from_levels(levels, all_pairs(range(8), links=18), memory_total=80 * GIB)


def h200x16() -> TopologyTree:
    """16 x H200: NUMA 0 = 0-7, 1 = 8-15, PXB pairs, NODE within a socket, NVLink within a socket."""
    levels = levels_from_groups(
        16,
        {
            Level.MULTIPLE: [[i, i + 1] for i in range(0, 16, 2)],
            Level.CPU: [list(range(8)), list(range(8, 16))],
        },
        default=Level.SYSTEM,
    )
    nvlink = all_pairs(range(8)) + all_pairs(range(8, 16))
    return tree_from_levels(levels, nvlink, memory_total=141 * GIB)


def group_members(tree: TopologyTree, level: Level) -> list[tuple[int, ...]]:
    return [g.indices for g in tree.groups() if g.level == level]


# -- shape -------------------------------------------------------------------------------------


def test_upstream_topology_gives_upstream_tree() -> None:
    tree = upstream_six()
    assert render_shape(tree) == "ROOT[CPU[PHB[PIX[0,1],PIX[2,3]],PIX[4,5]]]"
    # PIX{4,5} hangs directly under the CPU group: no PHB level of its own.
    pix45 = tree.leaf(4).parent
    assert isinstance(pix45, GroupNode)
    assert pix45.level == Level.SINGLE
    assert pix45.parent is not None and pix45.parent.level == Level.CPU
    assert tree.root.is_root and tree.root.label == "ROOT"
    assert tree.root.indices == (0, 1, 2, 3, 4, 5)


def test_no_level_repeats_a_group_with_the_same_members() -> None:
    # PIX pairs are also PXB/PHB/CPU components in their own right: only the tightest is kept.
    assert group_members(upstream_six(), Level.MULTIPLE) == []
    tree = tree_from_levels(levels_from_groups(2, {Level.SINGLE: [[0, 1]]}), [(0, 1)])
    assert render_shape(tree) == "ROOT[NVL[0,1]]"


def test_every_group_has_at_least_two_children() -> None:
    for tree in (upstream_six(), h100x8(), h200x16()):
        for group in tree.groups():
            assert len(group.children) >= 2
            for child in group.children:
                assert child.parent is group


def test_pcie_hierarchy_without_nvlink() -> None:
    # The layout of upstream issue #191: SYS -> CPU -> PXB -> GPU.
    levels = levels_from_groups(
        8,
        {Level.MULTIPLE: [[0, 1], [2, 3], [4, 5], [6, 7]], Level.CPU: [[0, 1, 2, 3], [4, 5, 6, 7]]},
    )
    tree = tree_from_levels(levels)
    assert render_shape(tree) == "ROOT[SYS[CPU[PXB[0,1],PXB[2,3]],CPU[PXB[4,5],PXB[6,7]]]]"


def test_nvlink_pairs_under_one_host_bridge() -> None:
    levels = levels_from_groups(4, {}, default=Level.HOSTBRIDGE)
    tree = tree_from_levels(levels, [(0, 2, 2), (1, 3, 2)])
    assert render_shape(tree) == "ROOT[PHB[NVL[0,2],NVL[1,3]]]"
    assert group_members(tree, Level.NVLINK) == [(0, 2), (1, 3)]


def test_h100x8_nvlink_groups_per_socket_under_sys() -> None:
    tree = h100x8()
    # NVLink within a socket is tighter than the PXB pairs, so the pairs disappear;
    # NVLink across sockets (level SYS) does not merge the sockets.
    assert render_shape(tree) == "ROOT[SYS[NVL[0,1,2,3],NVL[4,5,6,7]]]"
    assert group_members(tree, Level.MULTIPLE) == []


def test_h200x16_nvlink_groups_per_socket_under_sys() -> None:
    tree = h200x16()
    assert render_shape(tree) == "ROOT[SYS[NVL[0,1,2,3,4,5,6,7],NVL[8,9,10,11,12,13,14,15]]]"
    assert len(tree) == 16


def test_cross_socket_nvlink_does_not_merge_sockets() -> None:
    levels = levels_from_groups(4, {Level.CPU: [[0, 1], [2, 3]]})
    tree = tree_from_levels(levels, [(1, 2)])
    assert render_shape(tree) == "ROOT[SYS[CPU[0,1],CPU[2,3]]]"
    # The same link inside one socket does make an NVLink group.
    same_socket = tree_from_levels(levels_from_groups(4, {}, default=Level.CPU), [(1, 2)])
    assert render_shape(same_socket) == "ROOT[CPU[0,NVL[1,2],3]]"


def test_nvlink_entry_without_active_links_is_ignored() -> None:
    tree = tree_from_levels(levels_from_groups(2, {}, default=Level.HOSTBRIDGE), [(0, 1, 0)])
    assert render_shape(tree) == "ROOT[PHB[0,1]]"


def test_nvlink_to_a_gpu_outside_the_tree_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    gpus = make_gpus(2)
    topology = NodeTopology(levels=levels_from_groups(3, {}, default=Level.CPU), nvlink=((0, 2, 4),))
    with caplog.at_level(logging.WARNING):
        tree = build_tree(gpus, topology)
    assert render_shape(tree) == "ROOT[CPU[0,1]]"
    assert "not in the tree" in caplog.text


def test_chained_levels_are_grouped_by_connectivity() -> None:
    # Not hierarchical: 0-1 and 1-2 share a switch but 0-2 only a host bridge.
    levels = (
        (0, 10, 30),
        (10, 0, 10),
        (30, 10, 0),
    )
    assert render_shape(tree_from_levels(levels)) == "ROOT[PIX[0,1,2]]"


def test_unrelated_gpus_hang_under_the_root() -> None:
    levels = ((0, Level.UNKNOWN), (Level.UNKNOWN, 0))
    tree = tree_from_levels(levels)
    assert render_shape(tree) == "ROOT[0,1]"
    assert tree.groups() == []


def test_multi_gpu_board_fix() -> None:
    levels = (
        (0, 0, 30, 30),
        (0, 0, 30, 30),
        (30, 30, 0, 0),
        (30, 30, 0, 0),
    )
    tree = tree_from_levels(levels, multi_gpu_board=True)
    assert render_shape(tree) == "ROOT[PHB[PIX[0,1],PIX[2,3]]]"


def test_level_zero_without_board_flag_is_pix_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        tree = tree_from_levels(((0, 0), (0, 0)))
    assert render_shape(tree) == "ROOT[PIX[0,1]]"
    assert "multi-GPU board" in caplog.text


def test_single_gpu_tree() -> None:
    tree = build_tree(make_gpus(1), NodeTopology(levels=()))
    assert render_shape(tree) == "ROOT[0]"
    assert tree.leaf(0).parent is tree.root
    assert tree.groups() == []


def test_non_contiguous_indices() -> None:
    gpus = [g for g in make_gpus(3) if g.index != 1]
    tree = build_tree(gpus, NodeTopology(levels=levels_from_groups(3, {Level.SINGLE: [[0, 2]]})))
    assert render_shape(tree) == "ROOT[PIX[0,2]]"
    with pytest.raises(ValueError, match="unknown GPU index 1"):
        tree.leaf(1)


def test_leaf_fields() -> None:
    info = GPUInfo(
        index=3,
        uuid="GPU-abc",
        name="Tesla T4",
        minor=7,
        memory_total=15 * GIB,
        pci_bus_id="00000000:3B:00.0",
    )
    tree = build_tree([info], NodeTopology(levels=levels_from_groups(4, {})))
    leaf = tree.leaf(3)
    assert (leaf.index, leaf.minor, leaf.uuid, leaf.bus_id) == (3, 7, "GPU-abc", "00000000:3B:00.0")
    assert leaf.total_memory == 15 * GIB
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (100, 15 * GIB)
    assert (leaf.pids, leaf.used_memory) == ((), 0)
    assert leaf.label == "GPU3"
    assert tree.leaf_by_minor(7) is leaf
    assert tree.leaf_by_device_path("/dev/nvidia7") is leaf
    with pytest.raises(ValueError, match="minor number 3"):
        tree.leaf_by_minor(3)
    with pytest.raises(ValueError, match="/dev/nvidia3"):
        tree.leaf_by_device_path("/dev/nvidia3")


def test_thirty_three_gpus_need_no_bitmask_limit() -> None:
    levels = levels_from_groups(33, {Level.SINGLE: [[31, 32]]}, default=Level.CPU)
    tree = tree_from_levels(levels)
    assert group_members(tree, Level.SINGLE) == [(31, 32)]
    assert tree.available_indices() == list(range(33))


# -- invalid input -----------------------------------------------------------------------------


def test_no_gpus_is_rejected() -> None:
    with pytest.raises(ValueError, match="without GPUs"):
        build_tree([], NodeTopology(levels=()))


def test_non_square_matrix_is_rejected() -> None:
    with pytest.raises(ValueError, match="not square: row 1"):
        build_tree(make_gpus(2), NodeTopology(levels=((0, 10), (10,))))


def test_too_small_matrix_is_rejected() -> None:
    with pytest.raises(ValueError, match="GPU index 2"):
        build_tree(make_gpus(3), NodeTopology(levels=((0, 10), (10, 0))))


def test_negative_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="GPU 0 and GPU 1"):
        build_tree(make_gpus(2), NodeTopology(levels=((0, -1), (-1, 0))))


def test_duplicate_index_is_rejected() -> None:
    gpus = make_gpus(2)
    with pytest.raises(ValueError, match="duplicate GPU index 0"):
        build_tree([gpus[0], gpus[0]], NodeTopology(levels=((0, 10), (10, 0))))


def test_self_nvlink_is_rejected() -> None:
    with pytest.raises(ValueError, match="itself"):
        build_tree(make_gpus(2), NodeTopology(levels=((0, 10), (10, 0)), nvlink=((1, 1, 2),)))


# -- occupy / free -----------------------------------------------------------------------------


def ancestors_available(tree: TopologyTree, index: int) -> list[bool]:
    """Whether GPU ``index`` is in the available set of each of its ancestors."""
    result = []
    node = tree.leaf(index).parent
    while node is not None:
        result.append(index in node.available_indices)
        node = node.parent
    return result


def test_exclusive_occupy_and_free_round_trip() -> None:
    tree = upstream_six()
    tree.occupy(2, 100, 0)
    leaf = tree.leaf(2)
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (0, 0)
    assert ancestors_available(tree, 2) == [False, False, False, False]
    assert tree.available_indices() == [0, 1, 3, 4, 5]
    tree.free(2, 100, 0)
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (100, DEFAULT_MEMORY)
    assert ancestors_available(tree, 2) == [True, True, True, True]
    assert tree.available_indices() == [0, 1, 2, 3, 4, 5]


def test_multi_gpu_cores_take_each_gpu_whole() -> None:
    tree = upstream_six()
    tree.occupy(0, 300, 0)
    assert (tree.leaf(0).allocatable_cores, tree.leaf(0).allocatable_memory) == (0, 0)


def test_share_occupy_removes_gpu_from_pool_until_all_cores_are_back() -> None:
    tree = upstream_six()
    tree.occupy(1, 30, GIB)
    tree.occupy(1, 20, GIB)
    leaf = tree.leaf(1)
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (50, DEFAULT_MEMORY - 2 * GIB)
    assert ancestors_available(tree, 1) == [False, False, False, False]
    tree.free(1, 30, GIB)
    assert leaf.allocatable_cores == 80
    assert ancestors_available(tree, 1) == [False, False, False, False]
    tree.free(1, 20, GIB)
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (100, DEFAULT_MEMORY)
    assert ancestors_available(tree, 1) == [True, True, True, True]


def test_occupy_with_zero_cores_still_takes_gpu_out_of_pool() -> None:
    tree = upstream_six()
    tree.occupy(4, 0, GIB)
    assert 4 not in tree.available_indices()
    assert tree.leaf(4).allocatable_cores == 100
    tree.free(4, 0, GIB)
    assert 4 in tree.available_indices()


def test_over_commit_is_floored_at_zero(caplog: pytest.LogCaptureFixture) -> None:
    tree = upstream_six()
    with caplog.at_level(logging.WARNING):
        tree.occupy(0, 60, DEFAULT_MEMORY)
        tree.occupy(0, 60, GIB)
    assert (tree.leaf(0).allocatable_cores, tree.leaf(0).allocatable_memory) == (0, 0)
    assert "over-committed" in caplog.text


def test_freeing_more_than_allocated_is_capped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    tree = upstream_six()
    tree.occupy(3, 40, GIB)
    with caplog.at_level(logging.WARNING):
        tree.free(3, 70, 2 * GIB)
    leaf = tree.leaf(3)
    assert (leaf.allocatable_cores, leaf.allocatable_memory) == (100, DEFAULT_MEMORY)
    assert "more than allocated" in caplog.text
    assert 3 in tree.available_indices()


def test_exclusive_free_of_shared_gpu_restores_it_whole() -> None:
    tree = upstream_six()
    tree.occupy(0, 50, GIB)
    tree.free(0, 100, 0)
    assert (tree.leaf(0).allocatable_cores, tree.leaf(0).allocatable_memory) == (100, DEFAULT_MEMORY)
    assert 0 in tree.available_indices()


@pytest.mark.parametrize("method", ["occupy", "free"])
def test_unknown_index_is_named(method: str) -> None:
    tree = upstream_six()
    with pytest.raises(ValueError, match="unknown GPU index 9"):
        getattr(tree, method)(9, 100, 0)


@pytest.mark.parametrize(("cores", "memory"), [(-1, 0), (50, -1), (True, 0), (50, 1.5)])
def test_bad_amounts_are_rejected(cores: object, memory: object) -> None:
    tree = upstream_six()
    with pytest.raises(ValueError, match="GPU 0"):
        tree.occupy(0, cores, memory)  # type: ignore[arg-type]
    assert tree.leaf(0).allocatable_cores == 100
    assert 0 in tree.available_indices()


# -- health ------------------------------------------------------------------------------------


def test_unhealthy_gpu_leaves_available_sets_but_keeps_accounting() -> None:
    tree = upstream_six()
    tree.occupy(0, 40, GIB)
    tree.set_healthy(5, False)
    tree.set_healthy(0, False)
    assert ancestors_available(tree, 5) == [False, False, False]
    assert tree.available_indices() == [1, 2, 3, 4]
    assert tree.leaf(0).allocatable_cores == 60
    tree.set_healthy(5, True)
    assert ancestors_available(tree, 5) == [True, True, True]
    # Healthy again, but still partly allocated: not back until freed.
    tree.set_healthy(0, True)
    assert 0 not in tree.available_indices()
    tree.free(0, 40, GIB)
    assert tree.available_indices() == [0, 1, 2, 3, 4, 5]


def test_free_while_unhealthy_does_not_make_gpu_available() -> None:
    tree = upstream_six()
    tree.occupy(2, 100, 0)
    tree.set_healthy(2, False)
    tree.free(2, 100, 0)
    assert 2 not in tree.available_indices()
    tree.set_healthy(2, True)
    assert 2 in tree.available_indices()


def test_set_healthy_validates() -> None:
    tree = upstream_six()
    with pytest.raises(ValueError, match="unknown GPU index 6"):
        tree.set_healthy(6, False)
    with pytest.raises(ValueError, match="bool"):
        tree.set_healthy(0, 0)  # type: ignore[arg-type]


# -- usage, clone ------------------------------------------------------------------------------


def test_update_usage_sums_into_groups() -> None:
    tree = upstream_six()
    tree.update_usage(1, [300, 200], 3 * GIB)
    tree.update_usage(0, [100], GIB)
    group = tree.leaf(0).parent
    assert isinstance(group, GroupNode)
    assert group.pids == (100, 300, 200)
    assert group.used_memory == 4 * GIB
    assert group.total_memory == 2 * DEFAULT_MEMORY
    assert (group.allocatable_cores, group.allocatable_memory, group.minor) == (0, 0, 0)
    # Usage does not change allocation state.
    assert tree.available_indices() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="used memory"):
        tree.update_usage(0, [], -1)


def test_clone_is_independent() -> None:
    tree = upstream_six()
    copy = tree.clone()
    copy.occupy(0, 100, 0)
    assert tree.available_indices() == [0, 1, 2, 3, 4, 5]
    assert copy.available_indices() == [1, 2, 3, 4, 5]
    assert isinstance(copy.leaf(0), GPUNode)
    assert copy.leaf(0).parent is not tree.leaf(0).parent


def test_clone_keeps_shape_and_state() -> None:
    tree = upstream_six()
    tree.occupy(0, 30, GIB)
    tree.occupy(3, 100, 0)
    tree.set_healthy(5, False)
    tree.update_usage(1, [7, 8], 2 * GIB)
    copy = tree.clone()
    assert render_shape(copy) == render_shape(tree)
    assert [g.indices for g in copy.groups()] == [g.indices for g in tree.groups()]
    assert [g.level for g in copy.groups()] == [g.level for g in tree.groups()]
    for old, new in zip(tree.leaves, copy.leaves, strict=True):
        assert new is not old and new.info is old.info
        assert (new.allocatable_cores, new.allocatable_memory, new.pids, new.used_memory, new.healthy) == (
            old.allocatable_cores,
            old.allocatable_memory,
            old.pids,
            old.used_memory,
            old.healthy,
        )
        assert new.in_pool == old.in_pool
        assert copy.leaf(new.index) is new and copy.leaf_by_minor(new.minor) is new
    # Every link stays inside the copy: parents, children and each group's leaves.
    nodes = [copy.root, *copy.groups(), *copy.leaves]
    ids = {id(n) for n in nodes}
    for group in [copy.root, *copy.groups()]:
        assert all(id(c) in ids and c.parent is group for c in group.children)
        assert all(id(leaf) in ids for leaf in group.leaves)
    assert copy.available_indices() == tree.available_indices() == [1, 2, 4]
    copy.free(3, 100, 0)
    assert copy.available_indices() == [1, 2, 3, 4] and tree.available_indices() == [1, 2, 4]
