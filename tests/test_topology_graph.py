"""The upstream-compatible text graph and the one-line shape."""

from __future__ import annotations

from gpumanager.topology import Level, TopologyTree, render_graph, render_shape
from gpumanager.topology.synthetic import all_pairs, levels_from_groups, tree_from_levels

GIB = 1024**3


def pix_pair() -> TopologyTree:
    return tree_from_levels(levels_from_groups(2, {Level.SINGLE: [[0, 1]]}), memory_total=GIB)


def upstream_six() -> TopologyTree:
    levels = levels_from_groups(
        6,
        {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]},
        default=Level.CPU,
    )
    return tree_from_levels(levels, memory_total=GIB)


def test_small_tree_exact_text() -> None:
    tree = pix_pair()
    tree.update_usage(0, [123, 456], 100)
    tree.occupy(1, 50, GIB // 2)
    assert render_graph(tree) == (
        "ROOT:1\n"
        "|---PIX (aval: 1, pids: [123 456], usedMemory: 100, totalMemory: 2147483648, "
        "allocatableCores: 0, allocatableMemory: 0)\n"
        "|   |---GPU0 (pids: [123 456], usedMemory: 100, totalMemory: 1073741824, "
        "allocatableCores: 100, allocatableMemory: 1073741824)\n"
        "|   |---GPU1 (pids: [], usedMemory: 0, totalMemory: 1073741824, "
        "allocatableCores: 50, allocatableMemory: 536870912)\n"
    )


def test_single_gpu_text() -> None:
    tree = tree_from_levels(((0,),), memory_total=GIB)
    tree.update_usage(0, [7], 5)
    assert render_graph(tree) == (
        "ROOT:1\n"
        "|---GPU0 (pids: [7], usedMemory: 5, totalMemory: 1073741824, "
        "allocatableCores: 100, allocatableMemory: 1073741824)\n"
    )


def test_root_counts_available_gpus() -> None:
    tree = pix_pair()
    tree.occupy(0, 100, 0)
    tree.occupy(1, 100, 0)
    text = render_graph(tree)
    assert text.startswith("ROOT:0\n|---PIX (aval: 0, ")
    tree.set_healthy(1, False)
    tree.free(1, 100, 0)
    assert render_graph(tree).startswith("ROOT:0\n")
    tree.set_healthy(1, True)
    assert render_graph(tree).startswith("ROOT:1\n")


def labels_with_depth(text: str) -> list[str]:
    """Each line reduced to its prefix and name, e.g. ``|   |---PIX``."""
    return [line.split(" (")[0] for line in text.splitlines()]


def test_children_ordered_by_type_then_available() -> None:
    tree = upstream_six()
    # Under CPU, PIX{4,5} (level 10) prints before PHB{0-3} (level 30): type comes first.
    expected_start = [
        "ROOT:6",
        "|---CPU",
        "|   |---PIX",
        "|   |   |---GPU4",
        "|   |   |---GPU5",
        "|   |---PHB",
    ]
    assert labels_with_depth(render_graph(tree)) == [
        *expected_start,
        "|   |   |---PIX",
        "|   |   |   |---GPU0",
        "|   |   |   |---GPU1",
        "|   |   |---PIX",
        "|   |   |   |---GPU2",
        "|   |   |   |---GPU3",
    ]
    for index in (1, 2, 3):
        tree.occupy(index, 100, 0)
    text = render_graph(tree)
    # Same type: PIX{2,3} (0 available) now prints before PIX{0,1} (1 available).
    # GPUs keep their minor order whatever their state (GPU1 is taken, GPU0 is not).
    assert labels_with_depth(text) == [
        *[line.replace("ROOT:6", "ROOT:3") for line in expected_start],
        "|   |   |---PIX",
        "|   |   |   |---GPU2",
        "|   |   |   |---GPU3",
        "|   |   |---PIX",
        "|   |   |   |---GPU0",
        "|   |   |   |---GPU1",
    ]
    assert "|   |---PHB (aval: 1, " in text
    assert "|   |   |---PIX (aval: 0, " in text


def test_equal_groups_ordered_by_lowest_index() -> None:
    levels = levels_from_groups(4, {Level.SINGLE: [[2, 3], [0, 1]]}, default=Level.HOSTBRIDGE)
    text = render_graph(tree_from_levels(levels))
    assert labels_with_depth(text)[2:] == [
        "|   |---PIX",
        "|   |   |---GPU0",
        "|   |   |---GPU1",
        "|   |---PIX",
        "|   |   |---GPU2",
        "|   |   |---GPU3",
    ]


def test_leaves_print_before_groups_at_the_same_depth() -> None:
    tree = tree_from_levels(levels_from_groups(3, {Level.SINGLE: [[1, 2]]}, default=Level.HOSTBRIDGE))
    assert labels_with_depth(render_graph(tree)) == [
        "ROOT:3",
        "|---PHB",
        "|   |---GPU0",
        "|   |---PIX",
        "|   |   |---GPU1",
        "|   |   |---GPU2",
    ]


def test_nvlink_groups_print_as_nvl() -> None:
    levels = levels_from_groups(
        8,
        {Level.MULTIPLE: [[0, 1], [2, 3], [4, 5], [6, 7]], Level.CPU: [[0, 1, 2, 3], [4, 5, 6, 7]]},
    )
    tree = tree_from_levels(levels, all_pairs(range(8)), memory_total=GIB)
    lines = render_graph(tree).splitlines()
    assert lines[0] == "ROOT:8"
    sys_line = "|---SYS (aval: 8, pids: [], usedMemory: 0, totalMemory: 8589934592, "
    assert lines[1] == sys_line + "allocatableCores: 0, allocatableMemory: 0)"
    assert lines[2].startswith("|   |---NVL (aval: 4, ")
    assert lines[7].startswith("|   |---NVL (aval: 4, ")
    assert lines[3] == (
        "|   |   |---GPU0 (pids: [], usedMemory: 0, totalMemory: 1073741824, "
        "allocatableCores: 100, allocatableMemory: 1073741824)"
    )


def test_render_shape() -> None:
    assert render_shape(upstream_six()) == "ROOT[CPU[PHB[PIX[0,1],PIX[2,3]],PIX[4,5]]]"
