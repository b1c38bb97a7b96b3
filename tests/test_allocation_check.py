"""The allocation check's pod-event listener: what a deleted pod frees, and what it looks at to do so."""

from __future__ import annotations

from typing import Any

import pytest

from gpumanager.allocation.allocator import Allocator
from gpumanager.allocation.check import AllocationCheck
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def collecting_check(
    allocator: Allocator, pods: FakePods, collected: list[tuple[set[str], set[str] | None]]
) -> AllocationCheck:
    """A check whose directory collections are recorded in ``collected`` as (active, only)."""
    return AllocationCheck(
        allocator,
        pods,
        period=60.0,
        annotate=lambda uid: None,
        delete_failed=lambda pod: None,
        collect_dirs=lambda active, only=None: collected.append((set(active), only)),
        wait_synced=lambda timeout: True,
    )


def test_a_deleted_pod_collects_its_own_directories_without_a_pass_over_every_pod(tmp_path: Any) -> None:
    """The kubelet gave b the IDs answered to a and a those answered to b (swapped at PreStartContainer):
    each container reads the other pod's directory. b's deletion may free both directories, and keeps
    both while a runs; a's then frees both. Fifty deletions at once each made a pass over every pod."""
    a = make_pod("a", [("main", 25, 2)])
    b = make_pod("b", [("main", 25, 2)], created="2026-11-21T10:00:01Z")
    idle = make_pod("idle", [("main", 10, 1)], created="2026-11-21T10:00:02Z")
    pods = FakePods([a, b, idle])
    allocator = make_allocator(tmp_path, pods)
    first, second = core_ids(2, 25), core_ids(2, 25, start=25)
    allocator.allocate(first)
    allocator.allocate(second)
    allocator.pre_start(first, (uid_of("b"), "main"))  # the kubelet gave b the IDs answered to a
    collected: list[tuple[set[str], set[str] | None]] = []
    check = collecting_check(allocator, pods, collected)
    pods.items.remove(b)
    lists = pods.lists
    check.on_pod_event("DELETED", b)
    assert allocator.allocations_of(uid_of("b")) == []
    assert len(collected) == 1
    active, only = collected[0]
    assert only == {uid_of("a"), uid_of("b")}
    assert active & only == {uid_of("a"), uid_of("b")}, "a runs, and its container reads b's directory"
    pods.items.remove(a)
    check.on_pod_event("DELETED", a)
    active, only = collected[1]
    assert only == {uid_of("a"), uid_of("b")} and not active & only
    assert pods.lists == lists, "a deletion listed every pod"
    # The periodic check still looks at every pod.
    assert check.active_pod_dirs() == {uid_of("idle")} | {x.pod_uid for x in allocator.allocations()}
    assert pods.lists == lists + 1


@pytest.mark.parametrize(("cores", "collects"), [(25, True), (0, False)], ids=["gpu-pod", "no-gpu"])
def test_a_pod_deleted_without_ever_getting_a_gpu_has_its_directory_collected(
    tmp_path: Any, cores: int, collects: bool
) -> None:
    """Made ahead of its start (gpumanager.vmanager.ahead), the directory of a pod the kubelet never
    admitted goes with the pod, not at the next periodic check; a pod that never asked for a GPU
    costs no look at the directories."""
    a = make_pod("a", [("main", cores, 2 if cores else 0)])
    pods = FakePods([a])
    collected: list[tuple[set[str], set[str] | None]] = []
    check = collecting_check(make_allocator(tmp_path, pods), pods, collected)
    pods.items.remove(a)
    check.on_pod_event("DELETED", a)
    assert collected == ([(set(), {uid_of("a")})] if collects else [])
