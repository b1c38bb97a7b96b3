"""Allocations freed before their container started, and IDs handed on: remembering them, taking them back when the
kubelet gives their IDs to a pod of the same request, detaching an allocation while its IDs are matched anew and
putting it back or retiring it. Called with the allocator's lock held."""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumanager.allocation import (
    ids,
    matching,
    placement,
    prestart,
)
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    _FREED_GUESSES_KEPT,
    AllocationError,
    Candidate,
    _del,
    _Detached,
    _mirror_of,
    _put,
    _request_of,
    _runs_first,
)
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def take_back_handed_on(
    allocator: Allocator,
    wanted: frozenset[str],
    candidate: Candidate,
    keep: AbstractSet[tuple[str, str]] = frozenset(),
) -> bool:
    """Take back the containers of other pods that held some of ``wanted`` (under the lock).

    The kubelet never hands out an ID a container of an active pod holds: seeing one again in a
    request for another pod means it stopped counting that pod (its containers stopped), even if the
    pod's status does not say so yet. A container of the candidate's own pod (an init container whose
    devices the kubelet reuses) keeps its IDs, as do those of ``keep``, found running at the API server,
    and every started container whose pod the cache shows running and of which the kubelet's records hold
    no devices: a kubelet restarted without its checkpoint counts their IDs free while they run. True when
    one was taken back.
    """
    pod_uid = podinfo.uid(candidate.pod)
    handed_on = [
        key
        for key, alloc in allocator._allocs.items()
        if key[0] != pod_uid and key not in keep and alloc.device_ids and not wanted.isdisjoint(alloc.device_ids)
    ]
    records = allocator._kubelet_records
    if records is not None:
        lost = [key for key in handed_on if matching.started_and_alive(allocator, key) and not records(key)]
        for key in lost:
            log.warning(
                "%s share IDs with pod %s container %s, which has started and runs, and which the kubelet's "
                "records hold no devices of (it lost them: kubelet_internal_checkpoint removed or damaged before "
                "the kubelet restarted): that container keeps its GPUs %s",
                ids.describe(ids.in_order(wanted)),
                *key,
                list(allocator._allocs[key].minors),
            )
        handed_on = [key for key in handed_on if key not in lost]
    for key in handed_on:
        take_back(allocator, key)
    return bool(handed_on)


def take_back(allocator: Allocator, key: tuple[str, str]) -> None:
    """The kubelet gave ``key``'s device IDs to a new container: ``key`` no longer holds them."""
    guessed = key in allocator._guessed
    alloc = allocator._remove(key)
    if alloc is None:
        return
    allocator._free(alloc)
    allocator._save_or_report([_del(key)])
    note_retired(allocator, alloc, guessed=guessed)


def note_retired(allocator: Allocator, alloc: ContainerAllocation, *, guessed: bool = False) -> None:
    """``alloc``'s container will not ask again: the kubelet allocates a container once (it reuses
    IDs across restarts). Unless ``guessed``: the IDs were matched to it among pods asking for as
    many cores (or left to it by a swap at PreStartContainer), and the kubelet may have given them to
    another; that container may still wait for its own (lock held)."""
    if guessed:
        log.info(
            "%s of pod %s container %s come back in a new Allocate: they were matched to that container "
            "among pods asking for as many cores, and the kubelet gave them to another, whose IDs it "
            "may still wait for; releasing GPUs %s",
            ids.describe(alloc.device_ids),
            alloc.pod_uid,
            alloc.container,
            list(alloc.minors),
        )
        return
    if len(allocator._retired) > 4096:
        allocator._retired.clear()
        matching.reindex(allocator)  # the containers dropped from the heaps as retired may wait again
    allocator._retired.add(alloc.key)
    log.info(
        "%s of pod %s container %s come back in a new Allocate: that container has started or ended, so "
        "the kubelet freed them; releasing its GPUs %s and matching the request anew",
        ids.describe(alloc.device_ids),
        alloc.pod_uid,
        alloc.container,
        list(alloc.minors),
    )


