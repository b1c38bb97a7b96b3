"""GetPreferredAllocation steers the kubelet towards the GPUs the evaluators would pick."""

from __future__ import annotations

import logging
import random

import pytest

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.preferred import Preference
from gpumanager.topology import build_tree

MIB = 1 << 20
CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


def v100x4() -> tuple[Preference, DeviceLayout]:
    gpus = [GPUInfo(i, f"GPU-{i}", "Tesla V100", i, 1024 * MIB, f"00000000:{i + 16:02x}:00.0", 0) for i in range(4)]
    # PIX pairs (0,1) and (2,3) under one PHB.
    levels = tuple(tuple(0 if a == b else 10 if a // 2 == b // 2 else 30 for b in range(4)) for a in range(4))
    tree = build_tree(gpus, NodeTopology(levels=levels))
    layout = DeviceLayout(gpus)
    return Preference(tree.clone, layout), layout


def all_ids(layout: DeviceLayout, resource: str, gpus: range | list[int]) -> list[str]:
    return [i for g in gpus for i in layout.ids_of_gpu(resource, g)]


def gpus_of(layout: DeviceLayout, resource: str, ids: list[str]) -> set[int]:
    return {layout.gpu_of(resource, i) for i in ids}


def test_two_whole_gpus_go_to_a_pix_pair() -> None:
    pref, layout = v100x4()
    chosen = pref.choose(CORE, all_ids(layout, CORE, range(4)), [], 200)
    assert len(chosen) == 200 and len(set(chosen)) == 200
    assert gpus_of(layout, CORE, chosen) == {0, 1}


def test_partly_used_gpu_is_not_offered_for_whole_gpus() -> None:
    pref, layout = v100x4()
    available = all_ids(layout, CORE, range(4))[10:]  # GPU 0 has 10 core IDs in use
    chosen = pref.choose(CORE, available, [], 200)
    assert gpus_of(layout, CORE, chosen) == {2, 3}


def test_share_goes_to_tightest_fit() -> None:
    pref, layout = v100x4()
    ids = all_ids(layout, CORE, range(4))
    available = ids[:100] + ids[150:]  # GPU 1 has 50 free cores, the others 100
    chosen = pref.choose(CORE, available, [], 30)
    assert gpus_of(layout, CORE, chosen) == {1}
    assert len(chosen) == 30


def test_must_include_is_kept_first() -> None:
    pref, layout = v100x4()
    ids = all_ids(layout, CORE, range(4))
    must = [ids[250]]
    chosen = pref.choose(CORE, ids, must, 20)
    assert chosen[0] == ids[250]
    assert gpus_of(layout, CORE, chosen) == {2}


def test_memory_best_fit_single_gpu() -> None:
    pref, layout = v100x4()
    ids = all_ids(layout, MEM, range(4))  # 4 blocks per GPU
    available = ids[:4] + ids[6:]  # GPU 1 has 2 free blocks
    assert gpus_of(layout, MEM, pref.choose(MEM, available, [], 2)) == {1}
    assert gpus_of(layout, MEM, pref.choose(MEM, available, [], 3)) == {0}


def test_unknown_ids_are_skipped_not_fatal() -> None:
    pref, layout = v100x4()
    chosen = pref.choose(CORE, ["bogus", *all_ids(layout, CORE, [3])], [], 100)
    assert gpus_of(layout, CORE, chosen) == {3}


def test_unknown_ids_are_logged_in_one_line_per_call(caplog: pytest.LogCaptureFixture) -> None:
    pref, layout = v100x4()
    bogus = [f"bogus-{i}" for i in range(500)]
    with caplog.at_level(logging.WARNING, logger="gpumanager.deviceplugin.preferred"):
        pref.choose(CORE, [*bogus, *all_ids(layout, CORE, [3])], [], 100)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines[:3]
    assert "500" in lines[0] and "bogus-0" in lines[0] and "bogus-499" not in lines[0]


def test_same_state_same_answer() -> None:
    pref, layout = v100x4()
    ids = all_ids(layout, CORE, range(4))
    assert pref.choose(CORE, ids, [], 100) == pref.choose(CORE, list(reversed(ids)), [], 100)


def test_ids_are_taken_lowest_number_first_however_offered() -> None:
    pref, layout = v100x4()
    ids = layout.ids_of_gpu(CORE, 0)  # numbers 0..99: "...-10" sorts before "...-9" as text
    shuffled = ids[::7] + [i for i in ids if i not in ids[::7]][::-1]
    assert pref.choose(CORE, shuffled, [], 20) == ids[:20]
    mem = layout.ids_of_gpu(MEM, 2)
    assert pref.choose(MEM, mem[::-1], [], 3) == mem[:3]


def test_ids_of_the_other_resource_are_skipped() -> None:
    pref, layout = v100x4()
    offered = all_ids(layout, MEM, range(4)) + all_ids(layout, CORE, [1])
    chosen = pref.choose(CORE, offered, [], 100)
    assert chosen == layout.ids_of_gpu(CORE, 1)


def test_positions_agree_with_gpu_of() -> None:
    _, layout = v100x4()
    for resource in (CORE, MEM):
        positions = layout.positions(resource)
        assert len(positions) == layout.count(resource)
        for device_id, (gpu, number) in positions.items():
            assert layout.gpu_of(resource, device_id) == gpu and device_id.endswith(f"-{number}")


def test_ids_spelt_otherwise_are_ordered_by_number_with_the_others() -> None:
    pref, layout = v100x4()
    ids = layout.ids_of_gpu(CORE, 0)[:12]
    padded = [f"{CORE}-00{n}" for n in (3, 5)]  # the node's GPU 0, numbers 3 and 5, spelt with zeros
    offered = [i for i in ids if not i.endswith(("-3", "-5"))][::-1] + padded
    assert pref.choose(CORE, offered, [], 6) == [ids[0], ids[1], ids[2], padded[0], ids[4], padded[1]]


def test_a_request_no_gpu_holds_takes_the_lowest_ids_of_each_gpu_it_spans() -> None:
    pref, layout = v100x4()
    one, two = layout.ids_of_gpu(MEM, 1)[1:4], layout.ids_of_gpu(MEM, 2)  # 3 and 4 blocks free
    offered = [two[2], one[1], two[0], one[2], two[3], one[0], two[1]]
    assert pref.choose(MEM, offered, [], 6) == [*two, *one[:2]]


def test_a_share_goes_to_the_tightest_fit_when_the_allocators_tree_holds_the_other_shares(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scratch tree is a copy of the allocator's, whose GPUs already carry their shares: the IDs
    the kubelet offers must not be subtracted a second time (that emptied every shared GPU)."""
    gpus = [GPUInfo(i, f"GPU-{i}", "Tesla V100", i, 1024 * MIB, f"00000000:{i + 16:02x}:00.0", 0) for i in range(4)]
    levels = tuple(tuple(0 if a == b else 10 if a // 2 == b // 2 else 30 for b in range(4)) for a in range(4))
    tree = build_tree(gpus, NodeTopology(levels=levels))
    tree.occupy(1, 50, 512 * MIB)  # running shares on GPU 1: its other 50 core IDs are free
    tree.occupy(2, 90, 512 * MIB)  # and on GPU 2: 10 free, too few for 30
    layout = DeviceLayout(gpus)
    pref = Preference(tree.clone, layout)
    ids = all_ids(layout, CORE, range(4))
    available = ids[:100] + ids[150:200] + ids[290:]
    with caplog.at_level(logging.WARNING):
        chosen = pref.choose(CORE, available, [], 30)
    assert gpus_of(layout, CORE, chosen) == {1}
    assert len(chosen) == 30
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


@pytest.mark.parametrize("resource", [CORE, MEM])
def test_counting_against_each_gpus_own_ids_chooses_as_looking_up_each_id_does(resource: str) -> None:
    """The kubelet offers thousands of IDs a call: they are counted per GPU against each GPU's set of IDs.
    That must choose what looking each ID up by itself (the way for IDs not spelt as ours) chooses."""
    pref, layout = v100x4()
    every = all_ids(layout, resource, range(4))
    rng = random.Random(7)
    for _ in range(300):
        available = [i for i in every if rng.random() < rng.choice((0.2, 0.6, 0.95))]
        rng.shuffle(available)
        must = rng.sample(available, rng.choice((0, 0, 1, 2))) if available else []
        size = rng.choice((1, 2, 3, 5, 50, 100, 150, 200)) if resource == CORE else rng.choice((1, 2, 3, 4, 7))
        fast = pref.choose(resource, available, must, size)
        chosen = list(dict.fromkeys(must))[:size]
        rest = [i for i in available if i not in set(chosen)]
        each = pref._choose_each(resource, chosen, rest, size - len(chosen)) if len(chosen) < size else chosen
        assert fast == each, (available, must, size)
        assert len(set(fast)) == len(fast)
