"""The link, fragment and share evaluators and the dispatcher."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpumanager.topology import MEMORY_BLOCK, Level, TopologyTree, choose, fragment, link, share
from gpumanager.topology.synthetic import DEFAULT_MEMORY, all_pairs, levels_from_groups, tree_from_levels

GIB = 1024**3
MIB = 1024**2


def upstream_six() -> TopologyTree:
    """Upstream's test node: PIX{0,1},{2,3},{4,5}, PHB{0-3}, SOC (CPU level) between all."""
    levels = levels_from_groups(
        6,
        {Level.SINGLE: [[0, 1], [2, 3], [4, 5]], Level.HOSTBRIDGE: [[0, 1, 2, 3]]},
        default=Level.CPU,
    )
    return tree_from_levels(levels)


def h100x8() -> TopologyTree:
    levels = levels_from_groups(
        8,
        {Level.MULTIPLE: [[0, 1], [2, 3], [4, 5], [6, 7]], Level.CPU: [[0, 1, 2, 3], [4, 5, 6, 7]]},
    )
    return tree_from_levels(levels, all_pairs(range(8)), memory_total=80 * GIB)


def single() -> TopologyTree:
    return tree_from_levels(((0,),))


# -- upstream vectors --------------------------------------------------------------------------


def test_link_upstream_vector() -> None:
    tree = upstream_six()
    # 3 GPUs: the PHB group is the tightest level with 3 free GPUs.
    assert link(tree, 300) == [0, 1, 2]
    tree.occupy(2, 100, 0)
    # PIX{0,1} and PIX{4,5} tie on every upstream key; the lower index wins.
    assert link(tree, 200) == [0, 1]


def test_fragment_upstream_vector() -> None:
    # Upstream calls its fragment evaluator directly with 200 cores; it then asks for
    # cores // 100 = 2 GPUs and descends only into groups with at least 2 available.
    # We keep that meaning: fragment(tree, n * 100) picks n GPUs from the most used
    # subtree (the dispatcher itself only calls it with 100).
    tree = upstream_six()
    # Under the CPU group, PIX{4,5} (2 available) sorts before PHB{0-3} (4 available).
    assert fragment(tree, 200) == [4, 5]
    tree.occupy(4, 100, 0)
    # PIX{4,5} now has 1 available GPU, the fewest: the lone GPU 5 is used up first.
    assert fragment(tree, 100) == [5]
    assert fragment(single(), 100) == [0]


def test_share_upstream_vector() -> None:
    tree = upstream_six()
    assert share(tree, 50, GIB) == [0]
    tree.occupy(0, 50, GIB)
    assert share(tree, 60, GIB) == [1]


# -- link --------------------------------------------------------------------------------------


def test_link_prefers_nvlink_pair_under_one_host_bridge() -> None:
    tree = tree_from_levels(levels_from_groups(4, {}, default=Level.HOSTBRIDGE), [(0, 2), (1, 3)])
    assert link(tree, 200) == [0, 2]
    tree.occupy(0, 100, 0)
    assert link(tree, 200) == [1, 3]
    tree.occupy(1, 100, 0)
    # No NVLink pair left whole: the host bridge group hosts the request.
    assert link(tree, 200) == [2, 3]


def test_link_h100x8() -> None:
    tree = h100x8()
    assert link(tree, 400) == [0, 1, 2, 3]
    assert link(tree, 800) == list(range(8))
    tree.occupy(0, 100, 0)
    # Both NVLink groups can host 2 GPUs; the one with fewer available GPUs (3 < 4) is the
    # best fit, so the first two free GPUs of socket 0 are chosen and socket 1 stays whole.
    assert link(tree, 200) == [1, 2]
    # 4 GPUs no longer fit in socket 0: socket 1's NVLink group takes them.
    assert link(tree, 400) == [4, 5, 6, 7]
    # 5 GPUs need the SYS group; its first available GPUs are returned.
    assert link(tree, 500) == [1, 2, 3, 4, 5]


def test_link_across_sockets_when_nvlink_crosses_them() -> None:
    # NVLink between sockets does not pull 3 and 4 together: a 2-GPU request stays in a socket.
    levels = levels_from_groups(8, {Level.CPU: [[0, 1, 2, 3], [4, 5, 6, 7]]})
    tree = tree_from_levels(levels, [(3, 4)])
    for index in (0, 1, 2):
        tree.occupy(index, 100, 0)
    assert link(tree, 200) == [4, 5]


