"""The placement and answer made at GetPreferredAllocation serve the Allocate that follows only while they are
exactly what that Allocate would make (gpumanager/allocation/prepared.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import placement
from gpumanager.allocation import prepared as prepared_module
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.model import _compat32
from gpumanager.allocation.response import build_response
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.preferred import Preference
from tests.alloc_fixtures import MIB, FakePods, make_allocator, make_pod, uid_of

VCORE = names.VCORE_RESOURCE


def _node(count: int) -> tuple[list[GPUInfo], NodeTopology]:
    """``count`` GPUs of 32 GiB, the first half on NUMA node 0, the rest on node 1; pairs on one switch."""
    gpus = [
        GPUInfo(
            i, f"GPU-{i:04d}", "Tesla V100-PCIE-32GB", i, 32768 * MIB, f"00000000:{i + 16:02x}:00.0", i * 2 // count
        )
        for i in range(count)
    ]
    half = count // 2
    levels = tuple(
        tuple(0 if a == b else 10 if a // 2 == b // 2 else 30 if a // half == b // half else 50 for b in range(count))
        for a in range(count)
    )
    return gpus, NodeTopology(levels=levels)


def _allocator(
    tmp_path: Path, pods: FakePods, count: int = 4, share_problem: Callable[[], str] = lambda: ""
) -> tuple[Allocator, Preference, DeviceLayout]:
    node = _node(count)
    allocator = make_allocator(tmp_path, pods, node=node, share_problem=share_problem)
    layout = DeviceLayout(node[0])
    return allocator, Preference(allocator.clone_tree, layout, preview=allocator.preview), layout


class _Checked:
    """Wraps prepared.take: every prepared allocation and answer used is compared with what placing the
    container anew gives at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.used = 0
        self.asked = 0
        real = prepared_module.take

        def take(allocator: Allocator, candidate: Any, device_ids: Any) -> Any:
            self.asked += 1
            made = real(allocator, candidate, device_ids)
            if made is not None:
                self.used += 1
                # As the Allocate makes it: placed, then answered with a directory nobody else is answered with.
                fresh = allocator._with_free_answer(placement.decide(allocator, candidate, tuple(device_ids)))
                assert made[0] == fresh, f"prepared {made[0]}, placed anew {fresh}"
                answer = build_response(
                    fresh, allocator._gpus, allocator._settings.response, compat32=_compat32(candidate.pod, fresh)
                )
                assert made[1] == answer
            return made

        monkeypatch.setattr(prepared_module, "take", take)


def _free_ids(layout: DeviceLayout, count: int, used: set[str]) -> list[str]:
    return [i for g in range(count) for i in layout.ids_of_gpu(VCORE, g) if i not in used]


