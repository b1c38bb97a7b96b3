"""Containers asking for vcuda-memory without vcuda-core: which pending containers of a size ask for memory alone,
kept up to date from the pod cache's changes, and the refusal of a vcuda-memory Allocate that can only be theirs.

A vcuda-memory Allocate the pod cache cannot explain (it shows no pending container asking for that much: the
kubelet's watch showed the pod before ours did) is answered, and its IDs are noted; their PreStartContainer,
when the kubelet's records name the container, looks at that container's spec (:func:`memory_only_owner`).
cached_memory_only, cached_memory_counts and the notes take the allocator's memory lock (not its state lock);
set_memory_asks is called with it held; the others take no lock."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    _MEMORY_ONLY_KEPT,
    RECENT_LIST_SECONDS,
    _has_run,
)
from gpumanager.allocation.pods import Pod, PodSpecError

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)

#: How long the IDs of a vcuda-memory Allocate the pod cache could not explain wait for their start: the
#: kubelet starts an admitted container within seconds, or retries its start for as long as its pod lives.
UNEXPLAINED_SECONDS = 600.0
#: At most this many such notes are kept (the oldest go first).
UNEXPLAINED_KEPT = 256


def memory_only_refusal(allocator: Allocator, blocks: int, device_ids: Sequence[str] = ()) -> str:
    """Why a vcuda-memory Allocate of ``blocks`` IDs is refused, or "" when it is answered.

    The kubelet calls it for every container that asks for vcuda-memory, GPU containers included
    (their memory limit is read from the pod spec at the vcuda-core Allocate). A container asking
    for memory and no vcuda-core gets no GPU at all (upstream answers it with nothing and the
    container starts without a GPU, its memory counted as used by the kubelet), so the call is
    refused when every pending container of this node asking for ``blocks`` asks for no cores: which
    container a call is for is not said, and one that asks for cores as well may be the one. The
    cache's pods are asked first: a size no pending container of the cache asks for is answered as
    before (the kubelet calls this for every container with memory, so a list from the API server on
    each call it cannot place would cost every node's admissions a LIST); a refusal is decided on a
    fresh list from the API server, and the call is answered as before when it cannot be listed. When the
    cache shows no pending container of that size at all (its watch lags), ``device_ids`` are noted for
    their PreStartContainer (:func:`note_unexplained`)."""
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0:
        return ""
    if device_ids:
        renew_noted(allocator, device_ids)
    counts = cached_memory_counts(allocator, blocks)
    if counts is None:
        if device_ids:
            note_unexplained(allocator, blocks, device_ids)
        return ""
    if not (counts[0] == 0 and counts[1] > 0):
        return ""
    try:  # refused only on a fresh list: the cache may not show the pod being admitted yet
        found = pending_memory_only(allocator._pods.refresh(), blocks)
    except Exception as exc:  # the API server's trouble: answered as before
        log.debug("vcuda-memory Allocate of %d blocks: pods not listed: %s", blocks, exc)
        return ""
    if not found:
        return ""
    others = f" (or {', '.join(found[1:4])}{', ...' if len(found) > 4 else ''})" if len(found) > 1 else ""
    return (
        f"{found[0]}{others} asks for {blocks} {names.VMEMORY_RESOURCE} without {names.VCORE_RESOURCE}: "
        f"memory alone gives no GPU (a share asks for both, a whole GPU for {names.VCORE_RESOURCE} in "
        "hundreds)"
    )


def cached_memory_only(allocator: Allocator, blocks: int) -> bool:
    """Whether the pod source shows a pending container asking for ``blocks`` of memory without cores,
    and none of that size asking for cores too (what :func:`pending_memory_only` finds on those pods)."""
    counts = cached_memory_counts(allocator, blocks)
    return counts is not None and counts[0] == 0 and counts[1] > 0


def cached_memory_counts(allocator: Allocator, blocks: int) -> tuple[int, int] | None:
    """How many pending containers the pod source shows asking for ``blocks`` of memory (with cores, without);
    None when it shows none."""
    with allocator._memory_lock:
        generation, changed = allocator._pods.changes(allocator._memory_generation)
        if changed is None:
            # Looked at again from the start should a pod that cannot be read cut this look short.
            allocator._memory_generation = -1
            allocator._memory_asks, allocator._memory_sizes = {}, {}
            for pod in allocator._pods.pods():
                set_memory_asks(allocator, podinfo.uid(pod), pod)
        else:
            for uid in changed:
                set_memory_asks(allocator, uid, allocator._pods.get(uid))
        allocator._memory_generation = generation
        counts = allocator._memory_sizes.get(blocks)
        return (counts[0], counts[1]) if counts is not None else None


def note_unexplained(allocator: Allocator, blocks: int, device_ids: Sequence[str]) -> None:
    """Note the IDs of a vcuda-memory Allocate of ``blocks`` that no pending container of the pod cache asks
    for, for their PreStartContainer (:func:`unexplained_since`). Noted even when a container holding an
    allocation not started yet asks for that much: the memory-only container may be another of its pod's, or
    of a pod admitted after it, which the cache does not show either; the start tells them apart."""
    now = time.monotonic()
    with allocator._memory_lock:
        notes = allocator._memory_unexplained
        notes.pop(frozenset(device_ids), None)
        notes[frozenset(device_ids)] = now
        while notes and (len(notes) > UNEXPLAINED_KEPT or now - next(iter(notes.values())) > UNEXPLAINED_SECONDS):
            del notes[next(iter(notes))]


def unexplained_since(allocator: Allocator, device_ids: Sequence[str]) -> float | None:
    """When the vcuda-memory Allocate of ``device_ids`` reached us, if the pod cache could not explain it. The
    note stays until a start of their container is let through (:func:`settle_unexplained`): the kubelet
    tries a refused start again, perhaps while our watch still lags."""
    if not allocator._memory_unexplained:  # the common case, looked at without the lock
        return None
    with allocator._memory_lock:
        since = allocator._memory_unexplained.get(frozenset(device_ids))
    if since is None or time.monotonic() - since > UNEXPLAINED_SECONDS:
        return None
    return since


def renew_noted(allocator: Allocator, device_ids: Sequence[str]) -> None:
    """The kubelet gives noted IDs to a container again (an app container taking over its init container's,
    or the next pod once the noted one is gone, say after a refused start): the note is dated now, so their
    start is judged on the kubelet's records from this Allocate on, not on those of the time it was made."""
    if not allocator._memory_unexplained:  # the common case, looked at without the lock
        return
    key = frozenset(device_ids)
    with allocator._memory_lock:
        notes = allocator._memory_unexplained
        if notes.pop(key, None) is not None:
            notes[key] = time.monotonic()


def settle_unexplained(allocator: Allocator, device_ids: Sequence[str]) -> None:
    """Forget the note of ``device_ids``: their container's start was let through, its later starts are not
    looked at again."""
    if not allocator._memory_unexplained:
        return
    with allocator._memory_lock:
        allocator._memory_unexplained.pop(frozenset(device_ids), None)


def memory_only_init(allocator: Allocator, pod_uid: str, blocks: int) -> str:
    """The name, for a message, of an init container of pod ``pod_uid`` (not a sidecar) asking for ``blocks``
    of vcuda-memory without vcuda-core that has not run; "" when there is none or the pod is not known.

    The kubelet hands an init container's IDs on to the app containers of its pod, and its records then
    name the app container holding them: a start with those IDs before that init container has run is the
    init container's own (app containers start once every init container has run). The pod is read from
    the cache, else from the last list of the node's pods (sent for an Allocate of this admission); no list
    is asked for."""
    return _unrun_init(allocator, pod_uid, blocks, cored=False)


def init_handing_on(allocator: Allocator, pod_uid: str, blocks: int) -> str:
    """As :func:`memory_only_init`, for an init container asking for vcuda-core as well: the one whose start a
    memory-only app container of its pod (the holder the kubelet's records name) is refused at."""
    return _unrun_init(allocator, pod_uid, blocks, cored=True)


def _unrun_init(allocator: Allocator, pod_uid: str, blocks: int, *, cored: bool) -> str:
    """The first init container of pod ``pod_uid`` (not a sidecar) that has not run and asks for ``blocks`` of
    vcuda-memory, with vcuda-core (``cored``) or without, named for a message; "" when there is none."""
    pod = allocator._pods.get(pod_uid)
    if pod is None:
        listed = allocator._pods.recent(RECENT_LIST_SECONDS, 0.0)
        pod = next((p for p in listed or () if podinfo.uid(p) == pod_uid), None)
    if pod is None or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
        return ""
    try:
        inits = podinfo.init_gpu_requests(pod)
    except PodSpecError:
        return ""
    for r in inits:
        if (
            (r.cores > 0) == cored
            and r.memory_blocks == blocks
            and not podinfo.is_sidecar(pod, r.name)
            and not _has_run(pod, r.name)
        ):
            return f"pod {podinfo.pod_key(pod)} init container {r.name}"
    return ""


def memory_only_owner(allocator: Allocator, owner: tuple[str, str], since: float) -> str:
    """The name, for a message, of container ``owner`` (pod UID, container) when it asks for vcuda-memory
    without vcuda-core and has not run; "" when it holds an allocation, asks for cores, ran
    already, or its pod cannot be found. ``since``: when its vcuda-memory Allocate reached us (a list of the
    node's pods sent since then shows its pod). Called with no lock held: it may list the pods."""
    uid, container = owner
    if allocator.get(uid, container) is not None:
        return ""
    pod = allocator._pods.get(uid)
    if pod is None:
        listed = allocator._pods.recent(RECENT_LIST_SECONDS, since)
        if listed is None:
            try:
                listed = allocator._pods.refresh()
            except Exception as exc:  # the API server's trouble: started as before
                log.warning(
                    "vcuda-memory PreStartContainer of pod %s container %s: its pod cannot be listed (%s); "
                    "started without checking that it asks for vcuda-core too",
                    uid,
                    container,
                    exc,
                )
                return ""
        pod = next((p for p in listed if podinfo.uid(p) == uid), None)
    if pod is None or podinfo.is_terminated(pod) or podinfo.is_deleting(pod) or _has_run(pod, container):
        return ""
    try:
        requests = podinfo.init_gpu_requests(pod) + podinfo.gpu_requests(pod)
    except PodSpecError:
        return ""
    for r in requests:
        if r.name == container:
            return f"pod {podinfo.pod_key(pod)} container {container}" if r.cores <= 0 and r.memory_blocks > 0 else ""
    return ""


def set_memory_asks(allocator: Allocator, uid: str, pod: Pod | None) -> None:
    """Bring the memory sizes one pod's containers ask for up to date (``pod`` None: it is gone)."""
    asks = memory_asks_of(pod, allocator._memory_parsed) if pod is not None else ()
    if pod is None:
        allocator._memory_parsed.pop(uid, None)
    for size, cored in allocator._memory_asks.pop(uid, ()):
        counts = allocator._memory_sizes[size]
        counts[0 if cored else 1] -= 1
        if counts == [0, 0]:
            del allocator._memory_sizes[size]
    if asks:
        allocator._memory_asks[uid] = asks
        for size, cored in asks:
            allocator._memory_sizes.setdefault(size, [0, 0])[0 if cored else 1] += 1


def memory_asks_of(
    pod: Pod, parsed: dict[str, tuple[tuple[int, bool], ...]] | None = None
) -> tuple[tuple[int, bool], ...]:
    """(memory blocks, asks for cores too) of each container of a pending pod that asks for memory.
    ``parsed``: what earlier calls read from pods' specs, by UID (a pod's containers and limits never
    change; most changes a pod goes through are of its status), read and kept there."""
    if podinfo.phase(pod) != "Pending" or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
        return ()
    uid = podinfo.uid(pod) if parsed is not None else ""
    asks = parsed.get(uid) if parsed is not None and uid else None
    if asks is not None:
        return asks
    try:
        requests = podinfo.init_gpu_requests(pod) + podinfo.gpu_requests(pod)
    except PodSpecError:
        asks = ()
    else:
        asks = tuple((r.memory_blocks, r.cores > 0) for r in requests if r.memory_blocks > 0)
    if parsed is not None and uid:
        if len(parsed) >= _MEMORY_ONLY_KEPT:
            parsed.clear()
        parsed[uid] = asks
    return asks


def memory_only_starting(allocator: Allocator, blocks: int) -> dict[tuple[str, str], str]:
    """The containers of this node's pods (as the cache shows them) asking for ``blocks`` of vcuda-memory
    without vcuda-core that have not run yet, by (pod UID, container), each with its name for a message.

    A vcuda-memory Allocate of such a container beside a pending share of the same memory size is
    answered (the call carries only IDs: it may be the share's); its PreStartContainer, whose IDs the
    kubelet's records name, is where it is told apart. Empty (the kubelet is not asked) in the common
    case of no such container. One that ran already (its status names a container ID: answered before
    this check, or by upstream) is left to start again as it did."""
    found: dict[tuple[str, str], str] = {}
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0:
        return found
    known = allocator._memory_only_of
    for pod in allocator._pods.pods():
        uid = podinfo.uid(pod)
        asking = known.get(uid)
        if asking is None:  # a pod's containers never change: read once per pod
            try:
                requests = podinfo.init_gpu_requests(pod) + podinfo.gpu_requests(pod)
            except PodSpecError:
                requests = []
            asking = tuple((r.name, r.memory_blocks) for r in requests if r.cores <= 0 and r.memory_blocks > 0)
            if len(known) >= _MEMORY_ONLY_KEPT:
                known.clear()
            known[uid] = asking
        if not asking or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            continue
        for name, size in asking:
            if size == blocks and not _has_run(pod, name):
                found[(uid, name)] = f"pod {podinfo.pod_key(pod)} container {name}"
    return found


def pending_memory_only(pods: Sequence[Pod], blocks: int) -> list[str] | None:
    """The pending containers asking for ``blocks`` of memory and no cores ([] when one of that size
    asks for cores too), None when no pending container asks for that many."""
    found: list[str] = []
    seen = False
    for pod in pods:
        if podinfo.phase(pod) != "Pending" or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            continue
        try:
            requests = podinfo.init_gpu_requests(pod) + podinfo.gpu_requests(pod)
        except PodSpecError:
            continue
        for r in requests:
            if r.memory_blocks != blocks:
                continue
            seen = True
            if r.cores > 0:
                return []
            found.append(f"pod {podinfo.pod_key(pod)} container {r.name}")
    return found if seen else None
