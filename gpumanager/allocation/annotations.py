"""The annotations gpu-manager writes on a pod once its containers have GPUs."""

from __future__ import annotations

from collections.abc import Sequence

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation


def ready_annotations(pod: Pod, allocations: Sequence[ContainerAllocation]) -> dict[str, str]:
    """``predicate-gpu-idx-<i>`` with the real GPU minors of each allocated container (init containers
    under their negative index, ``-1`` for the first, as the extender wrote them), and
    ``gpu-assigned=true`` once every GPU container of ``spec.containers`` has its GPUs.

    The init containers' indices are rewritten too: the kubelet may have given the pod the IDs matched to
    an identical pod (the records swapped at PreStartContainer), and the extender charges an init
    container on the GPU its annotation names. An init container with no record of its own whose answer
    another container of the pod holds (handed its IDs and its answer) is named on that record's GPUs."""
    by_name = {a.container: a for a in allocations}
    out: dict[str, str] = {}
    try:
        wanted = podinfo.gpu_containers(pod)
        every = podinfo.allocation_order(pod)
    except PodSpecError:
        return out
    # An init container's answer may be the record of another container now: its app container, handed
    # its IDs and given its answer (no room for a share of its own), took that record at its start.
    answered = {a.answered[1]: a for a in allocations if a.answered[1] != a.container}
    for request in every:
        alloc = by_name.get(request.name)
        if alloc is None and request.index < 0:
            alloc = answered.get(request.name)
        if alloc is not None:
            out[f"{names.PREDICATE_GPU_IDX_PREFIX}{request.index}"] = ",".join(str(m) for m in alloc.minors)
    if wanted and all(r.name in by_name for r in wanted):
        out[names.GPU_ASSIGNED] = "true"
    return out


def missing_annotations(pod: Pod, allocations: Sequence[ContainerAllocation]) -> dict[str, str]:
    """The ready annotations the pod does not carry yet (with these values)."""
    current = podinfo.pod_annotations(pod)
    return {k: v for k, v in ready_annotations(pod, allocations).items() if current.get(k) != v}
