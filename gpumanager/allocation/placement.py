"""Deciding where a matched container goes: the GPUs predicated by the extender when they can hold it, else the
topology evaluators' choice, the containers riding on an init container's GPUs, and the refusals that say why none
fits. Called with the allocator's lock held."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpumanager import names, safenames
from gpumanager.allocation import gpu_charges, ids
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    AllocationError,
    Candidate,
    FreedRoomWithheld,
    _mirror_of,
    _runs_first,
    _Subject,
)
from gpumanager.allocation.pods import GPURequest, Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.topology import TopologyTree

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def decide(allocator: Allocator, candidate: Candidate, device_ids: tuple[str, ...]) -> ContainerAllocation:
    """Where the candidate's container goes: its predicated GPUs when they can hold it, else the topology
    evaluators' choice; AllocationError naming the pod, the container and the device IDs when none fits.
    Called with the allocator's lock held."""
    pod, req = candidate.pod, candidate.request
    who = checked(allocator, candidate, device_ids)
    cores, memory = req.cores, req.memory_bytes
    try:
        predicated = podinfo.predicated_gpus(pod, req.index)
    except PodSpecError as exc:
        raise AllocationError(f"{who}: {exc}") from exc
    if predicated is not None and not podinfo.predicated_here(pod):
        log.warning(
            "%s: predicate-gpu-idx-%d=%s was chosen for node %s, not this one: choosing by itself",
            who,
            req.index,
            ",".join(map(str, predicated)),
            podinfo.pod_annotations(pod).get(names.PREDICATE_NODE),
        )
        predicated = None
    if predicated is not None:
        try:
            minors = check_predicated(
                allocator,
                who,
                predicated,
                cores,
                memory,
                gpu_charges.lending_inits(allocator, allocator._tree, podinfo.uid(pod)),
            )
        except AllocationError as exc:
            if exc.kind != "exhausted" or not answer_taken_by_other_pod(allocator, podinfo.uid(pod), req.name):
                raise
            # The kubelet admitted an identical pod first: it got the answer made for this container
            # on the predicated GPUs (swapped at its start) and runs there; the GPUs predicated for it
            # are this pod's room now, or any other.
            log.warning("%s: %s, taken by the identical pod admitted first: choosing by itself", who, exc)
            predicated = None
    if predicated is None:
        uid = podinfo.uid(pod)
        tree = tree_without_predicated(allocator, pod, req)
        kept = without_freed_room(allocator, tree, device_ids)
        indices = numa_first(allocator, kept, uid, cores, memory, device_ids)
        if indices:
            tree = kept
        elif kept is not tree:  # no room but that of freed allocations: likely freed indeed
            indices = numa_first(allocator, tree, uid, cores, memory, device_ids)
            if indices and allocator._holder_of is not None:
                # Unless the kubelet holds their IDs for a pod that waits to start: asked (lock released).
                raise withheld(allocator, who, {tree.leaf(i).minor for i in indices}, device_ids)
        if not indices and tree is not allocator._tree:
            log.warning(
                "%s: no GPU is left beside those predicated for the pod's other containers; choosing among all",
                who,
            )
            tree = allocator._tree
            indices = numa_first(allocator, tree, uid, cores, memory, device_ids)
        if not indices:
            raise AllocationError(f"{who}: {why_none(allocator, cores, memory)}", "exhausted")
        minors = tuple([tree.leaf(i).minor for i in indices])
    return allocation(allocator, candidate, device_ids, minors)


def numa_nodes_of(tree: TopologyTree, device_ids: Sequence[str]) -> frozenset[int] | None:
    """The NUMA nodes of the GPUs that the vcuda-core ``device_ids`` name (GPU g owns IDs 100g .. 100g+99)
    when they are fewer than the node's: the kubelet's Topology Manager offers and gives only IDs of the
    NUMA nodes it chose (and pins the container's CPUs there). None when they are all of them, or some
    GPU named or of the node has no NUMA node."""
    everywhere = tree.numa_nodes
    if everywhere is None:
        return None
    # The IDs were checked against this node's (Allocate): the GPU is the number less its last two digits,
    # so the distinct heads are looked at, not each of up to 1,600 IDs.
    cut = len(names.VCORE_ID_PREFIX)
    named: set[int] = set()
    for head in {device_id[cut:-2] for device_id in device_ids}:
        gpu = ids.tail_number(head) if head else 0
        if gpu is None:
            return None
        try:
            numa = tree.leaf(gpu).info.numa_node
        except ValueError:
            return None
        if numa is None:
            return None
        named.add(numa)
        if len(named) == len(everywhere):
            return None
    return frozenset(named) if named else None