def detach(allocator: Allocator, key: tuple[str, str]) -> _Detached | None:
    """Take ``key``'s allocation out of the state for now (lock held; nothing journaled): its IDs
    came in a new Allocate, and it loses them only once another container gets them
    (:func:`retire`); otherwise :func:`reattach` puts it back as it was."""
    ticket = allocator._unsynced.get(key, 0)
    guessed = key in allocator._guessed
    alloc = allocator._remove(key)
    if alloc is None:
        return None
    asked = allocator._asked_at.get(frozenset(alloc.device_ids))
    allocator._free(alloc)
    allocator._retired.add(key)  # not matched to itself meanwhile
    return _Detached(alloc, ticket, guessed, asked)


def reattach(allocator: Allocator, held: _Detached | None) -> None:
    """Put back what :func:`detach` took out (lock held), unless the state has moved on."""
    if held is None:
        return
    alloc = held.alloc
    allocator._retired.discard(alloc.key)
    holder = allocator._by_ids.get(frozenset(alloc.device_ids)) if alloc.device_ids else None
    if alloc.key in allocator._allocs or (holder is not None and holder[0] != alloc.pod_uid):
        return
    allocator._occupy(alloc)
    allocator._insert(alloc)
    if held.ticket:
        allocator._unsynced[alloc.key] = held.ticket
    if held.guessed:
        allocator._guessed.add(alloc.key)
    if held.asked is not None:
        allocator._asked_at[frozenset(alloc.device_ids)] = held.asked


def retire(allocator: Allocator, held: _Detached | None, successor: tuple[str, str]) -> None:
    """Another container (``successor``) got the IDs of what :func:`detach` took out: the take-back
    is made durable and logged (lock held)."""
    if held is None:
        return
    key = held.alloc.key
    allocator._retired.discard(key)
    if key == successor:
        return  # the same container, allocated anew: its new record replaces the old one
    allocator._save_or_report([_del(key)])
    note_retired(allocator, held.alloc, guessed=held.guessed)


