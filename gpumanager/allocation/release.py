"""The end of pods holding GPUs: which holders are alive, pods kept while they stop (forced deletions) or while a
static pod's mirror pod is gone, pods found in a fresh list of the API server, and freeing a pod's allocations.
The public functions take the allocator's lock themselves; the others are called with it held."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumanager.allocation import (
    freed_unstarted,
    gpu_charges,
)
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    FORCED_STOP_MARGIN_SECONDS,
    MIRROR_GRACE_SECONDS,
    _del,
    _Fresh,
    _mirror_of,
    _put,
    _runs_first,
)
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def release_locked(allocator: Allocator, pod_uid: str) -> list[ContainerAllocation]:
    """Free every allocation of a pod; those freed before their container started are remembered (or handed
    over to a pod waiting with the same request). Returns what was freed. Called with the allocator's lock
    held."""
    freed = []
    repeated = []
    remembered: set[tuple[str, str]] = set()
    for container in sorted(allocator._by_pod.get(pod_uid, ())):
        asked_again = (pod_uid, container) in allocator._repeated
        alloc = allocator._remove((pod_uid, container))
        if alloc is not None:
            allocator._free(alloc)
            freed.append(alloc)
            if asked_again and not alloc.started:
                repeated.append(alloc)
            elif not alloc.started and alloc.device_ids:
                # Perhaps a guess among identical pods: the kubelet may have given the IDs to another;
                # a new Allocate of them forgets this. Its del record keeps it across a restart.
                freed_unstarted.remember_freed(allocator, alloc)
                remembered.add(alloc.key)
    allocator._mirror_gone.pop(pod_uid, None)
    allocator._stopping.pop(pod_uid, None)
    if freed:
        allocator._fresh_only.pop(pod_uid, None)
        allocator._save_or_report([_del(a.key, a if a.key in remembered else None) for a in freed])
        log.info(
            "released pod %s (%s): %s",
            pod_uid,
            freed[0].namespace + "/" + freed[0].pod_name if freed[0].pod_name else "?",
            ", ".join(f"{a.container} on GPUs {list(a.minors)}" for a in freed),
        )
    for alloc in repeated:
        if (
            not freed_unstarted.hand_over(allocator, alloc)
            and alloc.device_ids
            and frozenset(alloc.device_ids) not in allocator._by_ids
        ):
            # No pod waits with its request (another memory size, or the cache not showing it): the pod
            # the kubelet gave the IDs to takes it over when it starts, as any allocation freed unstarted.
            freed_unstarted.remember_freed(allocator, alloc)
            allocator._save_or_report([_del(alloc.key, alloc)])
    return freed


def mark_from_pods(allocator: Allocator) -> None:
    """Give the records that carry neither marker their Init (an ordinary init container, whose charge
    is not summed with the others') and Mirror (a static pod's, which outlives its mirror pods) from the
    pod objects of the complete pod cache (lock held; no network I/O): records rebuilt from the kubelet's
    checkpoint or PodResources, which say neither. A record keyed by a static pod's own UID (the
    kubelet's) is matched to a mirror pod of it by its config hash."""
    allocator._unmarked = False
    pods = allocator._pods.pods()
    by_uid = {podinfo.uid(p): p for p in pods}
    by_hash: dict[str, Pod] = {}
    for p in pods:
        if _mirror_of(p) and not podinfo.is_terminated(p):
            by_hash.setdefault(_mirror_of(p), p)
    changed: list[ContainerAllocation] = []
    for key, alloc in sorted(allocator._allocs.items()):
        if alloc.init or alloc.mirror:
            continue
        pod = by_uid.get(alloc.pod_uid)
        mirror = _mirror_of(pod) if pod is not None else ""
        if pod is None:
            pod = by_hash.get(alloc.pod_uid)
            mirror = alloc.pod_uid if pod is not None else ""
        if pod is None:
            continue
        try:
            init = any(r.name == alloc.container and _runs_first(pod, r) for r in podinfo.init_gpu_requests(pod))
        except PodSpecError:
            init = False
        if not init and not mirror:
            continue
        marked = replace(alloc, init=init, mirror=mirror)
        allocator._allocs[key] = marked
        changed.append(marked)
    if not changed:
        return
    allocator._generation += 1
    gpu_charges.recharge(allocator, {m for a in changed for m in a.minors})
    allocator._save_or_report([_put(a) for a in changed])
    for a in changed:
        log.info(
            "pod %s container %s, rebuilt from the kubelet's records, is %s",
            *a.key,
            " and ".join(
                w for w in ("an init container" if a.init else "", f"static pod {a.mirror}'s" if a.mirror else "") if w
            ),
        )


def is_alive(allocator: Allocator, pod_uid: str) -> bool:
    """Whether a pod holding GPUs may still run: the cache shows it not terminated, or it is stopping, found
    in a fresh list, or a static pod kept while its mirror pod is gone. Called with the allocator's lock held."""
    pod = allocator._pods.get(pod_uid)
    if pod is None:
        return (
            pod_uid in allocator._stopping or is_fresh(allocator, pod_uid) or kept_for_mirror(allocator, pod_uid, None)
        )
    return not podinfo.is_terminated(pod)


