"""The answer made at GetPreferredAllocation for the Allocate that follows it.

The kubelet asks GetPreferredAllocation for a container just before that container's Allocate, and the
preview that steers its IDs places the container as the Allocate would. That placement and its answer are
kept, and the Allocate uses them (instead of placing the container again) when nothing they depend on has
changed in between:

- the same container of the same pod object, asking as much (the pod cache and a list from the API server
  make a new object for each version of a pod, and nothing changes one in place);
- no allocation made or freed since (the allocator's generation), and the topology tree in the same state
  (allocations, health, the processes counted on each GPU: its version);
- the answers' node-wide settings unchanged;
- every ID given on a GPU the container was placed on: IDs of other GPUs (another NUMA node's) make the
  Allocate place it again.

The answer names the directory the Allocate would answer with: the container's own, or, where a container of
another pod took that over (the kubelet gave it the IDs first matched to this one), the free one
:meth:`Allocator.free_answer` names. Who is answered with which directory changes only with an allocation
made or freed, so the generation covers it.

Nothing is kept where the choice depends on the IDs themselves: while the room of allocations freed before
their containers started is held (IDs given from it free it), or while the pod holds GPUs already (an init
container lends its room only to a container given some of its IDs). Of the checks that do not depend on the
placement, the one whose outcome can change meanwhile (a share needs the interceptor's driver mirror) is made
again at the Allocate.

Called with the allocator's lock held.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation import ids, placement
from gpumanager.allocation.model import Candidate, _compat32
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, ResponseSettings, build_response

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator


@dataclass(frozen=True)
class Prepared:
    """A container's placement and answer, and what they were made from."""

    generation: int
    tree_version: int
    settings: ResponseSettings
    pod: Pod
    container: str
    cores: int
    memory: int
    #: The allocation as the preview placed it (no device IDs yet).
    decided: ContainerAllocation
    #: NVML indices of its GPUs (a vcuda-core ID's number over 100).
    gpus: frozenset[int]
    response: ContainerResponse


def prepare(allocator: Allocator, candidate: Candidate, decided: ContainerAllocation) -> Prepared | None:
    """What the preview's placement ``decided`` of ``candidate`` leaves for its Allocate; None where the
    Allocate's choice would depend on its IDs."""
    if allocator._freed_guesses or allocator._by_pod.get(decided.pod_uid):
        return None
    try:
        gpus = frozenset(allocator._tree.leaf_by_minor(m).index for m in decided.minors)
    except ValueError:
        return None
    answered = allocator.free_answer(decided)
    if answered != decided.answered:  # its own directory was taken over by another pod's container (a swap)
        decided = replace(decided, answered_as=answered)
    settings = allocator._settings.response
    response = build_response(decided, allocator._gpus, settings, compat32=_compat32(candidate.pod, decided))
    return Prepared(
        generation=allocator._generation,
        tree_version=allocator._tree.version,
        settings=settings,
        pod=candidate.pod,
        container=candidate.request.name,
        cores=candidate.request.cores,
        memory=candidate.request.memory_bytes,
        decided=decided,
        gpus=gpus,
        response=response,
    )


def take(
    allocator: Allocator, candidate: Candidate, device_ids: Sequence[str]
) -> tuple[ContainerAllocation, ContainerResponse] | None:
    """The allocation of ``candidate`` with ``device_ids`` and its answer, as prepared, when they still
    hold (see the module's docstring); None otherwise. What was prepared serves one Allocate at most.
    Raises AllocationError as placing the container would, for the checks made again."""
    kept, allocator._prepared = allocator._prepared, None
    if kept is None:
        return None
    request = candidate.request
    if (
        kept.pod is not candidate.pod
        or kept.container != request.name
        or kept.cores != request.cores
        or kept.memory != request.memory_bytes
        or kept.generation != allocator._generation
        or kept.tree_version != allocator._tree.version
        or kept.settings is not allocator._settings.response
        or allocator._freed_guesses
    ):
        return None
    cut = len(names.VCORE_ID_PREFIX)
    for device_id in device_ids:
        number = ids.tail_number(device_id[cut:])
        if number is None or number // names.HUNDRED_CORES not in kept.gpus:
            return None
    if request.cores < names.HUNDRED_CORES and allocator._share_problem():
        # The one check of the preview's that can fail since (the interceptor's mirror broke): its refusal.
        placement.checked(allocator, candidate, tuple(device_ids))
    # Made as the placement makes it (dataclasses.replace reads every field of the record: three times as long).
    return (
        placement.allocation(allocator, candidate, tuple(device_ids), kept.decided.minors, kept.decided.answered_as),
        kept.response,
    )