def take_freed_guess(allocator: Allocator, wanted: frozenset[str], owner: tuple[str, str]) -> bool:
    """Whether ``owner``, which the kubelet says starts with ``wanted`` and which has no allocation,
    took over the allocation of a container of an identical pod freed before it started (lock held):
    a guess among identical waiting pods. No Allocate has given the IDs out since, so the kubelet
    gave them, and our answer, to ``owner``: it gets the answer's GPUs and the directory it mounts,
    when both are still free. Several containers of that pod held the IDs (an init container's,
    handed on): each goes to the container of ``owner``'s pod of its name, which got its answer."""
    freed = allocator._freed_guesses.pop(wanted, None)
    if not freed:
        return False
    pod = allocator._pods.get(owner[0])
    if pod is None:
        allocator._freed_guesses[wanted] = freed  # the kubelet's next try of the start may find it
        return False
    if len(freed) == 1:
        pairs = [(freed[0], owner)]
    else:
        pairs = [(a, (owner[0], a.container)) for a in freed]
        if owner[1] not in {a.container for a in freed}:
            return False
    # A container of ``owner``'s pod recorded, unstarted, with other IDs: those were matched to it by a
    # guess too (the kubelet admitted the identical pods in another order than they wait in), and they
    # are the deleted pod's, which the kubelet freed with it. Such a record gives way, remembered by
    # its IDs as a freed guess in turn (another pod may start with them).
    displaced = [allocator._allocs[target] for _, target in pairs if target in allocator._allocs]
    if any(d.started or not d.device_ids or frozenset(d.device_ids) == wanted for d in displaced):
        return False
    gone = {d.key for d in displaced}
    if any(not can_take_freed(allocator, a, target, pod, gone) for a, target in pairs):
        return False
    meta = pod.get("metadata") or {}
    made_of: list[tuple[ContainerAllocation, ContainerAllocation]] = []
    for alloc, target in pairs:
        request = _request_of(pod, target[1])
        assert request is not None
        made_of.append(
            (
                alloc,
                replace(
                    alloc,
                    pod_uid=target[0],
                    container=target[1],
                    namespace=str(meta.get("namespace", "")),
                    pod_name=str(meta.get("name", "")),
                    container_index=request.index,
                    answered_as=alloc.answered,
                    init=_runs_first(pod, request),
                    mirror=_mirror_of(pod),
                    started=False,
                    memory=request.memory_bytes,  # as many cores, perhaps another memory size
                ),
            )
        )
    replaced: dict[tuple[str, str], ContainerAllocation | None] = {d.key: None for d in displaced}
    replaced.update((made.key, made) for _, made in made_of)
    for alloc, made in made_of:
        short = prestart.short_of_room(allocator, made, alloc, replaced) if made.memory > alloc.memory else ""
        if short:
            allocator._freed_guesses[wanted] = freed  # nothing changes: the kubelet's next try looks again
            raise AllocationError(short, "unavailable")
    for d in displaced:
        allocator._free(allocator._remove(d.key) or d)
    taken: list[ContainerAllocation] = []
    for alloc, made in made_of:
        target = made.key
        try:
            allocator._place(made)
        except (KeyError, ValueError) as exc:
            log.warning(
                "pod %s container %s starts with %s, matched to pod %s container %s, which was freed before "
                "it started; its GPUs %s cannot be taken over: %s",
                *target,
                ids.describe(alloc.device_ids),
                *alloc.key,
                list(alloc.minors),
                exc,
            )
            for done in taken:
                allocator._free(allocator._remove(done.key) or done)
            for d in displaced:
                allocator._place(d)
            return False
        taken.append(made)
    for d in displaced:
        remember_freed(allocator, d)
        log.info(
            "pod %s container %s starts with other IDs than the %s matched to it (identical pods admitted "
            "in another order than they waited in): those are freed (GPUs %s), remembered by their IDs",
            *d.key,
            ids.describe(d.device_ids),
            list(d.minors),
        )
    allocator._save_or_report([_del(d.key, d) for d in displaced] + [_put(a) for a in taken])
    for alloc, target in pairs:
        log.info(
            "pod %s container %s starts with %s, matched to pod %s container %s (the first of identical "
            "pods waiting), which was freed before it started: it takes over that allocation (GPUs %s)",
            *target,
            ids.describe(alloc.device_ids),
            *alloc.key,
            list(alloc.minors),
        )
    return owner in allocator._allocs


def freed_for(allocator: Allocator, wanted: frozenset[str], owner: tuple[str, str]) -> bool:
    """Whether ``owner``, unallocated, took over (:func:`take_freed_guess`) the one allocation of
    ``wanted`` freed before it started, recorded for a container of ``owner``'s name (lock held)."""
    freed = allocator._freed_guesses.get(wanted, [])
    if owner in allocator._allocs or len(freed) != 1 or freed[0].container != owner[1]:
        return False
    return take_freed_guess(allocator, wanted, owner)


def can_take_freed(
    allocator: Allocator,
    alloc: ContainerAllocation,
    target: tuple[str, str],
    pod: Pod,
    giving_way: set[tuple[str, str]] | None = None,
) -> bool:
    """Whether container ``target`` of ``pod``, unallocated (or its record among ``giving_way``) and
    asking for as many cores as ``alloc`` was allocated (the vcuda-core Allocate names no memory), can
    take ``alloc`` over with the directory its answer named, unused but by ``giving_way`` (lock held);
    whether its GPUs have room for its memory budget is weighed apart (:func:`prestart.short_of_room`)."""
    away = giving_way or set()
    request = _request_of(pod, target[1])
    return (
        (target not in allocator._allocs or target in away)
        and request is not None
        and request.cores == alloc.cores  # its own memory budget: weighed against the GPUs' room
        and not allocator._answering.get(alloc.answered, set()) - away
    )