def numa_first(
    allocator: Allocator, tree: TopologyTree, pod_uid: str, cores: int, memory: int, device_ids: Sequence[str]
) -> list[int]:
    """:func:`~gpumanager.allocation.gpu_charges.choose_lending` among the GPUs on the NUMA nodes of the
    GPUs the kubelet gave IDs of (:func:`numa_nodes_of`) when they can hold the container, else among all.
    Lock held."""
    nodes = numa_nodes_of(tree, device_ids)
    if nodes is not None:
        # The common case (IDs steered by GetPreferredAllocation): the choice among all is on those NUMA
        # nodes already, and no narrowed copy of the tree is made.
        anywhere = gpu_charges.choose_lending(allocator, tree, pod_uid, cores, memory, device_ids)
        if anywhere and all(tree.leaf(i).info.numa_node in nodes for i in anywhere):
            return anywhere
        outside = [leaf for leaf in tree.leaves if leaf.info.numa_node not in nodes]
        narrowed = tree.clone()
        for leaf in outside:
            narrowed.occupy(leaf.index, leaf.allocatable_cores, leaf.allocatable_memory)
        picked = gpu_charges.choose_lending(allocator, narrowed, pod_uid, cores, memory, device_ids)
        # An init container's room lent back may lie outside: only a choice inside counts.
        if picked and not set(picked) & {leaf.index for leaf in outside}:
            return picked
        return anywhere
    return gpu_charges.choose_lending(allocator, tree, pod_uid, cores, memory, device_ids)


def allocation(
    allocator: Allocator,
    candidate: Candidate,
    device_ids: tuple[str, ...],
    minors: tuple[int, ...],
    answered_as: tuple[str, str] = ("", ""),
) -> ContainerAllocation:
    """The allocation of the candidate's container on ``minors`` with ``device_ids``, answered with the directory
    ``answered_as`` (its own when not given). Called with the allocator's lock held."""
    pod, req = candidate.pod, candidate.request
    meta = pod.get("metadata") or {}
    return ContainerAllocation(
        pod_uid=podinfo.uid(pod),
        container=req.name,
        minors=minors,
        cores=req.cores,
        memory=req.memory_bytes,
        device_ids=device_ids,
        namespace=str(meta.get("namespace", "")),
        pod_name=str(meta.get("name", "")),
        container_index=req.index,
        init=_runs_first(pod, req),
        mirror=_mirror_of(pod),
        answered_as=answered_as,
    )


def riding(
    allocator: Allocator, candidate: Candidate, device_ids: tuple[str, ...], init: ContainerAllocation
) -> ContainerAllocation | None:
    """The allocation of ``candidate``, handed the IDs of its pod's init container ``init``, on
    the init container's GPUs and sharing its charge (lock held), or None where it cannot.

    Init containers run one at a time before the others, so the two never use the GPU together:
    the pod holds the larger of the two there, as the kubelet counts their IDs once. Not where
    the scheduler named GPUs for the container (``predicate-gpu-idx``): it goes there, and shares
    the charge only if the init container is there too."""
    pod, req = candidate.pod, candidate.request
    try:
        if podinfo.predicated_here(pod) and podinfo.predicated_gpus(pod, req.index) is not None:
            return None
    except PodSpecError:
        return None
    if req.cores != init.cores or not init.minors:
        return None
    who = checked(allocator, candidate, device_ids)
    shared = gpu_charges.charge_of_group(allocator, init, include=True)
    extra = max(0, req.memory_bytes - shared[1])
    for minor in init.minors:
        try:
            leaf = allocator._tree.leaf_by_minor(minor)
        except (KeyError, ValueError):
            return None
        if not leaf.healthy or (req.cores < names.HUNDRED_CORES and leaf.allocatable_memory < extra):
            return None
    log.info("%s takes its init container %s's place on GPUs %s", who, init.container, list(init.minors))
    return allocation(allocator, candidate, device_ids, init.minors)


