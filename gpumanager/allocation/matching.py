"""Matching an Allocate to the pod container it is for: the index of the pods that may still wait for GPUs, kept up
to date from the pod cache's changes; repeats of an earlier Allocate; and the choice among the waiting pods.
Called with the allocator's lock held, except refresh_pods, gone_at_server and refresh_for_room, which ask the API
server with it released."""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation import ids, release
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    AllocationError,
    Candidate,
    Waiting,
    _Detached,
)
from gpumanager.allocation.pods import GPURequest, Pod, PodSpecError
from gpumanager.kube.apierror import plain

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def is_repeat(allocator: Allocator, key: tuple[str, str]) -> bool:
    """Whether an Allocate naming the IDs held by ``key`` repeats that container's own Allocate."""
    alloc = allocator._allocs[key]
    if alloc.started:
        return False
    pod = release.pod_of(allocator, key[0])
    if pod is None:
        # Gone from a complete view: the kubelet has freed its IDs. Without one we cannot tell.
        return not allocator._pods.synced()
    if podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
        # Being deleted: the kubelet starts none of its containers any more, and gives its IDs on
        # once it stops counting it (before its status may name a container). A true repeat still
        # gets its answer when no other container waits for the IDs (_holds_alive).
        return False
    return key[1] not in podinfo.started_containers(pod)


def handed_within_pod(allocator: Allocator, key: tuple[str, str], cores: int) -> Candidate | None:
    """The container of ``key``'s pod the kubelet handed ``key``'s IDs on to (lock held): the next
    container in allocation order, waiting for as many cores, when ``key`` is an init container.
    The kubelet allocates every container of a pod before it starts any, and gives an init
    container's IDs to the next container asking for as many (devicesToReuse)."""
    entry = allocator._waiting.get(key[0])
    if entry is None and key[0] in allocator._fresh_only:
        entry = waiting_entry(allocator, allocator._fresh_only[key[0]].pod)
    if entry is None or key not in entry.keys:
        return None
    at = entry.keys.index(key)
    if entry.requests[at].index >= 0 or podinfo.is_sidecar(entry.pod, key[1]):
        return None  # not an init container, or one that runs beside the others (its IDs stay its own)
    for request, later in zip(entry.requests[at + 1 :], entry.keys[at + 1 :], strict=True):
        if later in allocator._allocs or later in allocator._retired:
            continue
        return Candidate(entry.pod, request) if request.cores == cores else None
    return None


def lost_answer(allocator: Allocator, fresh: Sequence[Pod], cores: int, wanted: frozenset[str]) -> Candidate | None:
    """The container whose Allocate the kubelet repeats with other IDs (lock held), when no container
    waits: one of a pending pod in the fresh list, not started, holding an allocation of ``cores``
    cores. The kubelet allocates a container once and keeps its IDs across its restarts; asking again
    means it never recorded our first answer, whose IDs it may hand out again: ``wanted`` may share IDs
    with that container's, never with another's. Not a container of a pod one of whose containers has
    started: the kubelet starts none before it has recorded every answer of the pod. The first such
    container in upstream's order; None when there is none."""
    holders = {key for key, alloc in allocator._allocs.items() if not wanted.isdisjoint(alloc.device_ids)}
    if len(holders) > 1:
        return None  # IDs of several containers: not one answer the kubelet lost
    best: tuple[tuple[int, str, str, int], Candidate] | None = None
    for pod in fresh:
        try:
            uid = podinfo.uid(pod)
            if uid not in allocator._by_pod or podinfo.phase(pod) != "Pending":
                continue
            if any(allocator._allocs[(uid, c)].started for c in allocator._by_pod[uid]):
                continue  # admitted whole before any of its containers started: no answer of it was lost
            if podinfo.is_terminated(pod) or podinfo.is_deleting(pod) or podinfo.should_delete(pod):
                continue
            started = podinfo.started_containers(pod)
            requests = gpu_containers(allocator, uid, pod)
            order = (podinfo.predicate_time(pod), str((pod.get("metadata") or {}).get("creationTimestamp", "")))
        except Exception:  # an odd pod object: not this one
            continue
        for at, request in enumerate(requests):
            alloc = allocator._allocs.get((uid, request.name))
            if alloc is None or alloc.started or request.name in started or request.cores != cores:
                continue
            if alloc.cores != cores or not alloc.device_ids or (holders and alloc.key not in holders):
                continue
            rank = (*order, podinfo.pod_key(pod), at)
            if best is None or rank < best[0]:
                best = (rank, Candidate(pod, request))
    return best[1] if best is not None else None