def taken_over(
    allocator: Allocator, key: tuple[str, str], owner: tuple[str, str], wanted: frozenset[str]
) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The (our record, kubelet's holder) pairs to swap when the kubelet says ``owner`` holds the IDs
    ``wanted`` we recorded for ``key`` (lock held).

    ``key`` alone, unless several containers of ``key``'s pod hold ``wanted`` (an init container's
    IDs handed on to the next container) and ``owner``'s pod, another, has each of their names:
    the kubelet's records name either of that pod's containers holding the IDs (PreStartContainer
    names no container), and each got the answer of the container of the same name, whose
    directory it mounts. Then every one of them is swapped with the container of its name.

    Likewise when ``key`` alone holds ``wanted`` and several containers of ``owner``'s pod hold the IDs
    recorded for ``owner``: those records go to ``key``'s pod together (:func:`handed_back`). And when the
    records of ``wanted`` lie in several pods, ``owner``'s among them or not, none started, they all go to
    ``owner``'s pod (:func:`gathered`), also when ``key`` is in ``owner``'s pod."""
    group = sorted(
        c for c in allocator._by_pod.get(key[0], ()) if frozenset(allocator._allocs[(key[0], c)].device_ids) == wanted
    )
    pod = allocator._pods.get(owner[0])
    if pod is None:
        return [(key, owner)]
    if owner[0] == key[0]:
        return gathered(allocator, owner, wanted) or [(key, owner)]
    if len(group) < 2:
        return gathered(allocator, owner, wanted) or [(key, owner), *handed_back(allocator, key, owner)]
    if owner[1] not in group or any(_request_of(pod, c) is None for c in group):
        return [(key, owner)]
    return [((key[0], c), (owner[0], c)) for c in group]


def gathered(
    allocator: Allocator, owner: tuple[str, str], wanted: frozenset[str]
) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The swaps that bring to ``owner``'s pod every record of ``wanted`` when they lie in several pods,
    ``owner``'s among them or not, none started (lock held): the answers made for its containers (an init
    container's IDs handed on), split by an earlier swap whose holder pod had fewer containers (the
    kubelet's records name either container holding the IDs, so one record may be in ``owner``'s pod
    already, under another container's name than its answer's). Each goes to the container of
    ``owner``'s pod its answer was made for (the name of its directory), else to one left asking for as
    many cores, that container's record (a guess, not started) taking its place. The pairs are made in
    order (:func:`prestart.planned_swaps`): a record of ``owner``'s pod moves before another takes its
    place. None when they lie in one pod, or ``owner``'s pod cannot take them all."""
    holders = sorted(k for k, a in allocator._allocs.items() if frozenset(a.device_ids) == wanted)
    pod = allocator._pods.get(owner[0])
    if pod is None or len({k[0] for k in holders}) < 2:
        return []
    if any(allocator._allocs[k].started for k in holders):
        return []
    cores = allocator._allocs[holders[0]].cores
    names_ = [
        r.name
        for r in matching.gpu_containers(allocator, owner[0], pod)
        if r.cores == cores
        and not ((owner[0], r.name) in allocator._allocs and allocator._allocs[(owner[0], r.name)].started)
        and ((owner[0], r.name) not in allocator._allocs or allocator._allocs[(owner[0], r.name)].cores == cores)
    ]
    if owner[1] not in names_ or len(names_) < len(holders):
        return []
    targets: dict[tuple[str, str], str] = {}
    for k in holders:
        name = allocator._allocs[k].answered[1]
        if name in names_ and name not in targets.values():
            targets[k] = name
    left = [n for n in names_ if n not in targets.values()]
    if owner[1] in left:
        left.insert(0, left.pop(left.index(owner[1])))  # ``owner`` gets one of them
    for k in holders:
        if k not in targets:
            targets[k] = left.pop(0)
    if owner[1] not in targets.values():
        return []
    pairs = [(k, (owner[0], targets[k])) for k in holders if k != (owner[0], targets[k])]
    return sorted(pairs, key=lambda pair: pair[0][0] != owner[0])  # ``owner``'s pod's records first