def checked(allocator: Allocator, candidate: Candidate, device_ids: tuple[str, ...]) -> _Subject:
    """The checks of a request that do not depend on where it goes; its subject for messages."""
    pod, req = candidate.pod, candidate.request
    who = _Subject(pod, req.name, device_ids)
    try:
        safenames.pod_uid(podinfo.uid(pod))
        safenames.container_name(req.name)
    except safenames.UnsafeNameError as exc:
        raise AllocationError(f"{who}: {exc}; refused, it would become a path on this node") from None
    cores, memory = req.cores, req.memory_bytes
    if cores > names.HUNDRED_CORES and cores % names.HUNDRED_CORES:
        raise AllocationError(f"{who}: {cores} tencent.com/vcuda-core is more than 100 and not a multiple of 100")
    if cores < names.HUNDRED_CORES:
        if not allocator._settings.share_mode:
            raise AllocationError(f"{who}: {cores} tencent.com/vcuda-core is a share, but --share-mode is off")
        if memory <= 0:
            raise AllocationError(f"{who}: a share ({cores} cores) needs tencent.com/vcuda-memory > 0")
        problem = allocator._share_problem()
        if problem:
            raise AllocationError(f"{who}: {cores} tencent.com/vcuda-core is a share, but {problem}", "unavailable")
    largest = allocator._largest
    if cores < names.HUNDRED_CORES and memory > largest:
        raise AllocationError(
            f"{who}: request memory {memory} bytes is larger than any GPU of this node ({largest} bytes)",
            "exhausted",
        )
    return who


def without_freed_room(allocator: Allocator, tree: TopologyTree, device_ids: Sequence[str]) -> TopologyTree:
    """``tree``, or a copy of it where the allocations freed before their containers started (remembered
    by their IDs) still hold their GPUs' room (lock held).

    Such an allocation may have been a guess among identical pods: the kubelet still counts its IDs
    as the pod's it gave them to, whose start takes it over on the same GPUs (its answer names them).
    Placing another container in that room over-commits the GPU then. It is left while other room
    fits; an Allocate of some of its IDs (``device_ids``) shows the kubelet freed them."""
    if not allocator._freed_guesses:
        return tree
    given = frozenset(device_ids)
    held: dict[int, tuple[int, int]] = {}
    for wanted, same in allocator._freed_guesses.items():
        if not given.isdisjoint(wanted):
            continue
        for alloc in same:
            for minor in alloc.minors:
                cores, memory = held.get(minor, (0, 0))
                held[minor] = (max(cores, alloc.cores), max(memory, alloc.memory))
    if not held:
        return tree
    scratch = tree.clone()
    for minor, (cores, memory) in sorted(held.items()):
        try:
            leaf = scratch.leaf_by_minor(minor)
        except (KeyError, ValueError):
            continue
        if cores >= names.HUNDRED_CORES:
            scratch.occupy(leaf.index, names.HUNDRED_CORES, leaf.allocatable_memory)
        else:
            scratch.occupy(leaf.index, min(cores, leaf.allocatable_cores), min(memory, leaf.allocatable_memory))
    return scratch


def withheld(allocator: Allocator, who: _Subject, minors: set[int], device_ids: Sequence[str]) -> FreedRoomWithheld:
    """The refusal of ``who``, whose only room is on ``minors``, held there by allocations freed before
    their containers started (lock held): the kubelet may still hold their IDs for another pod."""
    given = frozenset(device_ids)
    freed = [
        (wanted, same)
        for wanted, same in allocator._freed_guesses.items()
        if given.isdisjoint(wanted) and any(minors.intersection(a.minors) for a in same)
    ]
    named = "; ".join(
        f"pod {same[0].pod_uid} container {same[0].container} ({ids.describe(sorted(wanted))}, GPUs "
        f"{list(same[0].minors)})"
        for wanted, same in freed
    )
    return FreedRoomWithheld(
        f"{who}: no GPU has room for it but GPUs {sorted(minors)}, held by allocations freed before their "
        f"containers started: {named}; the kubelet may still hold their IDs for the pod it gave them to, "
        "whose start takes that room",
        tuple(wanted for wanted, _ in freed),
    )


