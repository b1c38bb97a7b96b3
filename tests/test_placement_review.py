"""GetPreferredAllocation names the GPU(s) the next Allocate of that size places on.

The kubelet records the IDs GetPreferredAllocation names as the container's; each ID belongs to one
GPU (its health, its NUMA node). When the preference names one GPU and Allocate then places the
container on another, the kubelet's view of which GPU a container holds is wrong: a GPU going
unhealthy is reported on the wrong containers, and the topology manager aligns CPUs to the wrong
NUMA node.
"""

from __future__ import annotations

from pathlib import Path

from gpumanager import names
from gpumanager.allocation.allocator import Allocator
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.preferred import Preference
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, v100x4

VCORE = names.VCORE_RESOURCE


def _preference(alloc: Allocator) -> tuple[Preference, DeviceLayout]:
    gpus, _ = v100x4()
    layout = DeviceLayout(gpus)
    return Preference(alloc.clone_tree, layout, preview=alloc.preview), layout


def _free_core_ids(alloc: Allocator, layout: DeviceLayout, used: set[str]) -> list[str]:
    """Every vcuda-core ID the kubelet still counts free (it counts the IDs it handed out)."""
    return [i for g in range(4) for i in layout.ids_of_gpu(VCORE, g) if i not in used]


def _gpus_of(layout: DeviceLayout, ids: list[str]) -> set[int]:
    return set(layout.group_by_gpu(VCORE, ids))


def test_preferred_share_goes_where_its_memory_fits(tmp_path: Path) -> None:
    # GPU 0 keeps 60 cores but only 2 GiB after the first pod; the second pod's 4 GiB does not fit there.
    first = make_pod("first", [("c0", 40, 120)], created="2026-11-21T10:00:00Z")
    pods = FakePods([first])
    alloc = make_allocator(tmp_path, pods)
    ids_first = core_ids(0, 40)
    assert alloc.allocate(ids_first) is not None
    assert alloc.get(first["metadata"]["uid"], "c0").minors == (0,)  # type: ignore[union-attr]

    second = make_pod("second", [("c0", 50, 16)], created="2026-11-21T10:01:00Z")
    pods.items.append(second)
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set(ids_first)), [], 50)
    assert len(chosen) == 50
    alloc.allocate(chosen)
    placed = alloc.get(second["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors == (1,)
    assert _gpus_of(layout, chosen) == {1}, f"preferred IDs of GPUs {_gpus_of(layout, chosen)}, placed on GPU 1"


def test_preferred_share_follows_the_predicate_annotation(tmp_path: Path) -> None:
    pod = make_pod("pred", [("c0", 50, 4)], annotations={f"{names.PREDICATE_GPU_IDX_PREFIX}0": "3"})
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set()), [], 50)
    alloc.allocate(chosen)
    placed = alloc.get(pod["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors == (3,)
    assert _gpus_of(layout, chosen) == {3}


def test_preferred_whole_gpus_follow_the_predicate_annotation(tmp_path: Path) -> None:
    pod = make_pod("pred2", [("c0", 200, 0)], annotations={f"{names.PREDICATE_GPU_IDX_PREFIX}0": "2,3"})
    pods = FakePods([pod])
    alloc = make_allocator(tmp_path, pods)
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set()), [], 200)
    alloc.allocate(chosen)
    placed = alloc.get(pod["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors == (2, 3)
    assert _gpus_of(layout, chosen) == {2, 3}


def test_preferred_falls_back_to_the_evaluators_without_a_waiting_pod(tmp_path: Path) -> None:
    # No pending pod asks for 50 cores: the tightest GPU by cores, as before.
    alloc = make_allocator(tmp_path, FakePods([]))
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set()), [], 50)
    assert _gpus_of(layout, chosen) == {0}
    assert alloc.allocations() == []


def test_preferred_ignores_a_preview_the_kubelet_has_no_ids_for(tmp_path: Path) -> None:
    # The kubelet's free IDs of GPU 3 are fewer than asked (its view lags ours): the preference does not
    # name IDs it was not offered, and still answers from GPUs it was offered.
    pod = make_pod("pred3", [("c0", 50, 4)], annotations={f"{names.PREDICATE_GPU_IDX_PREFIX}0": "3"})
    alloc = make_allocator(tmp_path, FakePods([pod]))
    pref, layout = _preference(alloc)
    offered = [i for i in _free_core_ids(alloc, layout, set()) if i not in set(core_ids(3, 80))]
    chosen = pref.choose(VCORE, offered, [], 50)
    assert len(chosen) == 50 and set(chosen) <= set(offered)
    assert 3 not in _gpus_of(layout, chosen)


def test_preferred_follows_a_pod_the_cache_has_not_seen_yet(tmp_path: Path) -> None:
    # The kubelet admits the pod as soon as its own watch shows it; ours may lag behind (a loaded node, a
    # slow API server). The preference asks the API server then, as Allocate does, instead of steering the
    # kubelet to the GPU the evaluators would pick for an unknown pod.
    pod = make_pod("lagged", [("c0", 50, 4)], annotations={f"{names.PREDICATE_GPU_IDX_PREFIX}0": "2"})
    pods = FakePods([])
    pods.hidden.append(pod)
    pods.refresh_fills_cache = False  # as the real cache: a list does not change it, its watch does
    alloc = make_allocator(tmp_path, pods)
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set()), [], 50)
    assert pods.refreshes == 1
    assert _gpus_of(layout, chosen) == {2}
    alloc.allocate(chosen)
    placed = alloc.get(pod["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors == (2,)


def test_preferred_without_a_waiting_pod_when_the_api_server_cannot_be_asked(tmp_path: Path) -> None:
    # No pod waits in the cache and the list fails: the evaluators' answer, the failure not passed on.
    pods = FakePods([])
    pods.refresh_error = TimeoutError("the API server did not answer a pod list within 3 s")
    alloc = make_allocator(tmp_path, pods)
    pref, layout = _preference(alloc)
    chosen = pref.choose(VCORE, _free_core_ids(alloc, layout, set()), [], 50)
    assert pods.refreshes == 1
    assert _gpus_of(layout, chosen) == {0}