def holds_alive(allocator: Allocator, held: _Detached, fresh: Sequence[Pod]) -> bool:
    """Whether ``held`` is still in the state and its pod runs in the fresh list (lock held)."""
    if allocator._allocs.get(held.alloc.key) is not held.alloc:
        return False
    return any(podinfo.uid(p) == held.alloc.pod_uid and not podinfo.is_terminated(p) for p in fresh)


def match_cached(allocator: Allocator, cores: int) -> Candidate | None:
    """The candidate among the pods the cache knows, as :meth:`_best` over every waiting pod would
    choose it, from the heap of that size (lock held; the cache's changes taken in just before, by
    :meth:`_recycle_locked`)."""
    queue = allocator._queues.get(cores)
    allocs, retired, waiting = allocator._allocs, allocator._retired, allocator._waiting
    top: Waiting | None = None
    while queue:
        entry = queue[0][2]
        if waiting.get(entry.uid) is entry and entry.keys[0] not in allocs and entry.keys[0] not in retired:
            top = entry
            break
        heapq.heappop(queue)
        allocator._queued -= 1
    best = best_of(allocator, allocator._multi.values(), cores) if allocator._multi else None
    guess = top is not None and best is not None
    if not guess and queue is not None:
        for _, _, e in queue:  # another waits with the same request: a loop, not any() over a generator
            if e is not top and waiting.get(e.uid) is e and e.keys[0] not in allocs and e.keys[0] not in retired:
                guess = True
                break
    if top is not None and (best is None or top.order < best[0]):
        return Candidate(top.pod, top.requests[0], guess)
    return Candidate(best[1].pod, best[2], guess) if best is not None else None


def set_waiting(allocator: Allocator, uid: str, entry: Waiting | None) -> None:
    """Record whether a pod waits, in the index and its heaps (lock held)."""
    if entry is None:
        allocator._waiting.pop(uid, None)
        allocator._multi.pop(uid, None)
        return
    allocator._waiting[uid] = entry
    if len(entry.requests) == 1:
        allocator._multi.pop(uid, None)
        push(allocator, entry)
    else:
        allocator._multi[uid] = entry


def push(allocator: Allocator, entry: Waiting) -> None:
    """Queue a waiting pod under the cores of its first request; rebuilds the queues when they hold mostly
    stale entries. Called with the allocator's lock held."""
    if allocator._queued > 2 * len(allocator._waiting) + 64:
        reindex(allocator)  # mostly stale entries: start afresh (this one included)
        return
    allocator._pushes += 1
    allocator._queued += 1
    heapq.heappush(allocator._queues.setdefault(entry.requests[0].cores, []), (entry.order, allocator._pushes, entry))


def reindex(allocator: Allocator) -> None:
    """Build the heaps and the list of pods with several GPU containers from the index anew."""
    allocator._queues, allocator._multi = {}, {}
    for entry in allocator._waiting.values():
        if len(entry.requests) == 1:
            allocator._pushes += 1
            allocator._queues.setdefault(entry.requests[0].cores, []).append((entry.order, allocator._pushes, entry))
        else:
            allocator._multi[entry.uid] = entry
    for queue in allocator._queues.values():
        heapq.heapify(queue)
    allocator._queued = sum(len(q) for q in allocator._queues.values())


def take_pod_changes(allocator: Allocator) -> None:
    """Bring the index of waiting pods, and the list of holders to check, up to date with the pod
    source (lock held): only the pods it says changed, or every pod when it cannot say."""
    generation, changed = allocator._pods.changes(allocator._pod_generation)
    if changed is None:
        pods = allocator._pods.pods()
        waiting = (waiting_entry(allocator, pod) for pod in pods)
        allocator._waiting = {w.uid: w for w in waiting if w is not None}
        reindex(allocator)
        allocator._verify_all = True
        if allocator._fresh_only:
            for listed in pods:
                allocator._fresh_only.pop(podinfo.uid(listed), None)
    else:
        for uid in changed:
            allocator._fresh_only.pop(uid, None)  # the cache shows it (or its end) now
            found = allocator._pods.get(uid)
            set_waiting(allocator, uid, waiting_entry(allocator, found) if found is not None else None)
            if uid in allocator._by_pod:
                allocator._unverified.add(uid)
    allocator._pod_generation = generation