def test_link_ties_break_on_lowest_index() -> None:
    tree = upstream_six()
    assert link(tree, 200) == [0, 1]
    tree.occupy(0, 100, 0)
    # Remaining PIX pairs {2,3} and {4,5} tie: the lower one.
    assert link(tree, 200) == [2, 3]


def test_link_uses_process_count_key() -> None:
    tree = upstream_six()
    tree.update_usage(0, [4242], GIB)
    # PIX{0,1} has a process; PIX{2,3} and PIX{4,5} have none and tie: lower index.
    assert link(tree, 200) == [2, 3]


def test_link_returns_nothing_when_too_few_gpus() -> None:
    tree = upstream_six()
    assert link(tree, 700) == []
    tree.occupy(5, 10, GIB)
    assert link(tree, 600) == []
    assert link(tree, 500) == [0, 1, 2, 3, 4]


def test_link_falls_back_to_root_for_unrelated_gpus() -> None:
    tree = tree_from_levels(((0, Level.UNKNOWN), (Level.UNKNOWN, 0)))
    assert link(tree, 200) == [0, 1]


def test_link_single_gpu() -> None:
    assert link(single(), 200) == []
    assert link(single(), 100) == [0]


def test_link_never_uses_shared_gpu() -> None:
    tree = upstream_six()
    tree.occupy(1, 10, GIB)
    # GPU 1 is partly used: PIX{0,1} cannot host 2; PIX{2,3} can.
    assert link(tree, 200) == [2, 3]


# -- fragment ----------------------------------------------------------------------------------


def test_fragment_fills_the_most_used_group_first() -> None:
    tree = upstream_six()
    picks = []
    for _ in range(6):
        [index] = fragment(tree)
        picks.append(index)
        tree.occupy(index, 100, 0)
    # PIX{4,5} first (smallest group), then PIX{0,1} / PIX{2,3} pairwise.
    assert picks == [4, 5, 0, 1, 2, 3]
    assert fragment(tree) == []


def test_fragment_h100x8_keeps_the_other_socket_free() -> None:
    tree = h100x8()
    tree.occupy(5, 100, 0)
    # Socket 1 has 3 available, socket 0 has 4: fill socket 1.
    assert fragment(tree) == [4]


def test_fragment_ties_break_on_lowest_index() -> None:
    tree = upstream_six()
    tree.occupy(4, 100, 0)
    tree.occupy(5, 100, 0)
    # PIX{0,1} and PIX{2,3} tie: the lower one, lowest GPU.
    assert fragment(tree) == [0]


# -- share -------------------------------------------------------------------------------------


def test_two_half_shares_fill_a_gpu() -> None:
    tree = upstream_six()
    first = share(tree, 50, GIB)
    tree.occupy(first[0], 50, GIB)
    second = share(tree, 50, GIB)
    assert first == second == [0]
    tree.occupy(second[0], 50, GIB)
    assert tree.leaf(0).allocatable_cores == 0
    assert share(tree, 50, GIB) == [1]


def test_share_best_fit_on_cores() -> None:
    tree = upstream_six()
    tree.occupy(3, 70, GIB)
    assert share(tree, 20, GIB) == [3]
    assert share(tree, 40, GIB) == [0]


def test_share_respects_memory() -> None:
    tree = upstream_six()
    tree.occupy(0, 10, DEFAULT_MEMORY - GIB)
    assert share(tree, 10, 2 * GIB) == [1]
    assert share(tree, 10, GIB) == [0]
    assert share(tree, 10, DEFAULT_MEMORY + 1) == []


def test_share_compares_memory_in_256_mib_blocks() -> None:
    # Both GPUs end in the same 256 MiB block, so memory ties and the index decides,
    # although GPU 1 has less memory left in bytes.
    tree = tree_from_levels(levels_from_groups(2, {Level.SINGLE: [[0, 1]]}), memory_total=16 * GIB + 128 * MIB)
    tree.occupy(0, 10, 0)
    tree.occupy(1, 10, 64 * MIB)
    assert tree.leaf(0).allocatable_memory // MEMORY_BLOCK == tree.leaf(1).allocatable_memory // MEMORY_BLOCK
    assert share(tree, 10, GIB) == [0]
    # A whole block less does count.
    tree.occupy(1, 0, 256 * MIB)
    assert share(tree, 10, GIB) == [1]