def hold_while_stopping(allocator: Allocator, pod: Pod) -> bool:
    """Keep the GPUs of ``pod``, removed from the API server while its containers may still run (a forced
    deletion: the kubelet stops them only after the removal), until :meth:`release_stopped` finds them
    stopped, or for at most its terminationGracePeriodSeconds plus :data:`FORCED_STOP_MARGIN_SECONDS`.
    False when it holds nothing."""
    uid = podinfo.uid(pod)
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    bound = (grace if isinstance(grace, int) and grace >= 0 else 30) + FORCED_STOP_MARGIN_SECONDS
    with allocator._lock:
        if uid not in allocator._by_pod:
            return False
        allocator._stopping.setdefault(uid, time.monotonic() + bound)
    log.info(
        "pod %s was removed while its containers may still run (a forced deletion): its GPUs stay held until "
        "the kubelet has stopped them (at most %g s)",
        podinfo.pod_key(pod),
        bound,
    )
    return True


def stopping(allocator: Allocator) -> list[str]:
    """The pods whose GPUs :meth:`hold_while_stopping` keeps."""
    with allocator._lock:
        return sorted(allocator._stopping)


def release_stopped(allocator: Allocator, stopped: Callable[[str], bool]) -> list[ContainerAllocation]:
    """Free the pods held by :meth:`hold_while_stopping` whose containers ``stopped(uid)`` says are gone
    (asked with the lock released), or whose bound has passed. Returns what was freed."""
    with allocator._lock:
        held = dict(allocator._stopping)
    now = time.monotonic()
    done = {uid for uid, until in held.items() if now >= until}
    for uid in sorted(set(held) - done):
        if stopped(uid):
            done.add(uid)
    for uid in sorted(done):
        if now >= held[uid]:
            log.warning("pod %s, removed while its containers ran, is still not seen stopped: freed", uid)
    freed: list[ContainerAllocation] = []
    with allocator._changing():
        for uid in sorted(done):
            if allocator._stopping.pop(uid, None) is not None:
                freed += release_locked(allocator, uid)
    if freed:
        allocator._notify()
    return freed


def keep_deleted_mirror(allocator: Allocator, pod: Pod) -> bool:
    """Whether the deletion of ``pod`` leaves its GPUs held: a mirror pod whose static pod may still run
    (its status names a container not stopped, or none). The kubelet makes the mirror pod again; the
    GPUs are freed when none shows within :data:`MIRROR_GRACE_SECONDS` or the static pod stops."""
    uid = podinfo.uid(pod)
    if not _mirror_of(pod) or podinfo.phase(pod) in ("Succeeded", "Failed"):
        return False
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if statuses and all("running" not in ((s or {}).get("state") or {}) for s in statuses):
        return False
    with allocator._lock:
        if uid not in allocator._by_pod:
            return False
        allocator._mirror_gone.setdefault(uid, time.monotonic())
    log.info(
        "mirror pod %s of a static pod was deleted while its containers run: its GPUs stay held for the pod "
        "the kubelet makes again",
        podinfo.pod_key(pod),
    )
    return True


def release_static_pod(allocator: Allocator, pod: Pod) -> list[ContainerAllocation]:
    """Free what ``pod``'s static pod holds under the UIDs of its earlier mirror pods (deleted while it
    ran): ``pod``, a mirror pod, has ended. Returns what was freed."""
    config_hash = _mirror_of(pod)
    if not config_hash:
        return []
    uid = podinfo.uid(pod)
    with allocator._changing():
        holders = sorted(
            {a.pod_uid for a in allocator._allocs.values() if a.mirror == config_hash and a.pod_uid != uid}
        )
        freed = [a for holder in holders for a in release_locked(allocator, holder)]
    if freed:
        allocator._notify()
    return freed


def kept_for_mirror(allocator: Allocator, pod_uid: str, pods: Sequence[Pod] | None) -> bool:
    """Whether a holder gone from the pod cache is a static pod that still runs (lock held): a mirror pod
    of the same static pod (the same config hash) is listed, not ended, in ``pods`` (the cache's when
    None); or it went less than :data:`MIRROR_GRACE_SECONDS` ago, and no mirror pod of its name shows
    another static pod (a changed manifest: the kubelet stops the old one)."""
    held = [allocator._allocs[(pod_uid, c)] for c in allocator._by_pod.get(pod_uid, ())]
    hashes = {a.mirror for a in held} - {""}
    if not hashes:
        return False
    listed = allocator._pods.pods() if pods is None else pods
    if any(_mirror_of(p) in hashes and not podinfo.is_terminated(p) for p in listed):
        allocator._mirror_gone.pop(pod_uid, None)
        return True
    names_held = {(a.namespace, a.pod_name) for a in held if a.pod_name}
    if any(_mirror_of(p) and podinfo.namespace_name(p) in names_held for p in listed):
        return False  # replaced by another static pod of that name
    now = time.monotonic()
    since = allocator._mirror_gone.setdefault(pod_uid, now)
    return now - since < MIRROR_GRACE_SECONDS


def note_fresh(allocator: Allocator, pod: Pod) -> None:
    """A pod was allocated from a fresh list: until the cache shows it, its absence there is no end
    (and the fresh list's copy of it says what it is)."""
    uid = podinfo.uid(pod)
    if allocator._pods.get(uid) is None:
        allocator._fresh_only[uid] = _Fresh(time.monotonic(), pod)


def pod_of(allocator: Allocator, uid: str) -> Pod | None:
    """The pod from the cache, else as a fresh list showed it while the cache has not (lock held)."""
    pod = allocator._pods.get(uid)
    if pod is None:
        fresh = allocator._fresh_only.get(uid)
        return fresh.pod if fresh is not None else None
    return pod


def is_fresh(allocator: Allocator, pod_uid: str) -> bool:
    """Whether a holder the cache does not list was found in a fresh list: alive until the cache
    shows it or, past the grace, a list of the API server lacks it (:meth:`recycle`)."""
    return pod_uid in allocator._fresh_only