def refresh_pods(allocator: Allocator, cores: int, device_ids: Sequence[str]) -> list[Pod]:
    """The node's pods listed now from the API server; AllocationError(kind="unavailable") naming
    ``device_ids`` and ``cores`` when it cannot be asked. Called with the allocator's lock released."""
    try:
        return allocator._pods.refresh()
    except Exception as exc:
        raise AllocationError(
            f"Allocate for {ids.describe(device_ids)}: no pending pod known on this node needs {cores} "
            f"tencent.com/vcuda-core, and the API server cannot be asked: {plain(exc)}",
            "unavailable",
        ) from exc


def gone_at_server(allocator: Allocator, key: tuple[str, str]) -> bool:
    """Whether the API server, listed now, no longer has ``key``'s pod running or waiting (False when it
    cannot be asked)."""
    try:
        fresh = allocator._pods.refresh()
    except Exception as exc:
        log.warning(
            "cannot ask the API server whether pod %s still exists (%s): its container's Allocate is taken as repeated",
            key[0],
            plain(exc),
        )
        return False
    alive = any(podinfo.uid(p) == key[0] and not podinfo.is_terminated(p) for p in fresh)
    if not alive:
        log.info(
            "pod %s is gone at the API server: the IDs of its container %s, not started, went to another",
            *key,
        )
    return not alive


def started_and_alive(allocator: Allocator, key: tuple[str, str]) -> bool:
    """Whether ``key``'s container has started and the pod cache shows its pod neither ended nor being deleted
    (lock held): an Allocate naming its IDs does not tell that it stopped before the API server is asked."""
    alloc = allocator._allocs.get(key)
    if alloc is None or not alloc.started:
        return False
    pod = allocator._pods.get(key[0])
    return pod is not None and not podinfo.is_terminated(pod) and not podinfo.is_deleting(pod)


def alive_at_server(allocator: Allocator, key: tuple[str, str]) -> bool:
    """Whether the API server, listed now, shows ``key``'s pod neither ended nor being deleted; True when it
    cannot be asked (the container is not known to have stopped). Called with the lock released.

    The kubelet hands out an ID a container holds only once it stops counting that container's pod (the
    pod ended or is being deleted, which the API server shows first but for the kubelet's status lag of a
    pod ending by itself), or once it lost its record of the container: a kubelet restarted without its
    ``kubelet_internal_checkpoint`` (the device-plugin directory removed and made again, the file damaged)
    counts every ID free while the containers run on."""
    try:
        fresh = allocator._pods.refresh()
    except Exception as exc:
        log.warning(
            "cannot ask the API server whether pod %s still runs (%s): its container %s keeps its GPUs",
            key[0],
            plain(exc),
            key[1],
        )
        return True
    return any(podinfo.uid(p) == key[0] and not podinfo.is_terminated(p) and not podinfo.is_deleting(p) for p in fresh)


def refresh_for_room(allocator: Allocator, full: AllocationError) -> list[Pod]:
    """The node's pods listed now, for a request ``full`` refused; that refusal if none can be had."""
    try:
        return allocator._pods.refresh()
    except Exception as exc:
        raise AllocationError(
            f"{full} (the API server could not be asked which pods still hold it: {plain(exc)})", full.kind
        ) from exc


def release_gone_locked(allocator: Allocator, fresh: Sequence[Pod], holders: set[str]) -> bool:
    """Free the pods of ``holders`` that the fresh list ``fresh`` shows gone or finished."""
    alive = {podinfo.uid(p) for p in fresh if not podinfo.is_terminated(p)}
    listed = {podinfo.uid(p) for p in fresh}
    changed = False
    for pod_uid in sorted(holders - alive):
        if pod_uid not in listed and release.kept_for_mirror(allocator, pod_uid, fresh):
            continue
        freed = release.release_locked(allocator, pod_uid)
        if freed:
            log.info("pod %s ended before this node's pod watch told: its GPUs go to the request waiting", pod_uid)
            changed = True
    return changed


def explain_no_match(allocator: Allocator, pods: Sequence[Pod], cores: int) -> str:
    """Why a pod that asks for ``cores`` was not taken, for the error message."""
    if not pods:
        # The kubelet admitted a pod, which the API server does not show bound to this node.
        return (
            "the API server lists no pod at all bound to this node: the agent's node name "
            "(--hostname-override) may not be the kubelet's, or the pod is a static pod whose mirror pod "
            "the kubelet makes only after admitting it"
        )
    for pod in pods:
        if podinfo.phase(pod) != "Pending":
            continue
        try:
            requests = podinfo.gpu_requests(pod)
        except PodSpecError as exc:
            return str(exc)
        for r in requests:
            if r.cores != cores:
                continue
            who = f"pod {podinfo.pod_key(pod)} container {r.name}"
            if not r.gpu_required:
                return f"{who}: a share ({cores} cores) needs tencent.com/vcuda-memory > 0"
            if podinfo.should_delete(pod):
                return f"{who}: the pod already failed to start and is waiting to be deleted"
            if podinfo.is_assigned(pod):
                return f"{who}: the pod is already marked {names.GPU_ASSIGNED}=true"
    return ""


