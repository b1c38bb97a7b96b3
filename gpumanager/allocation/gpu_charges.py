"""What each GPU is charged with: a pod's containers sharing one charge (an init container and the one it handed its
IDs to), the GPUs an init container lends, and the GPUs charged beyond what they hold (overcommit), warned about
and told to the metrics. Called with the allocator's lock held."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation.model import (
    _beyond,
    _share_key,
)
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.topology import TopologyTree, choose

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def charge_of_group(allocator: Allocator, alloc: ContainerAllocation, *, include: bool) -> tuple[int, int]:
    """(cores, memory) the containers of ``alloc``'s pod holding its IDs on its GPUs take together
    (an init container and the container it handed its IDs to: the larger of each), with or
    without ``alloc`` itself; (0, 0) for none."""
    cores, memory = (alloc.cores, alloc.memory) if include else (0, 0)
    if not alloc.device_ids:
        return cores, memory
    share = _share_key(alloc)
    for container in allocator._by_pod.get(alloc.pod_uid, ()):
        if container == alloc.container:
            continue
        other = allocator._allocs[(alloc.pod_uid, container)]
        if _share_key(other) == share:
            cores, memory = max(cores, other.cores), max(memory, other.memory)
    return cores, memory


def pod_charges(
    allocator: Allocator,
    pod_uid: str,
    minor: int,
    *,
    extra: ContainerAllocation | None = None,
    lend: bool = False,
    started_only: bool = False,
    of: Sequence[ContainerAllocation] | None = None,
) -> list[tuple[int, int]]:
    """The (cores, memory) charges a pod's allocations (and ``extra``, not yet in the state) put on
    GPU ``minor``: one per group of its containers holding the same IDs (:func:`_share_key`, the
    larger of each), the groups of init containers (:attr:`ContainerAllocation.init`) together as
    one, beyond what the others hold there: init containers run one at a time and end before the
    others start (the kubelet counts a pod as the larger of its init containers and the sum of the
    others, and hands an init container's IDs on). ``lend``: without that init charge;
    ``started_only``: only the containers that have started (and ``extra``); ``of``: these allocations
    of the pod instead of its records (a change weighed before it is made).

    An init group none of whose IDs the others there hold (they all have IDs) is charged beside
    them: the kubelet handed its IDs to none of them and counts both sets of IDs as held. Such an
    allocation was made for another pod (a guess among identical pods: the kubelet admitted the
    other one, which starts with those IDs on those GPUs)."""
    groups: dict[tuple[str, frozenset[str], tuple[int, ...]], tuple[int, int, bool]] = {}
    unnamed = False  # a member recorded without IDs
    members = (
        list(of) if of is not None else [allocator._allocs[(pod_uid, c)] for c in allocator._by_pod.get(pod_uid, ())]
    )
    if started_only:
        members = [a for a in members if a.started]
    if extra is not None:
        members = [a for a in members if a.container != extra.container] + [extra]
    for a in members:
        if minor not in a.minors:
            continue
        unnamed |= not a.device_ids
        share = _share_key(a)
        held = groups.get(share)
        groups[share] = (
            (a.cores, a.memory, a.init)
            if held is None
            else (max(held[0], a.cores), max(held[1], a.memory), held[2] and a.init)
        )
    charges = [(cores, memory) for cores, memory, init in groups.values() if not init]
    inits = [(cores, memory) for cores, memory, init in groups.values() if init]
    if inits and charges and not unnamed:
        handed = frozenset().union(*[share[1] for share, (_, _, init) in groups.items() if not init])
        inits = []
        for share, (cores, memory, init) in groups.items():
            if init:
                (inits if not handed.isdisjoint(share[1]) else charges).append((cores, memory))
    if inits and not lend:
        gpu = allocator._by_minor.get(minor)
        total = gpu.memory_total if gpu is not None else 0

        def on_gpu(cores: int, memory: int) -> tuple[int, int]:
            return (names.HUNDRED_CORES, total) if cores >= names.HUNDRED_CORES else (cores, memory)

        first = [on_gpu(*c) for c in inits]
        rest = [on_gpu(*c) for c in charges]
        beyond = (
            max(0, max(c for c, _ in first) - sum(c for c, _ in rest)),
            max(0, max(m for _, m in first) - sum(m for _, m in rest)),
        )
        if beyond != (0, 0):
            charges.append(beyond)
    return charges


def choose_lending(
    allocator: Allocator, tree: TopologyTree, pod_uid: str, cores: int, memory: int, device_ids: Sequence[str]
) -> list[int]:
    """The GPUs :func:`choose` picks in ``tree`` for a container of ``pod_uid`` given ``device_ids``
    (lock held), the room of its pod's init containers lent to it (:func:`lending_inits`) only
    when ``device_ids`` share an ID with theirs.

    The kubelet hands an init container's IDs on to the pod's later containers (each takes what it
    needs of them first): a later container given none of them does not follow that allocation,
    which was then made for another pod (a guess among identical pods: the kubelet admitted the
    other one, which starts with those IDs on those GPUs), and placing it in that room would have it
    run beside that pod on a GPU without room for both."""
    return choose(lending_inits(allocator, tree, pod_uid, device_ids), cores, memory)


def lending_inits(
    allocator: Allocator, tree: TopologyTree, pod_uid: str, device_ids: Sequence[str] = ()
) -> TopologyTree:
    """``tree``, or a copy of it without the charge of ``pod_uid``'s init containers beyond its other
    containers (lock held): a later container of the pod may take their place, as they will have
    ended when it starts (the kubelet hands their IDs on). ``device_ids`` (a later container's
    Allocate): ``tree`` itself unless they share an ID with one of those init allocations (one
    recorded without IDs counts as sharing)."""
    held = [allocator._allocs[(pod_uid, c)] for c in allocator._by_pod.get(pod_uid, ())]
    for a in held:
        if a.init:
            break
    else:  # none of its containers is an init container (a loop: no generator on every Allocate)
        return tree
    if device_ids:
        given = frozenset(device_ids)
        for a in held:
            if a.init and (not a.device_ids or not given.isdisjoint(a.device_ids)):
                break
        else:  # given none of its init containers' IDs: their allocations are not what it follows
            return tree
    scratch = tree.clone()
    for minor in sorted({m for a in held for m in a.minors}):
        try:
            index = scratch.leaf_by_minor(minor).index
        except (KeyError, ValueError):
            continue
        for charge in pod_charges(allocator, pod_uid, minor):
            scratch.free(index, *charge)
        for charge in pod_charges(allocator, pod_uid, minor, lend=True):
            scratch.occupy(index, *charge)
    return scratch


def charges_of(allocator: Allocator, minors: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
    """(cores, memory) of each charge held on these GPUs: one per group of containers sharing IDs
    (:func:`_share_key`), one per consuming device of a prepared claim."""
    wanted = set(minors)
    holders = sorted({a.pod_uid for a in allocator._allocs.values() if wanted.intersection(a.minors)})
    out: dict[int, list[tuple[int, int]]] = {m: [] for m in wanted}
    for pod_uid in holders:
        for m in wanted:
            out[m].extend(pod_charges(allocator, pod_uid, m))
    for claim in allocator._claims.values():
        for dev in claim.devices:
            if dev.consumes and dev.minor in out:
                out[dev.minor].append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
    return out


def recharge(allocator: Allocator, minors: Iterable[int]) -> None:
    """Set these GPUs' accounting from what they hold now (lock held); a GPU no longer charged beyond
    its capacity goes back to the usual incremental accounting."""
    for minor, charges in charges_of(allocator, minors).items():
        try:
            leaf = allocator._tree.leaf_by_minor(minor)
        except (KeyError, ValueError):
            allocator._overcommitted.discard(minor)
            continue
        allocator._tree.free(leaf.index, names.HUNDRED_CORES, 0)
        for cores, memory in charges:
            allocator._tree.occupy(leaf.index, cores, memory)
        if not _beyond(charges, leaf.total_memory):
            allocator._overcommitted.discard(minor)


def warn_overcommit(allocator: Allocator, source: str) -> None:
    """Log each GPU the held records charge beyond its capacity, and keep it for :func:`recharge`."""
    minors = {m for a in allocator._allocs.values() for m in a.minors}
    minors |= {d.minor for c in allocator._claims.values() for d in c.devices if d.consumes}
    for minor, charges in sorted(charges_of(allocator, minors).items()):
        gpu = allocator._by_minor.get(minor)
        if gpu is None or not _beyond(charges, gpu.memory_total):
            continue
        allocator._overcommitted.add(minor)
        cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
        memory = sum(mem for c, mem in charges if c < names.HUNDRED_CORES)
        holders = sorted(
            f"{a.namespace}/{a.pod_name or a.pod_uid} container {a.container}"
            for a in allocator._allocs.values()
            if minor in a.minors
        )
        holders += sorted(
            f"claim {c.namespace}/{c.name}"
            for c in allocator._claims.values()
            if any(d.minor == minor for d in c.devices)
        )
        shown = ", ".join(holders[:8]) + (f", and {len(holders) - 8} more" if len(holders) > 8 else "")
        log.error(
            "%s: GPU %d (%s, %d MiB) is charged beyond its capacity: %d records hold %d cores and %d bytes of "
            "shares%s (its memory may have shrunk since they were allocated: ECC turned on, or the GPU "
            "replaced); held by %s",
            source,
            minor,
            gpu.uuid,
            gpu.memory_total >> 20,
            len(charges),
            cores,
            memory,
            " beside a whole-GPU record" if any(c >= names.HUNDRED_CORES for c, _ in charges) else "",
            shown or "no container",
        )