def tree_without_predicated(allocator: Allocator, pod: Pod, req: GPURequest) -> TopologyTree:
    """The tree an init container (no predicate annotation names it) chooses from (lock held): the
    GPUs predicated for its pod's containers keep what those will take. The kubelet allocates init
    containers first and they keep their GPUs while the others allocate, so an init container on a
    GPU predicated for another container would make that one's Allocate fail."""
    if req.index >= 0 or not podinfo.predicated_here(pod):
        return allocator._tree
    held: list[tuple[GPURequest, list[int]]] = []
    for other in podinfo.gpu_containers(pod):
        try:
            minors = podinfo.predicated_gpus(pod, other.index)
        except PodSpecError:
            continue
        if minors:
            held.append((other, minors))
    if not held:
        return allocator._tree
    scratch = allocator._tree.clone()
    for other, minors in held:
        for minor in minors:
            try:
                leaf = scratch.leaf_by_minor(minor)
            except ValueError:
                continue
            if other.cores >= names.HUNDRED_CORES:
                scratch.occupy(leaf.index, names.HUNDRED_CORES, leaf.allocatable_memory)
            else:
                cores = min(other.cores, leaf.allocatable_cores)
                memory = min(other.memory_bytes, leaf.allocatable_memory)
                scratch.occupy(leaf.index, cores, memory)
    return scratch


def answer_taken_by_other_pod(allocator: Allocator, pod_uid: str, container: str) -> bool:
    """Whether another pod's container holds the answer made for this one (a swap at its start)."""
    return any(a.answered == (pod_uid, container) and a.pod_uid != pod_uid for a in allocator._allocs.values())


def check_predicated(
    allocator: Allocator, who: _Subject, minors: list[int], cores: int, memory: int, tree: TopologyTree
) -> tuple[int, ...]:
    """The predicated GPUs, when ``tree`` (the topology tree, or a copy where the pod's own init
    containers make way) has room on each."""
    need = 1 if cores <= names.HUNDRED_CORES else cores // names.HUNDRED_CORES
    shown = ",".join(map(str, minors))
    if len(minors) != need or len(set(minors)) != len(minors):
        raise AllocationError(
            f"{who}: predicate-gpu-idx names GPU(s) {shown} but {cores} cores need {need} distinct GPU(s)"
        )
    for minor in minors:
        try:
            leaf = tree.leaf_by_minor(minor)
        except (KeyError, ValueError):
            raise AllocationError(
                f"{who}: predicate-gpu-idx names GPU {minor}, which this node does not have "
                f"(GPUs: {sorted(allocator._by_minor)})"
            ) from None
        if not leaf.healthy:
            raise AllocationError(f"{who}: predicated GPU {minor} is unhealthy", "exhausted")
        if cores < names.HUNDRED_CORES:
            if leaf.allocatable_cores < cores or leaf.allocatable_memory < memory:
                raise AllocationError(
                    f"{who}: predicated GPU {minor} cannot hold {cores} cores / {memory >> 20} MiB: it has "
                    f"{leaf.allocatable_cores} cores / {leaf.allocatable_memory >> 20} MiB free",
                    "exhausted",
                )
        elif not leaf.available:
            raise AllocationError(
                f"{who}: predicated GPU {minor} is not entirely free ({leaf.allocatable_cores} cores free)",
                "exhausted",
            )
    return tuple(minors)


def why_none(allocator: Allocator, cores: int, memory: int) -> str:
    """Why no GPU can hold ``cores`` and ``memory``: each healthy GPU's free cores and memory, or the wholly
    free ones. Called with the allocator's lock held."""
    healthy = [leaf for leaf in allocator._tree.leaves if leaf.healthy]
    if cores < names.HUNDRED_CORES:
        free = ", ".join(
            f"GPU {g.minor}: {g.allocatable_cores} cores/{g.allocatable_memory >> 20} MiB" for g in healthy
        )
        return f"no GPU has {cores} cores and {memory >> 20} MiB free ({free})"
    whole = [leaf.minor for leaf in healthy if leaf.available]
    return f"{cores // names.HUNDRED_CORES} whole GPU(s) needed, entirely free and healthy: {whole}"