def handed_back(
    allocator: Allocator, key: tuple[str, str], owner: tuple[str, str]
) -> list[tuple[tuple[str, str], tuple[str, str]]]:
    """The swaps that go with swapping our record ``key`` and ``owner``'s (another pod's) when other
    containers of ``owner``'s pod hold the IDs recorded for ``owner`` (lock held): its init container's
    IDs handed on, each container with its own answer. The kubelet gave those IDs to one pod, ``key``'s
    by the swap, whose containers mount those answers' directories: each of those records goes to a
    container of ``key``'s pod asking for as many cores (the one of its name, else one left), swapped
    with that container's record, if any (a guess, not started, put where ``owner``'s pod has room).
    None when ``owner`` holds no such group, or ``key``'s pod cannot take all of it: ``key`` and
    ``owner`` alone are swapped then."""
    theirs = allocator._allocs.get(owner)
    if theirs is None or not theirs.device_ids or theirs.started:
        return []
    held = frozenset(theirs.device_ids)
    others = sorted(
        c
        for c in allocator._by_pod.get(owner[0], ())
        if c != owner[1] and frozenset(allocator._allocs[(owner[0], c)].device_ids) == held
    )
    mine = allocator._pods.get(key[0])
    if not others or mine is None or any(allocator._allocs[(owner[0], c)].started for c in others):
        return []
    spare = [
        r.name
        for r in matching.gpu_containers(allocator, key[0], mine)
        if r.name != key[1]
        and r.cores == theirs.cores
        and not ((key[0], r.name) in allocator._allocs and allocator._allocs[(key[0], r.name)].started)
        and ((key[0], r.name) not in allocator._allocs or allocator._allocs[(key[0], r.name)].cores == theirs.cores)
    ]
    partners = {c: c for c in others if c in spare}
    left = [n for n in spare if n not in partners.values()]
    for c in others:
        if c not in partners:
            if not left:
                return []
            partners[c] = left.pop(0)
    pairs: list[tuple[tuple[str, str], tuple[str, str]]] = []
    for c in others:
        there = (key[0], partners[c])
        pairs.append((there, (owner[0], c)) if there in allocator._allocs else ((owner[0], c), there))
    return pairs


def remember_freed(allocator: Allocator, alloc: ContainerAllocation) -> None:
    """Remember ``alloc``, freed before its container started, by its IDs (lock held): those of one pod
    per set of IDs (an init container's, handed on), at most :data:`_FREED_GUESSES_KEPT` sets."""
    wanted = frozenset(alloc.device_ids)
    same = allocator._freed_guesses.get(wanted)
    if same is None or same[0].pod_uid != alloc.pod_uid:
        if len(allocator._freed_guesses) >= _FREED_GUESSES_KEPT:
            allocator._freed_guesses.pop(next(iter(allocator._freed_guesses)))  # the oldest
        same = allocator._freed_guesses[wanted] = []
    same.append(alloc)