def match_waiting(allocator: Allocator, pods: Sequence[Pod], cores: int) -> Candidate | None:
    """The first container of ``pods`` (a fresh list), in upstream's order, that waits for ``cores``."""
    waiting = (waiting_entry(allocator, pod) for pod in pods)
    return allocator._best([w for w in waiting if w is not None], cores)


def waiting_entry(allocator: Allocator, pod: Pod) -> Waiting | None:
    """The pod as a Waiting one; None when no container of it can be waiting for an Allocate (or
    its object cannot be read: one odd pod must not fail the Allocate of every other)."""
    try:
        return read_waiting(allocator, pod)
    except Exception as exc:
        log.warning(
            "skipping pod %s: its object cannot be read (%s: %s)", podinfo.pod_key(pod), type(exc).__name__, exc
        )
        return None


def read_waiting(allocator: Allocator, pod: Pod) -> Waiting | None:
    """The pod as a Waiting one (pending, not assigned, not being deleted, some container needing GPUs), else
    None; raises what reading an odd pod object raises. Called with the allocator's lock held."""
    if podinfo.phase(pod) != "Pending" or podinfo.is_assigned(pod) or podinfo.should_delete(pod):
        return None
    if podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
        return None
    uid = podinfo.uid(pod)
    try:
        wanted = gpu_containers(allocator, uid, pod)
    except PodSpecError as exc:
        log.warning("skipping pod: %s", exc)
        return None
    if not wanted:
        return None
    meta = pod.get("metadata") or {}
    order = (1, podinfo.predicate_time(pod), str(meta.get("creationTimestamp", "")), podinfo.pod_key(pod))
    return Waiting(uid, pod, tuple(wanted), tuple((uid, r.name) for r in wanted), order)


def best(allocator: Allocator, waiting: Iterable[Waiting], cores: int) -> Candidate | None:
    """The first container that waits for ``cores`` (lock held).

    Pods come first when another of their containers is allocated already, then by predicate
    time, creation time and name; only pods with a container of that size are ordered at all.
    """
    best = best_of(allocator, waiting, cores)
    return Candidate(best[1].pod, best[2]) if best is not None else None


def best_of(
    allocator: Allocator, waiting: Iterable[Waiting], cores: int
) -> tuple[tuple[int, int, str, str], Waiting, GPURequest] | None:
    """(order, pod, container) of :meth:`_best`."""
    best: tuple[tuple[int, int, str, str], Waiting, GPURequest] | None = None
    allocs, retired = allocator._allocs, allocator._retired
    for entry in waiting:
        if len(entry.requests) == 1:  # the common case, without the lists below
            request, key = entry.requests[0], entry.keys[0]
            if request.cores != cores or key in allocs or key in retired:
                continue
            order = entry.order
        else:
            done = [key in allocs or key in retired for key in entry.keys]
            if any(d and key in allocs and allocs[key].started for key, d in zip(entry.keys, done, strict=True)):
                # A container of the pod has started: the kubelet admitted the pod, every Allocate of
                # it came before (a container without a record of its own was handed the IDs of an
                # init container whose answer it got). None of its containers waits.
                continue
            found = next((r for r, d in zip(entry.requests, done, strict=True) if not d and r.cores == cores), None)
            if found is None:
                continue
            request = found
            order = (0, *entry.order[1:]) if any(done) else entry.order
        if best is None or order < best[0]:
            best = (order, entry, request)
    return best


def gpu_containers(allocator: Allocator, uid: str, pod: Pod) -> list[GPURequest]:
    """The containers of pod ``uid`` that need GPUs, in allocation order (cached per pod UID). Called with the
    allocator's lock held."""
    cached = allocator._parsed.get(uid)
    if cached is None:
        cached = podinfo.allocation_order(pod)
        if len(allocator._parsed) > 4096:
            allocator._parsed.clear()
        allocator._parsed[uid] = cached
    return cached