def test_a_prepared_answer_is_the_one_the_allocate_would_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random run of admissions (shares, whole GPUs, two GPUs, some steered to one NUMA node, some
    given other IDs than those preferred, some pods with a predicate annotation or an init container),
    pods ending, GPUs going unhealthy and back: wherever the prepared placement is used, it and its
    answer equal a placement made anew."""
    checked = _Checked(monkeypatch)
    rng = random.Random(12)
    count = 8
    pods = FakePods()
    allocator, preference, layout = _allocator(tmp_path, pods, count)
    used: set[str] = set()
    held: dict[str, set[str]] = {}
    for step in range(160):
        roll = rng.random()
        if roll < 0.15 and held:
            uid = rng.choice(sorted(held))
            pods.items = [p for p in pods.items if p["metadata"]["uid"] != uid]
            allocator.release_pod(uid)
            used -= held.pop(uid)
            continue
        if roll < 0.2:
            allocator.set_healthy(rng.randrange(count), rng.random() < 0.6)
        cores = rng.choice([1, 10, 25, 40, 60, 99, 100, 200])
        blocks = rng.randint(1, 40) if cores < 100 else 0
        annotations = {}
        if rng.random() < 0.1:
            annotations[f"{names.PREDICATE_GPU_IDX_PREFIX}0"] = str(rng.randrange(count))
        pod = make_pod(f"p{step}", [("c0", cores, blocks)], annotations=annotations)
        if rng.random() < 0.1:
            pod["spec"]["initContainers"] = [
                {"name": "init", "resources": {"limits": {VCORE: str(cores), names.VMEMORY_RESOURCE: str(blocks)}}}
            ]
        pods.items.append(pod)
        uid = pod["metadata"]["uid"]
        for container in ["init", "c0"] if "initContainers" in pod["spec"] else ["c0"]:
            available = _free_ids(layout, count, used)
            if rng.random() < 0.3:  # the Topology Manager's NUMA node
                node = rng.randrange(2)
                available = [i for i in available if int(i.rsplit("-", 1)[1]) // 100 * 2 // count == node]
            chosen = preference.choose(VCORE, available, [], cores)
            if rng.random() < 0.15:  # the kubelet gives other IDs than those preferred
                chosen = rng.sample(available, min(cores, len(available)))
            if len(chosen) < cores:
                break
            try:
                allocator.allocate(chosen)
            except Exception:
                break
            if allocator.get(uid, container) is not None:
                used |= set(chosen)
                held.setdefault(uid, set()).update(chosen)
    assert checked.used >= 40, f"the prepared placement was used {checked.used} times of {checked.asked}"
    assert checked.used < checked.asked, "no Allocate placed its container anew"


def test_a_gpu_gone_unhealthy_after_get_preferred_allocation_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = make_pod("p", [("c0", 50, 4)])
    pods = FakePods([pod])
    allocator, preference, layout = _allocator(tmp_path, pods)
    chosen = preference.choose(VCORE, _free_ids(layout, 4, set()), [], 50)
    gpu = int(chosen[0].rsplit("-", 1)[1]) // 100
    allocator.set_healthy(gpu, False)  # between GetPreferredAllocation and Allocate
    allocator.allocate(chosen)
    placed = allocator.get(pod["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors != (gpu,)


def test_ids_of_another_numa_node_place_the_container_anew(tmp_path: Path) -> None:
    pod = make_pod("p", [("c0", 50, 4)])
    pods = FakePods([pod])
    allocator, preference, layout = _allocator(tmp_path, pods)
    chosen = preference.choose(VCORE, _free_ids(layout, 4, set()), [], 50)
    assert {int(i.rsplit("-", 1)[1]) // 100 for i in chosen} == {0}
    given = layout.ids_of_gpu(VCORE, 3)[:50]  # the Topology Manager chose NUMA node 1
    allocator.allocate(given)
    placed = allocator.get(pod["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors in {(2,), (3,)}


def test_an_allocation_freed_in_between_places_the_container_anew(tmp_path: Path) -> None:
    """The preview chose the tightest fit beside another pod; that pod ends before the Allocate: the
    Allocate chooses again (another GPU is the tightest fit now)."""
    first = make_pod("first", [("c0", 30, 4)])
    second = make_pod("second", [("c0", 50, 4)], annotations={f"{names.PREDICATE_GPU_IDX_PREFIX}0": "1"})
    pods = FakePods([first, second])
    allocator, preference, layout = _allocator(tmp_path, pods)
    allocator.allocate(layout.ids_of_gpu(VCORE, 0)[:30])
    allocator.allocate(layout.ids_of_gpu(VCORE, 1)[:50])
    for pod in (first, second):  # started: their room is free once they end
        alloc = allocator.get(pod["metadata"]["uid"], "c0")
        assert alloc is not None
        allocator.mark_started(alloc)
    assert allocator.get(second["metadata"]["uid"], "c0").minors == (1,)  # type: ignore[union-attr]
    third = make_pod("third", [("c0", 40, 4)])
    pods.items.append(third)
    used = set(layout.ids_of_gpu(VCORE, 0)[:30]) | set(layout.ids_of_gpu(VCORE, 1)[:50])
    chosen = preference.choose(VCORE, _free_ids(layout, 4, used), [], 40)
    assert {int(i.rsplit("-", 1)[1]) // 100 for i in chosen} == {1}  # GPU 1: 50 left, the tightest
    pods.items.remove(second)
    allocator.release_pod(second["metadata"]["uid"])  # GPU 1 is free again: GPU 0 (70 left) is the tightest
    allocator.allocate(chosen)
    placed = allocator.get(third["metadata"]["uid"], "c0")
    assert placed is not None and placed.minors == (0,)


def test_a_share_is_refused_when_the_interceptor_is_lost_after_get_preferred_allocation(tmp_path: Path) -> None:
    problem = [""]
    pod = make_pod("p", [("c0", 50, 4)])
    allocator, preference, layout = _allocator(tmp_path, FakePods([pod]), share_problem=lambda: problem[0])
    chosen = preference.choose(VCORE, _free_ids(layout, 4, set()), [], 50)
    problem[0] = "the driver mirror is not built (disk full)"
    with pytest.raises(AllocationError, match="disk full"):
        allocator.allocate(chosen)
    assert allocator.get(pod["metadata"]["uid"], "c0") is None


def test_a_container_whose_directory_another_pod_took_over_uses_its_prepared_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Identical pods a and b: the kubelet gave the IDs matched to a to b (PreStartContainer), so b mounts a's
    directory. The next Allocate (a's) is answered with b's directory, and the answer prepared at its
    GetPreferredAllocation already names it: used as it is, equal to one made anew."""
    checked = _Checked(monkeypatch)
    pods = FakePods(
        [make_pod(n, [("main", 50, 4)], created=f"2026-11-21T10:00:0{i}Z") for i, n in enumerate(("a", "b"))]
    )
    allocator, preference, layout = _allocator(tmp_path, pods)
    first = preference.choose(VCORE, _free_ids(layout, 4, set()), [], 50)
    allocator.allocate(first)  # matched to a, the first in line
    allocator.pre_start(first, (uid_of("b"), "main"))  # the kubelet gave them to b
    second = preference.choose(VCORE, _free_ids(layout, 4, set(first)), [], 50)
    answer = allocator.allocate(second)
    assert checked.asked == 2 and checked.used == 2, f"prepared used {checked.used} times of {checked.asked}"
    mount = next(m.host_path for m in answer.mounts if m.container_path == names.VCUDA_MOUNTPOINT)
    assert mount == f"/etc/gpu-manager/vm/{uid_of('b')}", "b's own directory, which nobody mounts"
    held = allocator.get(uid_of("a"), "main")
    assert held is not None and held.answered == (uid_of("b"), "main")
    assert allocator.response_of(uid_of("a"), "main") == answer