def test_share_skips_exclusively_used_gpu() -> None:
    tree = upstream_six()
    tree.occupy(0, 100, 0)
    assert share(tree, 10, GIB) == [1]


def test_share_uses_process_count_key() -> None:
    tree = upstream_six()
    tree.update_usage(0, [1, 2], GIB)
    tree.update_usage(1, [3], GIB)
    assert share(tree, 10, GIB) == [2]


# -- health ------------------------------------------------------------------------------------


EVALUATORS: list[tuple[str, Callable[[TopologyTree], list[int]]]] = [
    ("link", lambda tree: link(tree, 200)),
    ("fragment", lambda tree: fragment(tree)),
    ("share", lambda tree: share(tree, 50, GIB)),
]


@pytest.mark.parametrize(("name", "evaluate"), EVALUATORS, ids=[name for name, _ in EVALUATORS])
def test_unhealthy_gpu_is_never_chosen(name: str, evaluate: Callable[[TopologyTree], list[int]]) -> None:
    tree = tree_from_levels(levels_from_groups(2, {Level.SINGLE: [[0, 1]]}))
    healthy_answer = evaluate(tree)
    assert healthy_answer and healthy_answer[0] == 0
    tree.set_healthy(0, False)
    assert 0 not in evaluate(tree)
    tree.set_healthy(1, False)
    assert evaluate(tree) == []
    tree.set_healthy(0, True)
    tree.set_healthy(1, True)
    assert evaluate(tree) == healthy_answer


def test_unhealthy_gpu_is_skipped_on_larger_node() -> None:
    tree = upstream_six()
    tree.set_healthy(0, False)
    assert link(tree, 200) == [2, 3]
    assert link(tree, 300) == [1, 2, 3]
    # Under the CPU group PIX{4,5} (2 available) still sorts before PHB (3 available).
    assert fragment(tree) == [4]
    tree.occupy(4, 100, 0)
    tree.occupy(5, 100, 0)
    # Inside PHB, PIX{0,1} has 1 available, the fewest: GPU 1, never the unhealthy GPU 0.
    assert fragment(tree) == [1]
    assert share(tree, 50, GIB) == [1]
    tree.set_healthy(0, True)
    assert link(tree, 200) == [0, 1]


# -- determinism -------------------------------------------------------------------------------


def test_same_state_same_answer() -> None:
    tree = h100x8()
    tree.occupy(6, 30, GIB)
    tree.occupy(2, 100, 0)
    answers = set()
    for _ in range(20):
        answers.add((tuple(choose(tree, 200, 0)), tuple(choose(tree, 100, 0)), tuple(choose(tree, 30, GIB))))
    # Both NVLink groups have 3 available GPUs ({0,1,3} and {4,5,7}): the lower group wins
    # the tie for link and fragment; GPU 6 (70 cores left) is the tightest share fit.
    assert answers == {((0, 1), (0,), (6,))}
    # The evaluators do not change the tree.
    assert tree.available_indices() == [0, 1, 3, 4, 5, 7]


# -- dispatcher --------------------------------------------------------------------------------


def test_choose_dispatches_by_cores() -> None:
    tree = upstream_six()
    assert choose(tree, 300, 0) == link(tree, 300) == [0, 1, 2]
    assert choose(tree, 100, 0) == fragment(tree) == [4]
    assert choose(tree, 50, GIB) == share(tree, 50, GIB) == [0]


@pytest.mark.parametrize(
    ("cores", "memory", "message"),
    [
        (0, 0, "cores must be positive"),
        (-100, 0, "cores must be positive"),
        (150, 0, "must be multiple of 100: 150"),
        (50, -1, "memory"),
        (2.0, 0, "int"),
    ],
)
def test_choose_rejects_bad_requests(cores: object, memory: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose(upstream_six(), cores, memory)  # type: ignore[arg-type]


@pytest.mark.parametrize("cores", [0, 50, 150, -200])
def test_whole_gpu_evaluators_reject_fractions(cores: int) -> None:
    tree = upstream_six()
    with pytest.raises(ValueError, match="multiple of 100"):
        link(tree, cores)
    with pytest.raises(ValueError, match="multiple of 100"):
        fragment(tree, cores)


@pytest.mark.parametrize("cores", [0, 100, 101, -5])
def test_share_rejects_whole_gpus(cores: int) -> None:
    with pytest.raises(ValueError, match="between 1 and 99"):
        share(upstream_six(), cores, GIB)