def hand_over(allocator: Allocator, alloc: ContainerAllocation) -> bool:
    """``alloc``, just released, never started, and its IDs were asked for again: the kubelet gave them
    (and so our answer) to another pod after failing this one's admission, before its status said so.
    The container that waits first with the same request takes the allocation over, its answer
    unchanged (lock held); PreStartContainer, which hears from the kubelet who starts, repairs a wrong
    pick among identical pods as after any guess. Returns whether a container took it over."""
    if not alloc.device_ids or frozenset(alloc.device_ids) in allocator._by_ids:
        return False
    allocator._retired.add(alloc.key)  # its pod has ended: never matched again
    allocator._take_pod_changes()
    candidate = allocator._match_cached(alloc.cores)
    if candidate is None or podinfo.uid(candidate.pod) == alloc.pod_uid:
        return False
    if candidate.request.memory_bytes != alloc.memory:
        return False
    try:
        taken = replace(
            placement.allocation(allocator, candidate, alloc.device_ids, alloc.minors),
            answered_as=alloc.answered,
            layout=alloc.layout,
        )
        allocator._place(taken)
    except (KeyError, ValueError) as exc:
        log.warning("cannot hand pod %s container %s's GPUs on: %s", *alloc.key, exc)
        return False
    allocator._guessed.add(taken.key)
    allocator._save_or_report([_put(taken)])
    log.info(
        "pod %s container %s ended before it started, after the kubelet asked again for its %s: they and its "
        "answer (GPUs %s) are taken to be pod %s container %s's, the first waiting with the same request",
        *alloc.key,
        ids.describe(alloc.device_ids),
        list(alloc.minors),
        podinfo.pod_key(candidate.pod),
        candidate.request.name,
    )
    return True


def settle_freed_room(allocator: Allocator, freed: tuple[frozenset[str], ...]) -> bool:
    """Whether the room of the allocations freed before their start, remembered by the IDs ``freed``,
    may be given to a request that has no other: ask the kubelet (lock released) who holds those IDs.

    The kubelet hands a container IDs no other container of an active pod holds, and keeps them its
    pod's until the pod ends; it never says which pod an Allocate is for, so after a guess among
    identical waiting pods the pod it gave the IDs to may wait to start with our answer. A holder the
    pod cache knows takes the allocation over now (as its start would), keeping the room; a holder it
    cannot take it over for (another memory size with no room, a container of the freed pod) keeps the
    room held; when no container holds them, or nobody can tell, they are forgotten and the room is
    free, as before this was asked. Returns whether anything changed (the request is matched again)."""
    lookup = allocator._holder_of
    if lookup is None or not freed:
        return False
    holders: dict[frozenset[str], tuple[str, str] | None] = {}
    for wanted in freed:
        try:
            holders[wanted] = lookup(ids.in_order(wanted))
        except Exception as exc:  # nobody can tell: the room is given, as before the kubelet was asked
            log.warning("cannot ask the kubelet which container holds %s: %s", ids.describe(sorted(wanted)), exc)
            holders[wanted] = None
    changed = False
    with allocator._changing():
        for wanted, holder in holders.items():
            same = allocator._freed_guesses.get(wanted)
            if not same:
                changed = True  # given out again meanwhile: the kubelet freed them
                continue
            if holder is None:
                del allocator._freed_guesses[wanted]
                changed = True
                log.info(
                    "%s, matched to pod %s container %s, freed before it started: the kubelet holds them for no "
                    "container, so the room they held on GPUs %s is free",
                    ids.describe(ids.in_order(wanted)),
                    *same[0].key,
                    list(same[0].minors),
                )
                continue
            took = False
            if holder[0] not in {a.pod_uid for a in same}:
                try:
                    took = take_freed_guess(allocator, wanted, holder)
                except AllocationError as exc:
                    log.info(
                        "pod %s container %s cannot take over %s yet: %s", *holder, ids.describe(sorted(wanted)), exc
                    )
            if took:
                changed = True
                continue
            allocator._freed_guesses.setdefault(wanted, same)  # the kubelet holds them: their room stays held
            log.info(
                "%s, matched to pod %s container %s, freed before it started, are held by pod %s container %s in "
                "the kubelet's records: the room they held on GPUs %s stays held",
                ids.describe(ids.in_order(wanted)),
                *same[0].key,
                *holder,
                list(same[0].minors),
            )
    if changed:
        allocator._notify()
    return changed
