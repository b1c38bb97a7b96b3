"""The annotations the agent writes once a pod's containers have their GPUs name every GPU container's
GPUs, init containers' too (``predicate-gpu-idx--1`` for the first): the extender named them, and the
kubelet may have given the pod the IDs matched to an identical pod (swapped at PreStartContainer), so
the extender's guess is not where they run."""

from __future__ import annotations

from typing import Any

from gpumanager import names
from gpumanager.allocation.annotations import missing_annotations, ready_annotations
from gpumanager.allocation.records import ContainerAllocation

PREFIX = names.PREDICATE_GPU_IDX_PREFIX
GIB = 1 << 30


def _pod(annotations: dict[str, str]) -> dict[str, Any]:
    limits = {names.VCORE_RESOURCE: "60", names.VMEMORY_RESOURCE: "8"}
    resources = {"limits": limits, "requests": limits}
    return {
        "metadata": {"name": "q", "namespace": "default", "uid": "uid-q", "annotations": annotations},
        "spec": {
            "initContainers": [{"name": "setup", "image": "cuda", "resources": resources}],
            "containers": [{"name": "c0", "image": "cuda", "resources": resources}],
        },
    }


def _alloc(container: str, index: int, minor: int) -> ContainerAllocation:
    return ContainerAllocation(
        pod_uid="uid-q", container=container, minors=(minor,), cores=60, memory=2 * GIB, container_index=index
    )


def test_the_ready_annotations_name_the_gpu_an_init_container_was_given() -> None:
    """The extender named GPU 1 for both containers; the pod was given GPU 3 (another pod's match)."""
    pod = _pod({f"{PREFIX}-1": "1", f"{PREFIX}0": "1", names.GPU_ASSIGNED: "false"})
    allocations = [_alloc("setup", -1, 3), _alloc("c0", 0, 3)]
    assert ready_annotations(pod, allocations) == {f"{PREFIX}-1": "3", f"{PREFIX}0": "3", names.GPU_ASSIGNED: "true"}
    assert missing_annotations(pod, allocations) == {
        f"{PREFIX}-1": "3",
        f"{PREFIX}0": "3",
        names.GPU_ASSIGNED: "true",
    }


def test_gpu_assigned_waits_for_the_init_containers_allocation_too() -> None:
    """Only the app container allocated (as after a restart that lost the init container's record): its
    GPU is named, the init container's annotation is left as the extender wrote it."""
    pod = _pod({f"{PREFIX}-1": "1", f"{PREFIX}0": "1"})
    assert ready_annotations(pod, [_alloc("c0", 0, 2)]) == {f"{PREFIX}0": "2", names.GPU_ASSIGNED: "true"}


def test_an_init_container_whose_record_went_to_its_app_container_is_named_on_that_records_gpus() -> None:
    """The kubelet admitted q before p (identical pods): p's init container was given the answer made for
    q's (GPU 3), and its app container, handed those IDs, the same answer; at the app container's start
    that one record is its (answered as q's init container). The init container ran on GPU 3 too: the
    annotation the extender wrote for it (GPU 1, where q's init container runs) is rewritten."""
    pod = _pod({f"{PREFIX}-1": "1", f"{PREFIX}0": "0"})
    record = ContainerAllocation(
        pod_uid="uid-q",
        container="c0",
        minors=(3,),
        cores=60,
        memory=2 * GIB,
        container_index=0,
        answered_as=("uid-p", "setup"),
    )
    assert missing_annotations(pod, [record]) == {f"{PREFIX}-1": "3", f"{PREFIX}0": "3", names.GPU_ASSIGNED: "true"}
