"""The allocator: one object owns the allocation state and the lock that guards it.

Allocate finds the (pod, container) a kubelet request is for, as gpu-manager
does (the request carries only device IDs), chooses GPUs (gpu-admission's
``predicate-gpu-idx`` when present, else the topology evaluators), occupies
the tree, writes the checkpoint and only then answers. PreStartContainer checks
the kubelet's view of who owns the device IDs against ours and repairs a swap
between two identical requests. Every refusal names the device IDs, the pod,
the container and the reason, and leaves the state as it was.

The lock is held only over the state: a request for a pod the cache has not
seen asks the API server with the lock released, so a hanging API server
never holds up calls for pods the agent knows; and a change's journal record
is staged under the lock but made durable after it is released (group
commit, :mod:`gpumanager.allocation.journal`), so concurrent calls share a
disk flush instead of queueing behind each other's. No answer leaves before
its record is durable; a record that cannot be written undoes its change.

Device IDs come back: the kubelet frees a deleted pod's IDs at once and may
hand the same set to a new container of the same size. The same IDs are a
repeat of an earlier Allocate only while their holder is alive and has not
started; otherwise the old allocation is freed and the request matched anew.

Allocate looks only at what changed: the allocator keeps an index of the pods
that may still wait for GPUs (pending, not assigned, not being deleted) and
of the pods holding GPUs whose end it has not yet checked, both brought up to
date from the pods the cache says changed since the last call
(:meth:`PodSource.changes`). A new list in the cache, or a source that cannot
tell, rebuilds both from every pod; the periodic recycle checks every holder.
A pod found by asking the API server (the cache had not seen it yet) counts
as alive while the cache has not shown it; after :data:`FRESH_LIST_GRACE_SECONDS`
the periodic recycle asks the API server again, and frees it only if it is gone there.
"""

from __future__ import annotations

import heapq
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumanager import deferred, names, safenames
from gpumanager.allocation import checkpoint, ids, journal, records
from gpumanager.allocation import claims as claim_records
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.model import (
    _BATCH_SNAPSHOT,
    _COMPACT_RETRY_MAX,
    _beyond,
    _Changing,
    _claim_del,
    _claim_device_text,
    _claim_put,
    _compat32,
    _del,
    _Detached,
    _document,
    _Fresh,
    _has_run,
    _mirror_of,
    _oserror,
    _request_of,
    _runs_first,
    _same_request,
    _share_key,
    _Subject,
    _Swap,
)
from gpumanager.allocation.model import (
    _FREED_GUESSES_KEPT as _FREED_GUESSES_KEPT,
)
from gpumanager.allocation.model import (
    _MEMORY_ONLY_KEPT as _MEMORY_ONLY_KEPT,
)
from gpumanager.allocation.model import (
    FORCED_STOP_MARGIN_SECONDS as FORCED_STOP_MARGIN_SECONDS,
)
from gpumanager.allocation.model import (
    MIRROR_ANNOTATION as MIRROR_ANNOTATION,
)
from gpumanager.allocation.model import (
    MIRROR_GRACE_SECONDS as MIRROR_GRACE_SECONDS,
)
from gpumanager.allocation.model import (
    AllocationError as AllocationError,
)
from gpumanager.allocation.model import (
    AllocatorSettings as AllocatorSettings,
)
from gpumanager.allocation.model import (
    Candidate as Candidate,
)
from gpumanager.allocation.model import (
    ChangeListener as ChangeListener,
)
from gpumanager.allocation.model import (
    OwnerHint as OwnerHint,
)
from gpumanager.allocation.model import (
    PodSource as PodSource,
)
from gpumanager.allocation.model import (
    Waiting as Waiting,
)
from gpumanager.allocation.model import (
    _put as _put,
)
from gpumanager.allocation.model import (
    _put_text as _put_text,
)
from gpumanager.allocation.pods import GPURequest, Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, ResponseSettings, build_response
from gpumanager.device.types import GPUInfo
from gpumanager.faults import crash_point
from gpumanager.topology import GPUNode, TopologyTree, choose, render_graph

log = logging.getLogger(__name__)


#: How long a pod allocated from a fresh list (the pod cache had not seen it) counts as alive while the cache
#: has still not shown it: the cache's silence about it is its watch lagging, not the pod's end.
FRESH_LIST_GRACE_SECONDS = 60.0


class Allocator:
    """Owns allocation state; all public methods are thread-safe."""

    def __init__(
        self,
        *,
        gpus: Sequence[GPUInfo],
        tree: TopologyTree,
        pods: PodSource,
        settings: AllocatorSettings,
        checkpoint_path: Path,
        share_problem: Callable[[], str] = lambda: "",
    ) -> None:
        self._gpus = list(gpus)
        self._by_minor = {g.minor: g for g in self._gpus}
        self._largest = max((g.memory_total for g in self._gpus), default=0)  # the largest GPU's memory
        self._tree = tree
        self._lock = threading.RLock()
        self._pods = pods
        self._settings = settings
        self._share_problem = share_problem
        self._checkpoint_path = checkpoint_path
        self._store = journal.CheckpointStore(checkpoint_path)
        self._compactor: threading.Thread | None = None
        self._closing = threading.Event()
        #: Checkpoint writes failed (for metrics; :attr:`checkpoint_writes` counts those done).
        self.checkpoint_write_failures = 0
        self._snapshot_writes = 0
        # Journal tickets staged under the lock, made durable when the outermost change releases it.
        self._unsettled: list[int] = []
        self._changing_cm = _Changing(self)  # the lock for a change of state (:meth:`_changing`)
        # The journal ticket of each allocation whose Allocate may not have been answered yet.
        self._unsynced: dict[tuple[str, str], int] = {}
        self._allocs: dict[tuple[str, str], ContainerAllocation] = {}
        self._by_ids: dict[frozenset[str], tuple[str, str]] = {}
        self._responses: dict[tuple[str, str], ContainerResponse] = {}
        self._listeners: list[ChangeListener] = []
        self._compact_wake = threading.Event()  # a change: the compactor looks again
        self._checkpoint_error = ""
        # Containers whose device IDs the kubelet handed to another container: never matched again.
        self._retired: set[tuple[str, str]] = set()
        # Allocations matched while other pods waited with the same request, until PreStartContainer.
        self._guessed: set[tuple[str, str]] = set()
        # Allocations freed before their container started, by their IDs: after a guess among identical
        # pods the kubelet may have given the IDs (and our answer) to another, which PreStartContainer names.
        # (Those of one pod: an init container's IDs handed on to the next container.)
        self._freed_guesses: dict[frozenset[str], list[ContainerAllocation]] = {}
        # The containers answered with each (pod UID, container) directory ``<vm>/<pod uid>/<container>``,
        # which they mount (ContainerAllocation.answered): one each, so that no two share a vcuda.config.
        self._answering: dict[tuple[str, str], set[tuple[str, str]]] = {}
        # Unstarted allocations whose IDs came again in an Allocate answered as a repeat: perhaps the
        # kubelet gave them to another pod after failing this one's admission (see _hand_over).
        self._repeated: set[tuple[str, str]] = set()
        # When the kubelet's Allocate of each allocation's IDs reached us (time.monotonic(); this run's),
        # kept while the IDs are held, whichever container they turn out to be (swaps, records replaced).
        self._asked_at: dict[frozenset[str], float] = {}
        # A pod's containers and limits never change: parse them once per pod.
        self._parsed: dict[str, list[GPURequest]] = {}
        # Per pod UID, its containers asking for vcuda-memory without vcuda-core: (name, blocks).
        self._memory_only_of: dict[str, tuple[tuple[str, int], ...]] = {}
        # The containers of each pod holding an allocation.
        self._by_pod: dict[str, set[str]] = {}
        # The pod source's generation this allocator's view of the pods is up to date with.
        self._pod_generation = -1
        # Pods that may have a container waiting for GPUs, by UID (see Waiting).
        self._waiting: dict[str, Waiting] = {}
        # The same pods in upstream's order, so that Allocate need not look at each: those with one GPU
        # container in a heap per cores asked, (order, push number, entry); the others (few) by UID.
        # A heap entry is dropped when it reaches the top no longer waiting (replaced, gone, its container
        # allocated or retired); a container whose allocation goes is pushed again (_remove).
        self._queues: dict[int, list[tuple[tuple[int, int, str, str], int, Waiting]]] = {}
        self._multi: dict[str, Waiting] = {}
        self._queued = 0  # entries in every heap, stale ones too
        self._pushes = 0
        # Pods holding GPUs whose end has not been checked since they changed (or took their first GPU).
        self._unverified: set[str] = set()
        # Every holder must be checked: the pod source could not say which pods changed.
        self._verify_all = True
        # Holders found in a fresh list that the pod source has not shown yet, and since when.
        self._fresh_only: dict[str, _Fresh] = {}
        # Holders that are static pods whose mirror pod is gone, and since when (see MIRROR_GRACE_SECONDS).
        self._mirror_gone: dict[str, float] = {}
        #: Pods removed from the API server while their containers may still run (a forced deletion):
        #: UID -> the monotonic time after which their GPUs are freed whatever the kubelet shows.
        self._stopping: dict[str, float] = {}
        #: Records were taken over from elsewhere (the kubelet's checkpoint, PodResources) that may lack the
        #: Init and Mirror markers only the pod objects tell: :meth:`_mark_from_pods` sets them.
        self._unmarked = False
        # ResourceClaims prepared on this node (DRA mode), by claim UID.
        self._claims: dict[str, ClaimAllocation] = {}
        # GPUs that recovered records charge beyond their capacity: the tree's counts are floored and
        # capped there, so each release on them recomputes the GPU's charge from what it still holds.
        self._overcommitted: set[int] = set()
        #: The checkpoint read at start had damage (a journal segment, a claim entry, the whole file):
        #: prepared claims may be missing from the state, to be rebuilt from other records.
        self.claims_in_doubt = False
        # Counts changes of the allocations, the claims and the GPUs' descriptions (see generation).
        self._generation = 0
        # What memory_only_refusal looks at, kept up to date from the pod source's changes (only the pods
        # changed are read again; a look at every pod cost each vcuda-memory Allocate 0.1-0.3 ms with 200
        # pods): the memory sizes each pending pod's containers ask for, with whether each asks for cores
        # too, and how many containers ask for each size (with cores, without). Its own lock: the
        # allocator's is held across other calls' work.
        self._memory_lock = threading.Lock()
        self._memory_generation = -1
        self._memory_asks: dict[str, tuple[tuple[int, bool], ...]] = {}
        self._memory_sizes: dict[int, list[int]] = {}
        # The checkpoint on disk has been loaded into the state (:meth:`load`).
        self._loaded = False

    # -- queries ----------------------------------------------------------------------------------

    def add_listener(self, listener: ChangeListener) -> None:
        """Called (outside the lock) after every change of the allocation state."""
        self._listeners.append(listener)

    @property
    def generation(self) -> int:
        """A number that changes with every change of the allocations, the prepared claims or a GPU's
        description: a reader that saw the same number before has nothing new to read. Read it before the
        state it goes with (a change in between makes the next reading differ, never the same)."""
        return self._generation

    def allocations(self) -> list[ContainerAllocation]:
        """Every allocation, ordered by pod and container.

        Records are frozen and replaced to change, so they are handed out as they are: only the
        references are taken under the lock, and sorted outside it (with 250 it held up every
        Allocate; copying each record cost the pids.config refresh and each pod deletion 2-3 ms).
        """
        with self._lock:
            held = list(self._allocs.values())
        held.sort(key=lambda a: a.key)
        return held

    def allocations_of(self, pod_uid: str) -> list[ContainerAllocation]:
        """One pod's allocations."""
        with self._lock:
            return [self._allocs[(pod_uid, c)] for c in sorted(self._by_pod.get(pod_uid, ()))]

    def get(self, pod_uid: str, container: str) -> ContainerAllocation | None:
        """One container's allocation."""
        with self._lock:
            return self._allocs.get((pod_uid, container))

    def holder_of(self, device_ids: Sequence[str]) -> tuple[str, str] | None:
        """(namespace, pod name) of the allocation recorded for exactly these device IDs; None also when
        that allocation was a guess among pods waiting with the same request (nothing to ask first)."""
        return self.owner_hint(device_ids).pod

    def owner_hint(self, device_ids: Sequence[str]) -> OwnerHint:
        """What PreStartContainer's look-up of the kubelet's holder of ``device_ids`` can start from."""
        with self._lock:
            key = self._by_ids.get(frozenset(device_ids))
            if key is None:
                return OwnerHint(None, None)
            alloc = self._allocs.get(key) if key not in self._guessed else None
            pod = (alloc.namespace, alloc.pod_name) if alloc is not None and alloc.pod_name else None
            return OwnerHint(pod, self._asked_at.get(frozenset(device_ids)))

    def response_of(self, pod_uid: str, container: str) -> ContainerResponse | None:
        """The Allocate answer a container was given (rebuilt after a restart)."""
        with self._lock:
            return self._response((pod_uid, container))

    def _response(self, key: tuple[str, str], pod: Pod | None = None) -> ContainerResponse | None:
        """``key``'s answer (lock held), made once: from ``pod``, the pod object it was allocated from,
        else the cache's (or a fresh list's, until the cache shows it)."""
        alloc = self._allocs.get(key)
        if alloc is None:
            return None
        cached = self._responses.get(key)
        if cached is None:
            if pod is None:
                pod = self._pod(alloc.pod_uid)
            cached = build_response(alloc, self._gpus, self._settings.response, compat32=_compat32(pod, alloc))
            self._responses[key] = cached
        return cached

    def set_response_settings(self, response: ResponseSettings) -> None:
        """Answers from now on use these node-wide settings (e.g. the driver mirror's paths once built)."""
        with self._lock:
            self._settings = replace(self._settings, response=response)
            self._responses.clear()

    # -- the topology tree (guarded by the same lock) --------------------------------------------

    def tree_snapshot(self) -> list[tuple[int, int, int, int, int]]:
        """(index, allocatable cores, allocatable bytes, total bytes, 1 if entirely free) per GPU."""
        with self._lock:
            return [
                (leaf.index, leaf.allocatable_cores, leaf.allocatable_memory, leaf.total_memory, int(leaf.available))
                for leaf in self._tree.leaves
            ]

    def charged_beyond_capacity(self) -> dict[int, tuple[int, int]]:
        """GPU index -> (cores, bytes) its holders hold, for each GPU charged beyond its capacity (a GPU
        with less memory after a restart): the tree's figures stop at the capacity and would hide it."""
        with self._lock:
            out: dict[int, tuple[int, int]] = {}
            for minor, charges in self._charges(self._overcommitted).items():
                gpu = self._by_minor.get(minor)
                if gpu is None or not charges:
                    continue
                whole = any(c >= names.HUNDRED_CORES for c, _ in charges)
                cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
                memory = sum(m for c, m in charges if c < names.HUNDRED_CORES)
                out[gpu.index] = (cores, memory + (gpu.memory_total if whole else 0))
            return out

    def clone_tree(self) -> TopologyTree:
        """A copy of the tree to try choices on."""
        with self._lock:
            return self._tree.clone()

    def replace_gpu(self, info: GPUInfo) -> None:
        """Use GPU ``info.index`` as NVML describes it now (its minor, UUID and memory were a guess)."""
        with self._lock:
            self._gpus = [info if g.index == info.index else g for g in self._gpus]
            self._by_minor = {g.minor: g for g in self._gpus}
            self._largest = max((g.memory_total for g in self._gpus), default=0)
            self._generation += 1
            self._tree.replace_info(info)
            self._responses.clear()

    def set_healthy(self, index: int, healthy: bool) -> None:
        """Take a GPU out of the evaluators' reach (or bring it back); its accounting stays."""
        with self._lock:
            self._tree.set_healthy(index, healthy)

    def graph(self, usages: Mapping[int, tuple[Sequence[int], int]]) -> str:
        """The tree in PrintGraph form, with each GPU's (pids, used memory) as given.

        The usage goes into a copy of the tree, never into the one placements are decided on: the
        evaluators' process-count key would otherwise follow whatever an earlier request of the graph
        happened to see (a process long gone), and the same allocations would place differently
        depending on when someone last looked."""
        with self._lock:
            shown = self._tree.clone()
        for index, (pids, used) in usages.items():
            shown.update_usage(index, list(pids), used)
        return render_graph(shown)

    # -- Allocate ---------------------------------------------------------------------------------

    def preview(self, cores: int) -> list[int] | None:
        """The GPU indices the next Allocate of ``cores`` vcuda-core would place on, changing nothing:
        the container the cache says waits first for that many, placed as Allocate places it (its
        ``predicate-gpu-idx``, else the evaluators with its memory). None when no known container
        waits for that many or its Allocate would be refused."""
        if isinstance(cores, bool) or not isinstance(cores, int) or cores <= 0:
            return None
        with self._lock:
            self._take_pod_changes()
            candidate = self._match_cached(cores)
            if candidate is None:
                return None
            try:
                decided = self._decide(candidate, ())
                return [self._tree.leaf_by_minor(m).index for m in decided.minors]
            except (AllocationError, ValueError):
                return None

    def memory_only_refusal(self, blocks: int) -> str:
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
        fresh list from the API server, and the call is answered as before when it cannot be listed."""
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks <= 0:
            return ""
        if not self._memory_only_cached(blocks):
            return ""
        try:  # refused only on a fresh list: the cache may not show the pod being admitted yet
            found = self._memory_only(self._pods.refresh(), blocks)
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

    def _memory_only_cached(self, blocks: int) -> bool:
        """Whether the pod source shows a pending container asking for ``blocks`` of memory without cores,
        and none of that size asking for cores too (what :meth:`_memory_only` finds on those pods)."""
        with self._memory_lock:
            generation, changed = self._pods.changes(self._memory_generation)
            if changed is None:
                # Looked at again from the start should a pod that cannot be read cut this look short.
                self._memory_generation = -1
                self._memory_asks, self._memory_sizes = {}, {}
                for pod in self._pods.pods():
                    self._set_memory_asks(podinfo.uid(pod), pod)
            else:
                for uid in changed:
                    self._set_memory_asks(uid, self._pods.get(uid))
            self._memory_generation = generation
            counts = self._memory_sizes.get(blocks)
            return counts is not None and counts[0] == 0 and counts[1] > 0

    def _set_memory_asks(self, uid: str, pod: Pod | None) -> None:
        """Bring the memory sizes one pod's containers ask for up to date (``pod`` None: it is gone)."""
        asks = self._memory_asks_of(pod) if pod is not None else ()
        for size, cored in self._memory_asks.pop(uid, ()):
            counts = self._memory_sizes[size]
            counts[0 if cored else 1] -= 1
            if counts == [0, 0]:
                del self._memory_sizes[size]
        if asks:
            self._memory_asks[uid] = asks
            for size, cored in asks:
                self._memory_sizes.setdefault(size, [0, 0])[0 if cored else 1] += 1

    @staticmethod
    def _memory_asks_of(pod: Pod) -> tuple[tuple[int, bool], ...]:
        """(memory blocks, asks for cores too) of each container of a pending pod that asks for memory."""
        if podinfo.phase(pod) != "Pending" or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            return ()
        try:
            requests = podinfo.init_gpu_requests(pod) + podinfo.gpu_requests(pod)
        except PodSpecError:
            return ()
        return tuple((r.memory_blocks, r.cores > 0) for r in requests if r.memory_blocks > 0)

    def memory_only_starting(self, blocks: int) -> dict[tuple[str, str], str]:
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
        known = self._memory_only_of
        for pod in self._pods.pods():
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

    @staticmethod
    def _memory_only(pods: Sequence[Pod], blocks: int) -> list[str] | None:
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

    def allocate(self, device_ids: Sequence[str]) -> ContainerResponse:
        """Answer one kubelet Allocate for ``device_ids`` (vcuda-core IDs, already validated)."""
        received = time.monotonic()
        cores = len(device_ids)
        if cores == 0:
            raise AllocationError("Allocate for tencent.com/vcuda-core carried no device IDs")
        wanted = frozenset(device_ids)
        if len(wanted) != cores:  # some ID twice: which one, for the message
            doubled = ids.duplicates(device_ids)
            raise AllocationError(
                f"Allocate for {ids.describe(device_ids)}: device ID {doubled[0]} appears more than once"
            )
        ordered = ids.in_order(device_ids)
        changed = False
        held: _Detached | None = None  # the container that held ``wanted``, until another gets them
        full: AllocationError | None = None  # no room for the cache's candidate
        holders: set[str] = set()  # pods holding GPUs when that was found
        candidate: Candidate | None = None
        try:
            repeat: ContainerResponse | None = None
            # IDs an unstarted container holds, its pod alive in the cache: the kubelet repeating that
            # container's Allocate, or giving the IDs on after failing its pod's admission (a kubelet
            # restart between our answer and its record) before the pod watch tells of the deletion.
            # Only the API server can tell (asked with the lock released; unreachable: a repeat).
            with self._lock:
                # IDs given out again: a guess freed with them no longer tells whose they are. Some of a
                # guess's IDs given out: the kubelet freed them, no container starts with them all.
                self._freed_guesses.pop(wanted, None)
                if self._freed_guesses:
                    for gone in [w for w in self._freed_guesses if not wanted.isdisjoint(w)]:
                        del self._freed_guesses[gone]
                suspect = self._by_ids.get(wanted)
                if suspect is not None:
                    self._take_pod_changes()  # whether a later container of its pod waits for them
                if suspect is not None and (
                    not self._is_repeat(suspect) or self._handed_within_pod(suspect, cores) is not None
                ):
                    suspect = None
            handed_on = suspect is not None and self._gone_at_server(suspect)
            with self._changing():
                known = self._by_ids.get(wanted)
                within = self._handed_within_pod(known, cores) if known is not None else None
                if within is not None and known is not None:
                    try:
                        alloc, response, ticket = self._allocate_locked(
                            within, ordered, self._riding(within, ordered, self._allocs[known])
                        )
                        self._asked_at[wanted] = received
                        candidate = within
                        changed = True
                    except AllocationError as exc:
                        if exc.kind != "exhausted":
                            raise
                        log.warning(
                            "pod %s container %s is handed the IDs of its init container %s but cannot have a "
                            "share of its own beside it (%s): it is given the init container's answer, and "
                            "runs under its limits",
                            podinfo.pod_key(within.pod),
                            within.request.name,
                            known[1],
                            exc,
                        )
                        repeat, ticket = self._response(known), self._unsynced.get(known, 0)
                elif known is not None:
                    if self._is_repeat(known) and not (handed_on and known == suspect):
                        repeat = self._response(known)
                        ticket = self._unsynced.get(known, 0)
                        self._repeated.add(known)
                        # Perhaps the IDs handed on after a failed admission: a List made before this
                        # Allocate may show the container that held them first.
                        self._asked_at[wanted] = received
                    elif handed_on and known == suspect:
                        # Its pod is gone at the API server: none of its containers holds GPUs or
                        # waits for an Allocate any more, whatever the cache still shows.
                        self._take_back(known)
                        self._release_locked(known[0])
                        self._set_waiting(known[0], None)
                        changed = True
                    else:
                        # Given on by the kubelet (its container started or ended), or asked again for
                        # that container: taken back only once another container gets them.
                        held = self._detach(known)
                if repeat is None and within is None:
                    changed |= self._recycle_locked()
                    candidate = self._match_cached(cores)
                    if candidate is not None:
                        try:
                            alloc, response, ticket = self._allocate_taking_back(candidate, ordered, wanted, received)
                            changed = True
                            if candidate.guess:
                                self._guessed.add(alloc.key)
                        except AllocationError as exc:
                            changed = True  # an allocation may have been taken back
                            self._reattach(held)
                            if exc.kind != "exhausted":
                                raise
                            # Perhaps only because this node's pod watch has not yet delivered the end of a
                            # pod the scheduler already counts as gone: ask the API server (lock released).
                            full, holders = exc, set(self._by_pod)
                            candidate = None
                        else:
                            self._retire(held, alloc.key)
                    else:
                        self._reattach(held)
            if repeat is not None and known is not None:
                log.info("repeated Allocate for pod %s container %s: same answer", *known)
                try:
                    self._sync(ticket)  # the first answer's record, which may still be on its way
                except OSError as exc:
                    raise self._unwritten(known, ordered, exc) from exc
                return repeat
            if candidate is None and full is not None:
                fresh = self._refresh_for_room(full)
                with self._changing():
                    changed |= self._release_gone_locked(fresh, holders)
                    found = self._match(fresh, cores)
                    if found is None:  # allocated by a concurrent call meanwhile, or no longer pending
                        raise full
                    candidate = found
                    changed = True  # an allocation may be taken back even if this one fails
                    alloc, response, ticket = self._allocate_instead(held, candidate, ordered, wanted, received)
                    self._note_fresh(candidate.pod)
            elif candidate is None:
                # The cache has not seen the pod yet: ask the API server, with the lock released.
                fresh = self._refresh(cores, ordered)
                with self._changing():
                    found = self._match(fresh, cores)
                    if found is None and held is not None and self._holds_alive(held, fresh):
                        # No container waits for the IDs and their holder runs: the kubelet asks for it again.
                        log.info(
                            "Allocate for %s, held by running pod %s container %s, whom no other container "
                            "waits for: that container's answer again",
                            ids.describe(ordered),
                            *held.alloc.key,
                        )
                        repeat, ticket, known = self._response(held.alloc.key), held.ticket, held.alloc.key
                    elif (
                        found is None
                        and held is None
                        and not self._explain_no_match(fresh, cores)  # no other pod that may be asking
                        and (lost := self._lost_answer(fresh, cores, wanted))
                    ):
                        # The kubelet asks again for a container we answered: it never recorded that answer
                        # (it restarted while the answer was on its way) and re-admits the pod with other IDs.
                        log.warning(
                            "Allocate for %s: no container waits for %d cores, but pod %s container %s, not "
                            "started, holds %s the kubelet does not count (its record of our answer was lost): "
                            "allocated anew, its first answer's GPUs %s freed",
                            ids.describe(ordered),
                            cores,
                            podinfo.pod_key(lost.pod),
                            lost.request.name,
                            ids.describe(self._allocs[(podinfo.uid(lost.pod), lost.request.name)].device_ids),
                            list(self._allocs[(podinfo.uid(lost.pod), lost.request.name)].minors),
                        )
                        candidate = lost
                        changed = True
                        first = self._detach((podinfo.uid(lost.pod), lost.request.name))
                        try:
                            alloc, response, ticket = self._allocate_taking_back(lost, ordered, wanted, received)
                        except AllocationError:
                            self._reattach(first)
                            raise
                        self._retire(first, alloc.key)
                        self._note_fresh(lost.pod)
                    elif found is None:
                        raise AllocationError(
                            f"candidate pod not found for {ids.describe(ordered)} ({cores} tencent.com/vcuda-core): "
                            + (
                                self._explain_no_match(fresh, cores)
                                or "no pending pod on this node has an unallocated container asking for that many"
                            ),
                            "not_found",
                        )
                    else:
                        candidate = found
                        changed = True  # an allocation may be taken back even if this one fails
                        alloc, response, ticket = self._allocate_instead(held, candidate, ordered, wanted, received)
                        self._note_fresh(candidate.pod)
            if repeat is not None and known is not None:
                try:
                    self._sync(ticket)
                except OSError as exc:
                    raise self._unwritten(known, ordered, exc) from exc
                return repeat
            try:
                self._sync_or_undo(ticket, lambda: self._undo_allocation(alloc))
            except OSError as exc:
                raise self._unwritten(alloc.key, alloc.device_ids, exc) from exc
            crash_point("allocate-after-checkpoint")
        finally:
            if changed:
                self._notify()
        assert candidate is not None
        deferred.later(  # once answered: the kubelet does not wait for the log
            log.info,
            "allocated %s container %s: GPUs %s, %d cores, %d MiB",
            podinfo.pod_key(candidate.pod),
            alloc.container,
            list(alloc.minors),
            alloc.cores,
            alloc.memory >> 20,
        )
        return response

    def _allocate_locked(
        self, candidate: Candidate, device_ids: tuple[str, ...], decided: ContainerAllocation | None = None
    ) -> tuple[ContainerAllocation, ContainerResponse, int]:
        """Decide (unless ``decided``) and stage; returns the allocation, its answer and the journal
        ticket to sync before answering."""
        alloc = self._with_free_answer(decided if decided is not None else self._decide(candidate, device_ids))
        ticket = self._commit(alloc)
        # From the candidate's pod: one found in a fresh list is not in the cache yet (its env says compat32).
        response = self._response(alloc.key, candidate.pod)
        assert response is not None
        return alloc, response, ticket

    def _with_free_answer(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """``alloc``, answered with a directory no other container is answered with (lock held).

        Its own, unless a container of another pod took over an answer naming it: PreStartContainer
        found that the kubelet gave the IDs matched to ``alloc``'s container (the first of identical
        waiting pods) to that one, which mounts the directory the answer named. Then the directory of
        that container's own name, which it does not mount; if another took that over too, the next
        one along, as the both-allocated swap leaves them. With one container per name, the chain
        ends at a name nobody is answered with."""
        name = alloc.answered
        seen = {alloc.key}
        while True:
            users = self._answering.get(name, set()) - {alloc.key}
            if not users:
                break
            holder = min(users)
            if holder in seen:  # only where records already shared a name (an older agent's): left as it was
                log.warning(
                    "pod %s container %s: no unused directory found for its answer; answered with %s/%s, "
                    "which pod %s container %s is answered with too",
                    *alloc.key,
                    *alloc.answered,
                    *holder,
                )
                return alloc
            seen.add(holder)
            name = holder
        if name == alloc.answered:
            return alloc
        log.info(
            "pod %s container %s is answered with the directory of pod %s container %s: pod %s container %s, "
            "which started with the IDs first matched to it, mounts its own",
            *alloc.key,
            *name,
            *min(self._answering[alloc.answered]),
        )
        return replace(alloc, answered_as=name)

    def _allocate_taking_back(
        self, candidate: Candidate, device_ids: tuple[str, ...], wanted: frozenset[str], received: float
    ) -> tuple[ContainerAllocation, ContainerResponse, int]:
        """:meth:`_allocate_locked`; where no GPU has room, the containers of other pods that held some of
        ``wanted`` are taken back first (:meth:`_take_back_handed_on`) and it is tried once more. The
        same whether the candidate came from the pod cache or from a fresh list of the API server."""
        try:
            made = self._allocate_locked(candidate, device_ids)
        except AllocationError as exc:
            if exc.kind != "exhausted" or not self._take_back_handed_on(wanted, candidate):
                raise
            made = self._allocate_locked(candidate, device_ids)
        self._asked_at[wanted] = received
        return made

    def _sync_or_undo(self, ticket: int, undo: Callable[[], bool]) -> None:
        """Wait (lock released) until the record of ``ticket`` is durable. When it cannot be written,
        ``undo`` the change under the lock (False: the state has moved on, nothing to undo) and raise
        the OSError. A snapshot taken since the record was staged may hold the change: the state is
        then written again without it (best effort)."""
        try:
            self._sync(ticket)
        except OSError:
            with self._changing():
                if undo() and self._store.switched_since(ticket):
                    self._save_or_report(None)
            raise

    def _undo_allocation(self, alloc: ContainerAllocation) -> bool:
        if self._allocs.get(alloc.key) is not alloc:
            return False
        self._remove(alloc.key)
        self._free(alloc)
        return True

    def _unwritten(self, key: tuple[str, str], device_ids: Sequence[str], exc: OSError) -> AllocationError:
        return AllocationError(
            f"pod {key[0]} container {key[1]} ({ids.describe(device_ids)}): cannot write checkpoint "
            f"{self._checkpoint_path}: {_oserror(exc)}; no new allocation until it can be written",
            "unavailable",
        )

    def _is_repeat(self, key: tuple[str, str]) -> bool:
        """Whether an Allocate naming the IDs held by ``key`` repeats that container's own Allocate."""
        alloc = self._allocs[key]
        if alloc.started:
            return False
        pod = self._pod(key[0])
        if pod is None:
            # Gone from a complete view: the kubelet has freed its IDs. Without one we cannot tell.
            return not self._pods.synced()
        if podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            # Being deleted: the kubelet starts none of its containers any more, and gives its IDs on
            # once it stops counting it (before its status may name a container). A true repeat still
            # gets its answer when no other container waits for the IDs (_holds_alive).
            return False
        return key[1] not in podinfo.started_containers(pod)

    def _handed_within_pod(self, key: tuple[str, str], cores: int) -> Candidate | None:
        """The container of ``key``'s pod the kubelet handed ``key``'s IDs on to (lock held): the next
        container in allocation order, waiting for as many cores, when ``key`` is an init container.
        The kubelet allocates every container of a pod before it starts any, and gives an init
        container's IDs to the next container asking for as many (devicesToReuse)."""
        entry = self._waiting.get(key[0])
        if entry is None and key[0] in self._fresh_only:
            entry = self._waiting_entry(self._fresh_only[key[0]].pod)
        if entry is None or key not in entry.keys:
            return None
        at = entry.keys.index(key)
        if entry.requests[at].index >= 0 or podinfo.is_sidecar(entry.pod, key[1]):
            return None  # not an init container, or one that runs beside the others (its IDs stay its own)
        for request, later in zip(entry.requests[at + 1 :], entry.keys[at + 1 :], strict=True):
            if later in self._allocs or later in self._retired:
                continue
            return Candidate(entry.pod, request) if request.cores == cores else None
        return None

    def _take_back_handed_on(self, wanted: frozenset[str], candidate: Candidate) -> bool:
        """Take back the containers of other pods that held some of ``wanted`` (under the lock).

        The kubelet never hands out an ID a container of an active pod holds: seeing one again in a
        request for another pod means it stopped counting that pod (its containers stopped), even if the
        pod's status does not say so yet. A container of the candidate's own pod (an init container whose
        devices the kubelet reuses) keeps its IDs. True when one was taken back.
        """
        pod_uid = podinfo.uid(candidate.pod)
        handed_on = [
            key
            for key, alloc in self._allocs.items()
            if key[0] != pod_uid and alloc.device_ids and not wanted.isdisjoint(alloc.device_ids)
        ]
        for key in handed_on:
            self._take_back(key)
        return bool(handed_on)

    def _take_back(self, key: tuple[str, str]) -> None:
        """The kubelet gave ``key``'s device IDs to a new container: ``key`` no longer holds them."""
        guessed = key in self._guessed
        alloc = self._remove(key)
        if alloc is None:
            return
        self._free(alloc)
        self._save_or_report([_del(key)])
        self._note_retired(alloc, guessed=guessed)

    def _note_retired(self, alloc: ContainerAllocation, *, guessed: bool = False) -> None:
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
        if len(self._retired) > 4096:
            self._retired.clear()
            self._reindex()  # the containers dropped from the heaps as retired may wait again
        self._retired.add(alloc.key)
        log.info(
            "%s of pod %s container %s come back in a new Allocate: that container has started or ended, so "
            "the kubelet freed them; releasing its GPUs %s and matching the request anew",
            ids.describe(alloc.device_ids),
            alloc.pod_uid,
            alloc.container,
            list(alloc.minors),
        )

    def _detach(self, key: tuple[str, str]) -> _Detached | None:
        """Take ``key``'s allocation out of the state for now (lock held; nothing journaled): its IDs
        came in a new Allocate, and it loses them only once another container gets them
        (:meth:`_retire`); otherwise :meth:`_reattach` puts it back as it was."""
        ticket = self._unsynced.get(key, 0)
        guessed = key in self._guessed
        alloc = self._remove(key)
        if alloc is None:
            return None
        asked = self._asked_at.get(frozenset(alloc.device_ids))
        self._free(alloc)
        self._retired.add(key)  # not matched to itself meanwhile
        return _Detached(alloc, ticket, guessed, asked)

    def _reattach(self, held: _Detached | None) -> None:
        """Put back what :meth:`_detach` took out (lock held), unless the state has moved on."""
        if held is None:
            return
        alloc = held.alloc
        self._retired.discard(alloc.key)
        holder = self._by_ids.get(frozenset(alloc.device_ids)) if alloc.device_ids else None
        if alloc.key in self._allocs or (holder is not None and holder[0] != alloc.pod_uid):
            return
        self._occupy(alloc)
        self._insert(alloc)
        if held.ticket:
            self._unsynced[alloc.key] = held.ticket
        if held.guessed:
            self._guessed.add(alloc.key)
        if held.asked is not None:
            self._asked_at[frozenset(alloc.device_ids)] = held.asked

    def _retire(self, held: _Detached | None, successor: tuple[str, str]) -> None:
        """Another container (``successor``) got the IDs of what :meth:`_detach` took out: the take-back
        is made durable and logged (lock held)."""
        if held is None:
            return
        key = held.alloc.key
        self._retired.discard(key)
        if key == successor:
            return  # the same container, allocated anew: its new record replaces the old one
        self._save_or_report([_del(key)])
        self._note_retired(held.alloc, guessed=held.guessed)

    def _allocate_instead(
        self,
        held: _Detached | None,
        candidate: Candidate,
        device_ids: tuple[str, ...],
        wanted: frozenset[str],
        received: float,
    ) -> tuple[ContainerAllocation, ContainerResponse, int]:
        """:meth:`_allocate_taking_back` after a look at the API server (lock held again): the holder
        of ``wanted`` is taken out again for the attempt (if the state is still as it was), and put
        back if it fails."""
        if held is not None:
            if self._allocs.get(held.alloc.key) is held.alloc:
                self._detach(held.alloc.key)
            else:
                held = None  # released or changed meanwhile
        try:
            made = self._allocate_taking_back(candidate, device_ids, wanted, received)
        except AllocationError:
            self._reattach(held)
            raise
        self._retire(held, made[0].key)
        return made

    def _lost_answer(self, fresh: Sequence[Pod], cores: int, wanted: frozenset[str]) -> Candidate | None:
        """The container whose Allocate the kubelet repeats with other IDs (lock held), when no container
        waits: one of a pending pod in the fresh list, not started, holding an allocation of ``cores``
        cores. The kubelet allocates a container once and keeps its IDs across its restarts; asking again
        means it never recorded our first answer, whose IDs it may hand out again: ``wanted`` may share IDs
        with that container's, never with another's. Not a container of a pod one of whose containers has
        started: the kubelet starts none before it has recorded every answer of the pod. The first such
        container in upstream's order; None when there is none."""
        holders = {key for key, alloc in self._allocs.items() if not wanted.isdisjoint(alloc.device_ids)}
        if len(holders) > 1:
            return None  # IDs of several containers: not one answer the kubelet lost
        best: tuple[tuple[int, str, str, int], Candidate] | None = None
        for pod in fresh:
            try:
                uid = podinfo.uid(pod)
                if uid not in self._by_pod or podinfo.phase(pod) != "Pending":
                    continue
                if any(self._allocs[(uid, c)].started for c in self._by_pod[uid]):
                    continue  # admitted whole before any of its containers started: no answer of it was lost
                if podinfo.is_terminated(pod) or podinfo.is_deleting(pod) or podinfo.should_delete(pod):
                    continue
                started = podinfo.started_containers(pod)
                requests = self._gpu_containers(uid, pod)
                order = (podinfo.predicate_time(pod), str((pod.get("metadata") or {}).get("creationTimestamp", "")))
            except Exception:  # an odd pod object: not this one
                continue
            for at, request in enumerate(requests):
                alloc = self._allocs.get((uid, request.name))
                if alloc is None or alloc.started or request.name in started or request.cores != cores:
                    continue
                if alloc.cores != cores or not alloc.device_ids or (holders and alloc.key not in holders):
                    continue
                rank = (*order, podinfo.pod_key(pod), at)
                if best is None or rank < best[0]:
                    best = (rank, Candidate(pod, request))
        return best[1] if best is not None else None

    def _holds_alive(self, held: _Detached, fresh: Sequence[Pod]) -> bool:
        """Whether ``held`` is still in the state and its pod runs in the fresh list (lock held)."""
        if self._allocs.get(held.alloc.key) is not held.alloc:
            return False
        return any(podinfo.uid(p) == held.alloc.pod_uid and not podinfo.is_terminated(p) for p in fresh)

    def _match_cached(self, cores: int) -> Candidate | None:
        """The candidate among the pods the cache knows, as :meth:`_best` over every waiting pod would
        choose it, from the heap of that size (lock held; the cache's changes taken in just before, by
        :meth:`_recycle_locked`)."""
        queue = self._queues.get(cores)
        allocs, retired, waiting = self._allocs, self._retired, self._waiting
        top: Waiting | None = None
        while queue:
            entry = queue[0][2]
            if waiting.get(entry.uid) is entry and entry.keys[0] not in allocs and entry.keys[0] not in retired:
                top = entry
                break
            heapq.heappop(queue)
            self._queued -= 1
        best = self._best_of(self._multi.values(), cores) if self._multi else None
        guess = top is not None and best is not None
        if not guess and queue is not None:
            for _, _, e in queue:  # another waits with the same request: a loop, not any() over a generator
                if e is not top and waiting.get(e.uid) is e and e.keys[0] not in allocs and e.keys[0] not in retired:
                    guess = True
                    break
        if top is not None and (best is None or top.order < best[0]):
            return Candidate(top.pod, top.requests[0], guess)
        return Candidate(best[1].pod, best[2], guess) if best is not None else None

    def _set_waiting(self, uid: str, entry: Waiting | None) -> None:
        """Record whether a pod waits, in the index and its heaps (lock held)."""
        if entry is None:
            self._waiting.pop(uid, None)
            self._multi.pop(uid, None)
            return
        self._waiting[uid] = entry
        if len(entry.requests) == 1:
            self._multi.pop(uid, None)
            self._push(entry)
        else:
            self._multi[uid] = entry

    def _push(self, entry: Waiting) -> None:
        if self._queued > 2 * len(self._waiting) + 64:
            self._reindex()  # mostly stale entries: start afresh (this one included)
            return
        self._pushes += 1
        self._queued += 1
        heapq.heappush(self._queues.setdefault(entry.requests[0].cores, []), (entry.order, self._pushes, entry))

    def _reindex(self) -> None:
        """Build the heaps and the list of pods with several GPU containers from the index anew."""
        self._queues, self._multi = {}, {}
        for entry in self._waiting.values():
            if len(entry.requests) == 1:
                self._pushes += 1
                self._queues.setdefault(entry.requests[0].cores, []).append((entry.order, self._pushes, entry))
            else:
                self._multi[entry.uid] = entry
        for queue in self._queues.values():
            heapq.heapify(queue)
        self._queued = sum(len(q) for q in self._queues.values())

    def _take_pod_changes(self) -> None:
        """Bring the index of waiting pods, and the list of holders to check, up to date with the pod
        source (lock held): only the pods it says changed, or every pod when it cannot say."""
        generation, changed = self._pods.changes(self._pod_generation)
        if changed is None:
            pods = self._pods.pods()
            waiting = (self._waiting_entry(pod) for pod in pods)
            self._waiting = {w.uid: w for w in waiting if w is not None}
            self._reindex()
            self._verify_all = True
            if self._fresh_only:
                for listed in pods:
                    self._fresh_only.pop(podinfo.uid(listed), None)
        else:
            for uid in changed:
                self._fresh_only.pop(uid, None)  # the cache shows it (or its end) now
                found = self._pods.get(uid)
                self._set_waiting(uid, self._waiting_entry(found) if found is not None else None)
                if uid in self._by_pod:
                    self._unverified.add(uid)
        self._pod_generation = generation

    def _refresh(self, cores: int, device_ids: Sequence[str]) -> list[Pod]:
        try:
            return self._pods.refresh()
        except Exception as exc:
            raise AllocationError(
                f"Allocate for {ids.describe(device_ids)}: no pending pod known on this node needs {cores} "
                f"tencent.com/vcuda-core, and the API server cannot be asked: {exc}",
                "unavailable",
            ) from exc

    def _gone_at_server(self, key: tuple[str, str]) -> bool:
        """Whether the API server, listed now, no longer has ``key``'s pod running or waiting (False when it
        cannot be asked)."""
        try:
            fresh = self._pods.refresh()
        except Exception as exc:
            log.warning(
                "cannot ask the API server whether pod %s still exists (%s): its container's Allocate is taken "
                "as repeated",
                key[0],
                exc,
            )
            return False
        alive = any(podinfo.uid(p) == key[0] and not podinfo.is_terminated(p) for p in fresh)
        if not alive:
            log.info(
                "pod %s is gone at the API server: the IDs of its container %s, not started, went to another",
                *key,
            )
        return not alive

    def _refresh_for_room(self, full: AllocationError) -> list[Pod]:
        """The node's pods listed now, for a request ``full`` refused; that refusal if none can be had."""
        try:
            return self._pods.refresh()
        except Exception as exc:
            raise AllocationError(
                f"{full} (the API server could not be asked which pods still hold it: {exc})", full.kind
            ) from exc

    def _release_gone_locked(self, fresh: Sequence[Pod], holders: set[str]) -> bool:
        """Free the pods of ``holders`` that the fresh list ``fresh`` shows gone or finished."""
        alive = {podinfo.uid(p) for p in fresh if not podinfo.is_terminated(p)}
        listed = {podinfo.uid(p) for p in fresh}
        changed = False
        for pod_uid in sorted(holders - alive):
            if pod_uid not in listed and self._kept_for_mirror(pod_uid, fresh):
                continue
            freed = self._release_locked(pod_uid)
            if freed:
                log.info("pod %s ended before this node's pod watch told: its GPUs go to the request waiting", pod_uid)
                changed = True
        return changed

    def _explain_no_match(self, pods: Sequence[Pod], cores: int) -> str:
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

    def _match(self, pods: Sequence[Pod], cores: int) -> Candidate | None:
        """The first container of ``pods`` (a fresh list), in upstream's order, that waits for ``cores``."""
        waiting = (self._waiting_entry(pod) for pod in pods)
        return self._best([w for w in waiting if w is not None], cores)

    def _waiting_entry(self, pod: Pod) -> Waiting | None:
        """The pod as a Waiting one; None when no container of it can be waiting for an Allocate (or
        its object cannot be read: one odd pod must not fail the Allocate of every other)."""
        try:
            return self._read_waiting(pod)
        except Exception as exc:
            log.warning(
                "skipping pod %s: its object cannot be read (%s: %s)", podinfo.pod_key(pod), type(exc).__name__, exc
            )
            return None

    def _read_waiting(self, pod: Pod) -> Waiting | None:
        if podinfo.phase(pod) != "Pending" or podinfo.is_assigned(pod) or podinfo.should_delete(pod):
            return None
        if podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            return None
        uid = podinfo.uid(pod)
        try:
            wanted = self._gpu_containers(uid, pod)
        except PodSpecError as exc:
            log.warning("skipping pod: %s", exc)
            return None
        if not wanted:
            return None
        meta = pod.get("metadata") or {}
        order = (1, podinfo.predicate_time(pod), str(meta.get("creationTimestamp", "")), podinfo.pod_key(pod))
        return Waiting(uid, pod, tuple(wanted), tuple((uid, r.name) for r in wanted), order)

    def _best(self, waiting: Iterable[Waiting], cores: int) -> Candidate | None:
        """The first container that waits for ``cores`` (lock held).

        Pods come first when another of their containers is allocated already, then by predicate
        time, creation time and name; only pods with a container of that size are ordered at all.
        """
        best = self._best_of(waiting, cores)
        return Candidate(best[1].pod, best[2]) if best is not None else None

    def _best_of(
        self, waiting: Iterable[Waiting], cores: int
    ) -> tuple[tuple[int, int, str, str], Waiting, GPURequest] | None:
        """(order, pod, container) of :meth:`_best`."""
        best: tuple[tuple[int, int, str, str], Waiting, GPURequest] | None = None
        allocs, retired = self._allocs, self._retired
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

    def _gpu_containers(self, uid: str, pod: Pod) -> list[GPURequest]:
        cached = self._parsed.get(uid)
        if cached is None:
            cached = podinfo.allocation_order(pod)
            if len(self._parsed) > 4096:
                self._parsed.clear()
            self._parsed[uid] = cached
        return cached

    def _decide(self, candidate: Candidate, device_ids: tuple[str, ...]) -> ContainerAllocation:
        pod, req = candidate.pod, candidate.request
        who = self._checked(candidate, device_ids)
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
                minors = self._check_predicated(
                    who, predicated, cores, memory, self._lending_inits(self._tree, podinfo.uid(pod))
                )
            except AllocationError as exc:
                if exc.kind != "exhausted" or not self._answer_taken_by_other_pod(podinfo.uid(pod), req.name):
                    raise
                # The kubelet admitted an identical pod first: it got the answer made for this container
                # on the predicated GPUs (swapped at its start) and runs there; the GPUs predicated for it
                # are this pod's room now, or any other.
                log.warning("%s: %s, taken by the identical pod admitted first: choosing by itself", who, exc)
                predicated = None
        if predicated is None:
            uid = podinfo.uid(pod)
            tree = self._tree_without_predicated(pod, req)
            kept = self._without_freed_room(tree, device_ids)
            indices = self._choose_lending(kept, uid, cores, memory, device_ids)
            if indices:
                tree = kept
            elif kept is not tree:  # no room but that of freed allocations: they are likely freed indeed
                indices = self._choose_lending(tree, uid, cores, memory, device_ids)
            if not indices and tree is not self._tree:
                log.warning(
                    "%s: no GPU is left beside those predicated for the pod's other containers; choosing among all",
                    who,
                )
                tree = self._tree
                indices = self._choose_lending(tree, uid, cores, memory, device_ids)
            if not indices:
                raise AllocationError(f"{who}: {self._why_none(cores, memory)}", "exhausted")
            minors = tuple([tree.leaf(i).minor for i in indices])
        return self._allocation(candidate, device_ids, minors)

    def _allocation(
        self, candidate: Candidate, device_ids: tuple[str, ...], minors: tuple[int, ...]
    ) -> ContainerAllocation:
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
        )

    def _riding(
        self, candidate: Candidate, device_ids: tuple[str, ...], init: ContainerAllocation
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
        who = self._checked(candidate, device_ids)
        shared = self._charge_of_group(init, include=True)
        extra = max(0, req.memory_bytes - shared[1])
        for minor in init.minors:
            try:
                leaf = self._tree.leaf_by_minor(minor)
            except (KeyError, ValueError):
                return None
            if not leaf.healthy or (req.cores < names.HUNDRED_CORES and leaf.allocatable_memory < extra):
                return None
        log.info("%s takes its init container %s's place on GPUs %s", who, init.container, list(init.minors))
        return self._allocation(candidate, device_ids, init.minors)

    def _checked(self, candidate: Candidate, device_ids: tuple[str, ...]) -> _Subject:
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
            if not self._settings.share_mode:
                raise AllocationError(f"{who}: {cores} tencent.com/vcuda-core is a share, but --share-mode is off")
            if memory <= 0:
                raise AllocationError(f"{who}: a share ({cores} cores) needs tencent.com/vcuda-memory > 0")
            problem = self._share_problem()
            if problem:
                raise AllocationError(f"{who}: {cores} tencent.com/vcuda-core is a share, but {problem}", "unavailable")
        largest = self._largest
        if cores < names.HUNDRED_CORES and memory > largest:
            raise AllocationError(
                f"{who}: request memory {memory} bytes is larger than any GPU of this node ({largest} bytes)",
                "exhausted",
            )
        return who

    def _without_freed_room(self, tree: TopologyTree, device_ids: Sequence[str]) -> TopologyTree:
        """``tree``, or a copy of it where the allocations freed before their containers started (remembered
        by their IDs) still hold their GPUs' room (lock held).

        Such an allocation may have been a guess among identical pods: the kubelet still counts its IDs
        as the pod's it gave them to, whose start takes it over on the same GPUs (its answer names them).
        Placing another container in that room over-commits the GPU then. It is left while other room
        fits; an Allocate of some of its IDs (``device_ids``) shows the kubelet freed them."""
        if not self._freed_guesses:
            return tree
        given = frozenset(device_ids)
        held: dict[int, tuple[int, int]] = {}
        for wanted, same in self._freed_guesses.items():
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

    def _tree_without_predicated(self, pod: Pod, req: GPURequest) -> TopologyTree:
        """The tree an init container (no predicate annotation names it) chooses from (lock held): the
        GPUs predicated for its pod's containers keep what those will take. The kubelet allocates init
        containers first and they keep their GPUs while the others allocate, so an init container on a
        GPU predicated for another container would make that one's Allocate fail."""
        if req.index >= 0 or not podinfo.predicated_here(pod):
            return self._tree
        held: list[tuple[GPURequest, list[int]]] = []
        for other in podinfo.gpu_containers(pod):
            try:
                minors = podinfo.predicated_gpus(pod, other.index)
            except PodSpecError:
                continue
            if minors:
                held.append((other, minors))
        if not held:
            return self._tree
        scratch = self._tree.clone()
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

    def _answer_taken_by_other_pod(self, pod_uid: str, container: str) -> bool:
        """Whether another pod's container holds the answer made for this one (a swap at its start)."""
        return any(a.answered == (pod_uid, container) and a.pod_uid != pod_uid for a in self._allocs.values())

    def _check_predicated(
        self, who: _Subject, minors: list[int], cores: int, memory: int, tree: TopologyTree
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
                    f"(GPUs: {sorted(self._by_minor)})"
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

    def _why_none(self, cores: int, memory: int) -> str:
        healthy = [leaf for leaf in self._tree.leaves if leaf.healthy]
        if cores < names.HUNDRED_CORES:
            free = ", ".join(
                f"GPU {g.minor}: {g.allocatable_cores} cores/{g.allocatable_memory >> 20} MiB" for g in healthy
            )
            return f"no GPU has {cores} cores and {memory >> 20} MiB free ({free})"
        whole = [leaf.minor for leaf in healthy if leaf.available]
        return f"{cores // names.HUNDRED_CORES} whole GPU(s) needed, entirely free and healthy: {whole}"

    # -- state changes ----------------------------------------------------------------------------

    def _charge_of_group(self, alloc: ContainerAllocation, *, include: bool) -> tuple[int, int]:
        """(cores, memory) the containers of ``alloc``'s pod holding its IDs on its GPUs take together
        (an init container and the container it handed its IDs to: the larger of each), with or
        without ``alloc`` itself; (0, 0) for none."""
        cores, memory = (alloc.cores, alloc.memory) if include else (0, 0)
        if not alloc.device_ids:
            return cores, memory
        share = _share_key(alloc)
        for container in self._by_pod.get(alloc.pod_uid, ()):
            if container == alloc.container:
                continue
            other = self._allocs[(alloc.pod_uid, container)]
            if _share_key(other) == share:
                cores, memory = max(cores, other.cores), max(memory, other.memory)
        return cores, memory

    def _pod_charges(
        self,
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
        members = list(of) if of is not None else [self._allocs[(pod_uid, c)] for c in self._by_pod.get(pod_uid, ())]
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
            gpu = self._by_minor.get(minor)
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

    def _choose_lending(
        self, tree: TopologyTree, pod_uid: str, cores: int, memory: int, device_ids: Sequence[str]
    ) -> list[int]:
        """The GPUs :func:`choose` picks in ``tree`` for a container of ``pod_uid`` given ``device_ids``
        (lock held), the room of its pod's init containers lent to it (:meth:`_lending_inits`) only
        when ``device_ids`` share an ID with theirs.

        The kubelet hands an init container's IDs on to the pod's later containers (each takes what it
        needs of them first): a later container given none of them does not follow that allocation,
        which was then made for another pod (a guess among identical pods: the kubelet admitted the
        other one, which starts with those IDs on those GPUs), and placing it in that room would have it
        run beside that pod on a GPU without room for both."""
        return choose(self._lending_inits(tree, pod_uid, device_ids), cores, memory)

    def _lending_inits(self, tree: TopologyTree, pod_uid: str, device_ids: Sequence[str] = ()) -> TopologyTree:
        """``tree``, or a copy of it without the charge of ``pod_uid``'s init containers beyond its other
        containers (lock held): a later container of the pod may take their place, as they will have
        ended when it starts (the kubelet hands their IDs on). ``device_ids`` (a later container's
        Allocate): ``tree`` itself unless they share an ID with one of those init allocations (one
        recorded without IDs counts as sharing)."""
        held = [self._allocs[(pod_uid, c)] for c in self._by_pod.get(pod_uid, ())]
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
            for charge in self._pod_charges(pod_uid, minor):
                scratch.free(index, *charge)
            for charge in self._pod_charges(pod_uid, minor, lend=True):
                scratch.occupy(index, *charge)
        return scratch

    def _occupy(self, alloc: ContainerAllocation) -> None:
        if not alloc.init and not self._by_pod.get(alloc.pod_uid):
            # The pod's first allocation (the common case): nothing to free before, its own charge after,
            # as :meth:`_pod_charges` would find them.
            for minor in alloc.minors:
                leaf = self._tree.leaf_by_minor(minor)
                self._note_beyond(leaf, alloc.cores, alloc.memory)
                self._tree.occupy(leaf.index, alloc.cores, alloc.memory)
            return
        for minor in alloc.minors:
            leaf = self._tree.leaf_by_minor(minor)
            before = self._pod_charges(alloc.pod_uid, minor)
            after = self._pod_charges(alloc.pod_uid, minor, extra=alloc)
            for charge in before:
                self._tree.free(leaf.index, *charge)
            for charge in after:
                self._note_beyond(leaf, *charge)
                self._tree.occupy(leaf.index, *charge)

    def _note_beyond(self, leaf: GPUNode, cores: int, memory: int) -> None:
        """Remember a GPU about to be charged beyond what it has left (records recovered, put back): its
        counts floor at zero, so releases on it recompute its charge (:meth:`_recharge`)."""
        if cores >= names.HUNDRED_CORES:
            beyond = leaf.allocatable_cores < names.HUNDRED_CORES
        else:
            beyond = cores > leaf.allocatable_cores or memory > leaf.allocatable_memory
        if beyond:
            self._overcommitted.add(leaf.minor)

    def _free(self, alloc: ContainerAllocation) -> None:
        if self._overcommitted.intersection(alloc.minors):
            self._recharge(alloc.minors)
            return
        if self._charge_of_group(alloc, include=False) == (0, 0):
            self._asked_at.pop(frozenset(alloc.device_ids), None)  # the IDs' Allocate is over with
        for minor in alloc.minors:
            try:
                leaf = self._tree.leaf_by_minor(minor)
            except (KeyError, ValueError):
                continue
            for charge in self._pod_charges(alloc.pod_uid, minor, extra=alloc):
                self._tree.free(leaf.index, *charge)
            for charge in self._pod_charges(alloc.pod_uid, minor):
                self._tree.occupy(leaf.index, *charge)

    def _place(self, alloc: ContainerAllocation) -> None:
        """Occupy and record (lock held)."""
        self._occupy(alloc)
        self._insert(alloc)

    def _insert(self, alloc: ContainerAllocation) -> None:
        key = alloc.key
        old = self._allocs.get(key)
        if old is not None:
            self._unanswer(old)
        self._allocs[key] = alloc
        self._answering.setdefault(alloc.answered, set()).add(key)
        self._generation += 1
        containers = self._by_pod.get(alloc.pod_uid)
        if containers is None:
            containers = self._by_pod[alloc.pod_uid] = set()
            self._unverified.add(alloc.pod_uid)  # a new holder: has its pod ended already?
        containers.add(alloc.container)
        if alloc.device_ids:
            wanted = frozenset(alloc.device_ids)
            other = self._by_ids.get(wanted)
            # Containers of one pod may hold the same IDs (an init container's, handed on to the next
            # container): the IDs name the one the kubelet allocated last.
            if other is None or other[0] != alloc.pod_uid or self._rank(key) >= self._rank(other):
                self._by_ids[wanted] = key

    def _remove(self, key: tuple[str, str]) -> ContainerAllocation | None:
        alloc = self._allocs.pop(key, None)
        if alloc is not None:
            self._unanswer(alloc)
        self._guessed.discard(key)
        self._repeated.discard(key)
        self._generation += 1
        waiting = self._waiting.get(key[0]) if alloc is not None else None
        if waiting is not None and len(waiting.requests) == 1 and waiting.keys[0] == key:
            self._push(waiting)  # it may wait again (an allocation undone): back in its heap
        self._responses.pop(key, None)
        self._unsynced.pop(key, None)
        containers = self._by_pod.get(key[0])
        if containers is not None:
            containers.discard(key[1])
            if not containers:
                del self._by_pod[key[0]]
        if alloc is not None and alloc.device_ids:
            wanted = frozenset(alloc.device_ids)
            if self._by_ids.get(wanted) == key:
                del self._by_ids[wanted]
                same = [
                    (key[0], c) for c in containers or () if frozenset(self._allocs[(key[0], c)].device_ids) == wanted
                ]
                if same:
                    self._by_ids[wanted] = max(same, key=self._rank)
        return alloc

    def _unanswer(self, alloc: ContainerAllocation) -> None:
        """Drop ``alloc`` from the containers answered with its directory (lock held)."""
        users = self._answering.get(alloc.answered)
        if users is not None:
            users.discard(alloc.key)
            if not users:
                del self._answering[alloc.answered]

    def _rank(self, key: tuple[str, str]) -> int:
        """Where the kubelet allocates ``key`` among its pod's GPU containers (-1 when unknown)."""
        pod = self._pods.get(key[0])
        if pod is None:
            return -1
        try:
            order = self._gpu_containers(key[0], pod)
        except Exception:
            return -1
        return next((i for i, r in enumerate(order) if r.name == key[1]), -1)

    def holding_same_ids(self, alloc: ContainerAllocation) -> list[ContainerAllocation]:
        """The containers of ``alloc``'s pod holding the same device IDs as it (itself among them): an
        init container's IDs the kubelet handed on to the next container. PreStartContainer names no
        container, so each of them gets its files when one of them starts."""
        with self._lock:
            if not alloc.device_ids:
                return [alloc]
            wanted = frozenset(alloc.device_ids)
            found = [
                self._allocs[(alloc.pod_uid, c)]
                for c in sorted(self._by_pod.get(alloc.pod_uid, ()))
                if frozenset(self._allocs[(alloc.pod_uid, c)].device_ids) == wanted
            ]
            return found or [alloc]

    def _commit(self, alloc: ContainerAllocation) -> int:
        """Occupy, record and stage the journal record; returns its ticket. When it cannot even be
        staged, undo both and refuse."""
        self._occupy(alloc)
        self._insert(alloc)
        crash_point("allocate-before-checkpoint")
        try:
            ticket = self._stage([_put(alloc)], _put_text(alloc))
        except OSError as exc:
            self._remove(alloc.key)
            self._free(alloc)
            raise self._unwritten(alloc.key, alloc.device_ids, exc) from exc
        if ticket:
            self._unsynced[alloc.key] = ticket
        return ticket

    def _document(self) -> dict[str, Any]:
        document = _document(list(self._allocs.values()), list(self._claims.values()))
        if self._freed_guesses:
            document[journal.FREED_KEY] = {
                ",".join(sorted(wanted)): {same[0].pod_uid: {a.container: a.to_json() for a in same}}
                for wanted, same in self._freed_guesses.items()
            }
        return document

    @property
    def checkpoint_writes(self) -> int:
        """Checkpoint writes done: journal records made durable and whole snapshots (for metrics)."""
        return self._snapshot_writes + self._store.durable_records

    def _save(self) -> None:
        """Write the whole state as the snapshot now (under the lock)."""
        self._sync(self._stage(None))

    def _stage(self, changes: list[dict[str, Any]] | None, text: str | None = None) -> int:
        """Under the lock: stage changes as one journal record and return its ticket, to :meth:`_sync`
        (lock released) before answering; or write the whole snapshot now (ticket 0) for ``None``, a
        large batch, or after a failed write. Raises OSError (and remembers why, for /readyz).
        ``text``: the JSON of a single change, when the caller made it (:func:`_put_text`)."""
        if self._checkpoint_error:
            changes = None  # a write failed lately: the whole state must be written before anything else
        try:
            if changes is not None and len(changes) <= _BATCH_SNAPSHOT:
                if not changes:
                    return 0
                try:
                    if len(changes) == 1:
                        return self._store.stage(changes[0], text)
                    return self._store.stage({"batch": changes})
                except journal.NoSegment:
                    pass  # a nearly full disk: the whole state is written instead, now
            seq = self._store.switch()
            self._store.write_snapshot(self._document(), seq)
            self._store.mark_clean()
            self._snapshot_writes += 1
            self._checkpoint_error = ""
            return 0
        except OSError as exc:
            self._write_failed(exc)
            raise

    def _sync(self, ticket: int) -> None:
        """Return once the record of ``ticket`` is durable; OSError (remembered) when it could not be written."""
        if not ticket:
            return
        try:
            self._store.sync(ticket)
        except OSError as exc:
            with self._lock:
                self._write_failed(exc)
            raise

    def _write_failed(self, exc: OSError) -> None:
        self.checkpoint_write_failures += 1
        self._checkpoint_error = f"cannot write checkpoint {self._checkpoint_path}: {_oserror(exc)}"

    def _changing(self) -> _Changing:
        """The lock, for a change of state; once it is released, the journal records staged under it
        (:meth:`_save_or_report`) are made durable, a failure reported."""
        return self._changing_cm

    def _settle(self) -> None:
        """The end of :meth:`_changing` (lock held, released here): the records staged under it are
        made durable once the lock is released."""
        try:
            tickets, self._unsettled = self._unsettled, []
        finally:
            self._lock.release()
        for ticket in tickets:
            try:
                self._sync(ticket)
            except OSError as exc:
                log.error("cannot write checkpoint %s: %s", self._checkpoint_path, exc)

    # -- the snapshot, kept current in the background ----------------------------------------------

    def start_compactor(self, period: float = 0.25, *, idle_check: float = 30.0) -> None:
        """Bring the snapshot up to date a moment after changes stop, off the Allocate path.

        It looks every ``period`` while the journal holds changes the snapshot does not; once the
        snapshot is current it sleeps until the state changes (every change tells its listeners),
        looking every ``idle_check`` seconds in case a change said nothing.
        """
        self.add_listener(self._compact_wake.set)
        self._compactor = threading.Thread(
            target=self._compact_loop, args=(period, idle_check), name="checkpoint", daemon=True
        )
        self._compactor.start()

    def _compact_loop(self, period: float, idle_check: float) -> None:
        retry, reported, reported_at = 0.0, "", 0.0
        while not self._closing.wait(retry or period):
            try:
                if self._checkpoint_error:
                    # A write failed (here or in a call): new allocations wait for the whole state to be
                    # written; written from here as soon as it can be, not at the next call or check.
                    with self._changing():
                        self._stage(None)
                else:
                    self.compact(only_if_due=True)
            except OSError as exc:
                with self._lock:
                    if not self._checkpoint_error:  # from compact(); _stage() counts its own failures
                        self._write_failed(exc)
                    problem = self._checkpoint_error
                # Tried again less and less often (a full disk stays full a while); said once a minute.
                retry = min(_COMPACT_RETRY_MAX, max(period, retry * 2))
                now = time.monotonic()
                if problem != reported or now - reported_at >= 60.0:
                    reported, reported_at = problem, now
                    log.error(
                        "%s: the changes so far stay in the journal, but new allocations are refused until "
                        "the whole checkpoint can be written (tried again every %g s at most)",
                        problem,
                        _COMPACT_RETRY_MAX,
                    )
                continue
            except Exception:
                log.exception("checkpoint compaction failed; trying again")
            retry = 0.0
            with self._lock:
                current = self._store.dirty_since is None and not self._checkpoint_error
            if reported and not self._checkpoint_error:
                log.info("checkpoint %s written again: allocations are taken again", self._checkpoint_path)
                reported = ""
            if current:
                self._compact_wake.wait(idle_check)
            self._compact_wake.clear()

    def compact(self, *, only_if_due: bool = False) -> None:
        """Write the snapshot of the state now (the journal's older segments go), and a spare segment."""
        with self._lock:
            seq = self._store.reserve()
        spare = self._store.make_spare(seq)
        with self._lock:
            self._store.set_spare(spare)
            if only_if_due and not self._store.due():
                return
            # The state as of the switch, encoded after the lock is released (250 entries took a
            # millisecond or two under it): stored allocations and claims are replaced, never changed.
            allocs, claims = list(self._allocs.values()), list(self._claims.values())
            seq = self._store.switch()
            self._store.mark_clean()
        self._store.write_snapshot(_document(allocs, claims), seq)

    def close(self) -> None:
        """Stop the compactor; leave the snapshot current for whoever reads it next (an upgrade too)."""
        self._closing.set()
        self._compact_wake.set()
        try:
            with self._lock:
                if not self._loaded and self._store.exists():
                    # Stopped while the start was still loading the checkpoint: the state in memory is not
                    # the node's; written as the snapshot it would erase every allocation on disk.
                    log.info("stopping before %s was loaded: left as it is", self._checkpoint_path)
                    return
                self._save()
        except OSError as exc:
            log.error(
                "cannot write checkpoint %s at stop: %s (the journal keeps every change)", self._checkpoint_path, exc
            )
        finally:
            with self._lock:
                self._store.close()

    def _notify(self) -> None:
        """Tell the listeners the state changed (once the kubelet's call is answered: they wake threads)."""
        deferred.later(self._tell_listeners)

    def _tell_listeners(self) -> None:
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("allocation listener failed")

    # -- PreStartContainer ------------------------------------------------------------------------

    def pre_start(self, device_ids: Sequence[str], owner: tuple[str, str] | None) -> ContainerAllocation:
        """Check a PreStartContainer against our records; return the container's allocation.

        ``owner`` is the (pod UID, container) the kubelet says holds ``device_ids`` (None when it
        could not be asked). When our record of those IDs belongs to another container with the
        same request, the two are swapped: the kubelet's view wins.
        """
        wanted = frozenset(device_ids)
        changed = False
        try:
            with self._changing():
                key = self._by_ids.get(wanted)
                if owner is not None and key is not None and key != owner and self._same_name(key, owner):
                    # The kubelet names pods, not UIDs: a pod recreated under the same name, the cache
                    # still showing the old one. Our record of these IDs is the pod that got them.
                    owner = key
                elif (
                    owner is not None
                    and key is not None
                    and key[1] == owner[1]
                    and self._allocs[key].mirror == owner[0]
                ):
                    # The kubelet's checkpoint names a static pod by its own UID (the config hash), which
                    # its mirror pod, the one we allocated to, carries as kubernetes.io/config.mirror.
                    owner = key
                if owner is not None:
                    if key is None and owner in self._allocs and not self._allocs[owner].device_ids:
                        key = owner  # recorded without IDs (e.g. by an older gpu-manager)
                    elif owner in self._allocs and frozenset(self._allocs[owner].device_ids) == wanted:
                        key = owner  # containers of one pod holding the same IDs: the kubelet's pick
                    elif key is not None and key[0] == owner[0] and self._freed_for(wanted, owner):
                        # Another container of ``owner``'s pod holds the IDs (handed on), and the record
                        # answered to ``owner`` was freed with the pod it was matched to: ``owner`` mounts
                        # that answer's directory, not the other container's.
                        key, changed = owner, True
                    elif key is not None and key != owner:
                        swaps = [self._swap_of(mine, theirs) for mine, theirs in self._taken_over(key, owner, wanted)]
                        self._weigh(swaps)
                        for swap in swaps:
                            self._reassign(swap)
                        # A record given to the other container is one the kubelet did not give ``owner``:
                        # whose IDs they are is still a guess.
                        self._guessed.update(s.given.key for s in swaps if s.given is not None)
                        key, changed = owner, True
                if key is None and owner is not None and self._take_freed_guess(wanted, owner):
                    key, changed = owner, True
                if key is None:
                    whose = (
                        f"pod {owner[0]} container {owner[1]}"
                        if owner
                        else "a container the kubelet's records do not name"
                    )
                    raise AllocationError(
                        f"{names.PRESTART_FAILED}: no allocation for {ids.describe(device_ids)} "
                        f"(tencent.com/vcuda-core) of {whose}",
                        "not_found",
                    )
                alloc = self._allocs[key]
                if alloc.cores != len(wanted):
                    raise AllocationError(
                        f"{names.PRESTART_FAILED}: pod {alloc.pod_uid} container {alloc.container} was allocated "
                        f"{alloc.cores} cores but starts with {ids.describe(device_ids)} ({len(wanted)} "
                        "tencent.com/vcuda-core)",
                        "mismatch",
                    )
                if not alloc.started and alloc.answered[0] != alloc.pod_uid:
                    alloc = self._own_budget(alloc)
                if not alloc.started and self._overcommitted.intersection(alloc.minors):
                    crowded = self._crowded(alloc)
                    if crowded:
                        raise AllocationError(crowded, "unavailable")
                if not alloc.device_ids or not alloc.started:
                    self._remove(key)
                    alloc = replace(
                        alloc,
                        device_ids=alloc.device_ids or ids.in_order(wanted),
                        started=True,
                    )
                    self._insert(alloc)
                    self._save_or_report([_put(alloc)], _put_text(alloc))
                    changed = True
                return alloc
        finally:
            if changed:
                self._notify()

    def _crowded(self, alloc: ContainerAllocation) -> str:
        """Why ``alloc``'s container cannot start, or '' (lock held): on one of its GPUs, it and the
        containers started there (and the claims prepared there) hold more than the GPU has.

        That happens only after a guess among identical pods (the kubelet's Allocate names no pod, and
        it admits them in its own order): an allocation freed with the pod it was guessed for, its room
        then given to another container, taken over by the pod the kubelet gave its IDs to; or two
        allocations of one GPU each counted as another's; or, of two pods asking for as many cores and
        another memory size, the one whose start swapped the two (:meth:`_reassign`) left the other's
        budget on GPUs without room for it. Its answer named those GPUs, so the container can run on no
        other: its start waits (the kubelet tries it again) until room frees there."""
        for minor in alloc.minors:
            gpu = self._by_minor.get(minor)
            if gpu is None:
                continue
            charges = list(self._pod_charges(alloc.pod_uid, minor, extra=alloc, started_only=True))
            running: list[str] = []
            for uid in sorted({a.pod_uid for a in self._allocs.values() if a.started and minor in a.minors}):
                held = self._pod_charges(uid, minor, started_only=True) if uid != alloc.pod_uid else []
                if held:
                    charges.extend(held)
                    one = self._allocs[(uid, next(iter(self._by_pod[uid])))]
                    running.append(f"{one.namespace}/{one.pod_name}" if one.pod_name else uid)
            for claim in self._claims.values():
                for dev in claim.devices:
                    if dev.consumes and dev.minor == minor:
                        charges.append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
                        running.append(f"claim {claim.uid}")
            wholes = sum(1 for c, _ in charges if c >= names.HUNDRED_CORES)
            cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
            memory = sum(m for c, m in charges if c < names.HUNDRED_CORES) + wholes * gpu.memory_total
            if cores <= names.HUNDRED_CORES and memory <= gpu.memory_total:
                continue
            shown = ", ".join(running[:4]) + (f" and {len(running) - 4} more" if len(running) > 4 else "")
            who = f"{alloc.namespace}/{alloc.pod_name} ({alloc.pod_uid})" if alloc.pod_name else alloc.pod_uid
            asks = (
                "a whole GPU"
                if alloc.cores >= names.HUNDRED_CORES
                else f"{alloc.cores} cores, {alloc.memory >> 20} MiB"
            )
            return (
                f"pod {who} container {alloc.container} cannot start yet: its answer named GPU {gpu.index} "
                f"({gpu.uuid}), where the containers of {shown or 'no pod'} have started; with its {asks} they "
                f"would hold {cores} cores and {memory >> 20} MiB of the GPU's {names.HUNDRED_CORES} cores and "
                f"{gpu.memory_total >> 20} MiB (its IDs were matched to another pod asking for as many cores, "
                "which the kubelet admitted after it; the room there went to others); the kubelet's next try of the "
                "start succeeds once room frees there"
            )
        return ""

    def _own_budget(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """``alloc``, unstarted, answered for another pod's container (a guess, taken over), with the memory
        budget its own pod asks for when that is another for as many cores (lock held): after a restart its
        record came from the kubelet's copy of our answer, which holds the memory of the container the
        answer was made for. Refused (UNAVAILABLE, nothing changed) when its GPUs have no room for more."""
        request = _request_of(self._pods.get(alloc.pod_uid), alloc.container)
        if request is None or request.cores != alloc.cores or request.memory_bytes == alloc.memory:
            return alloc
        made = replace(alloc, memory=request.memory_bytes)
        if made.memory > alloc.memory:
            answered = replace(alloc, pod_uid=alloc.answered[0], container=alloc.answered[1], namespace="", pod_name="")
            short = self._short_of_room(made, answered, {alloc.key: made})
            if short:
                raise AllocationError(short, "unavailable")
        ids_ = frozenset(alloc.device_ids)
        asked = self._asked_at.get(ids_)
        guessed = alloc.key in self._guessed
        self._free(self._remove(alloc.key) or alloc)
        self._place(made)
        if asked is not None:
            self._asked_at[ids_] = asked
        if guessed:
            self._guessed.add(made.key)
        if self._overcommitted.intersection(made.minors):
            self._recharge(made.minors)
        log.info(
            "pod %s container %s starts with the answer made for pod %s container %s: its own memory budget, "
            "%d MiB instead of %d MiB",
            *made.key,
            *alloc.answered,
            made.memory >> 20,
            alloc.memory >> 20,
        )
        return made

    def _short_of_room(
        self,
        taken: ContainerAllocation,
        was: ContainerAllocation,
        replaced: Mapping[tuple[str, str], ContainerAllocation | None],
    ) -> str:
        """Why ``taken``, with a larger memory budget than ``was``, the allocation of the same IDs it takes
        over, would leave one of its GPUs charged beyond what it has once the records of ``replaced``'s keys
        are its values (None: none), counting every other allocation (started or not) and prepared claim
        there; '' when it fits (lock held)."""
        for minor in sorted(set(taken.minors)):
            charges = self._charges_replacing(minor, replaced)
            gpu = self._by_minor.get(minor)
            if gpu is None or not _beyond(charges, gpu.memory_total):
                continue
            wholes = sum(1 for c, _ in charges if c >= names.HUNDRED_CORES)
            cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
            memory = sum(m for c, m in charges if c < names.HUNDRED_CORES) + wholes * gpu.memory_total
            left = max(0, gpu.memory_total - (memory - taken.memory))
            who = f"{taken.namespace}/{taken.pod_name} ({taken.pod_uid})" if taken.pod_name else taken.pod_uid
            other = f"{was.namespace}/{was.pod_name} ({was.pod_uid})" if was.pod_name else was.pod_uid
            return (
                f"pod {who} container {taken.container} cannot start yet: the kubelet gave it "
                f"{ids.describe(taken.device_ids)} ({names.VCORE_RESOURCE}), matched to pod {other} container "
                f"{was.container}, which asks for as many cores and {was.memory >> 20} MiB; their answer named GPU "
                f"{gpu.index} ({gpu.uuid}), where its {taken.memory >> 20} MiB do not fit: {left >> 20} MiB are left "
                f"beside the other allocations there (with it they would hold {cores} cores and {memory >> 20} MiB "
                f"of the GPU's {names.HUNDRED_CORES} cores and {gpu.memory_total >> 20} MiB); the kubelet's next "
                "try of the start succeeds once room frees there (deleting the pod has it placed again)"
            )
        return ""

    def _charges_replacing(
        self, minor: int, replaced: Mapping[tuple[str, str], ContainerAllocation | None]
    ) -> list[tuple[int, int]]:
        """The charges GPU ``minor`` would hold (:meth:`_charges`) were the records of ``replaced``'s keys
        its values (None: none) (lock held)."""
        uids = {a.pod_uid for a in self._allocs.values() if minor in a.minors} | {k[0] for k in replaced}
        out: list[tuple[int, int]] = []
        for uid in sorted(uids):
            members = [self._allocs[(uid, c)] for c in self._by_pod.get(uid, ()) if (uid, c) not in replaced]
            members += [a for k, a in replaced.items() if a is not None and k[0] == uid]
            out.extend(self._pod_charges(uid, minor, of=members))
        for claim in self._claims.values():
            for dev in claim.devices:
                if dev.consumes and dev.minor == minor:
                    out.append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
        return out

    def _take_freed_guess(self, wanted: frozenset[str], owner: tuple[str, str]) -> bool:
        """Whether ``owner``, which the kubelet says starts with ``wanted`` and which has no allocation,
        took over the allocation of a container of an identical pod freed before it started (lock held):
        a guess among identical waiting pods. No Allocate has given the IDs out since, so the kubelet
        gave them, and our answer, to ``owner``: it gets the answer's GPUs and the directory it mounts,
        when both are still free. Several containers of that pod held the IDs (an init container's,
        handed on): each goes to the container of ``owner``'s pod of its name, which got its answer."""
        freed = self._freed_guesses.pop(wanted, None)
        if not freed:
            return False
        pod = self._pods.get(owner[0])
        if pod is None:
            self._freed_guesses[wanted] = freed  # the kubelet's next try of the start may find it
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
        displaced = [self._allocs[target] for _, target in pairs if target in self._allocs]
        if any(d.started or not d.device_ids or frozenset(d.device_ids) == wanted for d in displaced):
            return False
        gone = {d.key for d in displaced}
        if any(not self._can_take_freed(a, target, pod, gone) for a, target in pairs):
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
            short = self._short_of_room(made, alloc, replaced) if made.memory > alloc.memory else ""
            if short:
                self._freed_guesses[wanted] = freed  # nothing changes: the kubelet's next try looks again
                raise AllocationError(short, "unavailable")
        for d in displaced:
            self._free(self._remove(d.key) or d)
        taken: list[ContainerAllocation] = []
        for alloc, made in made_of:
            target = made.key
            try:
                self._place(made)
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
                    self._free(self._remove(done.key) or done)
                for d in displaced:
                    self._place(d)
                return False
            taken.append(made)
        for d in displaced:
            self._remember_freed(d)
            log.info(
                "pod %s container %s starts with other IDs than the %s matched to it (identical pods admitted "
                "in another order than they waited in): those are freed (GPUs %s), remembered by their IDs",
                *d.key,
                ids.describe(d.device_ids),
                list(d.minors),
            )
        self._save_or_report([_del(d.key, d) for d in displaced] + [_put(a) for a in taken])
        for alloc, target in pairs:
            log.info(
                "pod %s container %s starts with %s, matched to pod %s container %s (the first of identical "
                "pods waiting), which was freed before it started: it takes over that allocation (GPUs %s)",
                *target,
                ids.describe(alloc.device_ids),
                *alloc.key,
                list(alloc.minors),
            )
        return owner in self._allocs

    def _freed_for(self, wanted: frozenset[str], owner: tuple[str, str]) -> bool:
        """Whether ``owner``, unallocated, took over (:meth:`_take_freed_guess`) the one allocation of
        ``wanted`` freed before it started, recorded for a container of ``owner``'s name (lock held)."""
        freed = self._freed_guesses.get(wanted, [])
        if owner in self._allocs or len(freed) != 1 or freed[0].container != owner[1]:
            return False
        return self._take_freed_guess(wanted, owner)

    def _can_take_freed(
        self,
        alloc: ContainerAllocation,
        target: tuple[str, str],
        pod: Pod,
        giving_way: set[tuple[str, str]] | None = None,
    ) -> bool:
        """Whether container ``target`` of ``pod``, unallocated (or its record among ``giving_way``) and
        asking for as many cores as ``alloc`` was allocated (the vcuda-core Allocate names no memory), can
        take ``alloc`` over with the directory its answer named, unused but by ``giving_way`` (lock held);
        whether its GPUs have room for its memory budget is weighed apart (:meth:`_short_of_room`)."""
        away = giving_way or set()
        request = _request_of(pod, target[1])
        return (
            (target not in self._allocs or target in away)
            and request is not None
            and request.cores == alloc.cores  # its own memory budget: weighed against the GPUs' room
            and not self._answering.get(alloc.answered, set()) - away
        )

    def _taken_over(
        self, key: tuple[str, str], owner: tuple[str, str], wanted: frozenset[str]
    ) -> list[tuple[tuple[str, str], tuple[str, str]]]:
        """The (our record, kubelet's holder) pairs to swap when the kubelet says ``owner`` holds the IDs
        ``wanted`` we recorded for ``key`` (lock held).

        ``key`` alone, unless several containers of ``key``'s pod hold ``wanted`` (an init container's
        IDs handed on to the next container) and ``owner``'s pod, another, has each of their names:
        the kubelet's records name either of that pod's containers holding the IDs (PreStartContainer
        names no container), and each got the answer of the container of the same name, whose
        directory it mounts. Then every one of them is swapped with the container of its name.

        Likewise when ``key`` alone holds ``wanted`` and several containers of ``owner``'s pod hold the IDs
        recorded for ``owner``: those records go to ``key``'s pod together (:meth:`_handed_back`)."""
        group = sorted(
            c for c in self._by_pod.get(key[0], ()) if frozenset(self._allocs[(key[0], c)].device_ids) == wanted
        )
        pod = self._pods.get(owner[0])
        if owner[0] == key[0] or pod is None:
            return [(key, owner)]
        if len(group) < 2:
            return self._gathered(owner, wanted) or [(key, owner), *self._handed_back(key, owner)]
        if owner[1] not in group or any(_request_of(pod, c) is None for c in group):
            return [(key, owner)]
        return [((key[0], c), (owner[0], c)) for c in group]

    def _gathered(
        self, owner: tuple[str, str], wanted: frozenset[str]
    ) -> list[tuple[tuple[str, str], tuple[str, str]]]:
        """The swaps that bring to ``owner``'s pod every record of ``wanted`` when they lie in several
        other pods, none started (lock held): the answers made for its containers (an init container's IDs
        handed on), split by an earlier swap whose holder pod had fewer containers. Each goes to the
        container of ``owner``'s pod its answer was made for (the name of its directory), else to one left
        asking for as many cores, that container's record (a guess, not started) taking its place. None
        when they lie in one pod, or ``owner``'s pod cannot take them all."""
        holders = sorted(k for k, a in self._allocs.items() if frozenset(a.device_ids) == wanted)
        pod = self._pods.get(owner[0])
        if pod is None or len({k[0] for k in holders}) < 2 or any(k[0] == owner[0] for k in holders):
            return []
        if any(self._allocs[k].started for k in holders):
            return []
        cores = self._allocs[holders[0]].cores
        names_ = [
            r.name
            for r in self._gpu_containers(owner[0], pod)
            if r.cores == cores
            and not ((owner[0], r.name) in self._allocs and self._allocs[(owner[0], r.name)].started)
            and ((owner[0], r.name) not in self._allocs or self._allocs[(owner[0], r.name)].cores == cores)
        ]
        if owner[1] not in names_ or len(names_) < len(holders):
            return []
        targets: dict[tuple[str, str], str] = {}
        for k in holders:
            name = self._allocs[k].answered[1]
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
        return [(k, (owner[0], targets[k])) for k in holders]

    def _handed_back(
        self, key: tuple[str, str], owner: tuple[str, str]
    ) -> list[tuple[tuple[str, str], tuple[str, str]]]:
        """The swaps that go with swapping our record ``key`` and ``owner``'s (another pod's) when other
        containers of ``owner``'s pod hold the IDs recorded for ``owner`` (lock held): its init container's
        IDs handed on, each container with its own answer. The kubelet gave those IDs to one pod, ``key``'s
        by the swap, whose containers mount those answers' directories: each of those records goes to a
        container of ``key``'s pod asking for as many cores (the one of its name, else one left), swapped
        with that container's record, if any (a guess, not started, put where ``owner``'s pod has room).
        None when ``owner`` holds no such group, or ``key``'s pod cannot take all of it: ``key`` and
        ``owner`` alone are swapped then."""
        theirs = self._allocs.get(owner)
        if theirs is None or not theirs.device_ids or theirs.started:
            return []
        held = frozenset(theirs.device_ids)
        others = sorted(
            c
            for c in self._by_pod.get(owner[0], ())
            if c != owner[1] and frozenset(self._allocs[(owner[0], c)].device_ids) == held
        )
        mine = self._pods.get(key[0])
        if not others or mine is None or any(self._allocs[(owner[0], c)].started for c in others):
            return []
        spare = [
            r.name
            for r in self._gpu_containers(key[0], mine)
            if r.name != key[1]
            and r.cores == theirs.cores
            and not ((key[0], r.name) in self._allocs and self._allocs[(key[0], r.name)].started)
            and ((key[0], r.name) not in self._allocs or self._allocs[(key[0], r.name)].cores == theirs.cores)
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
            pairs.append((there, (owner[0], c)) if there in self._allocs else ((owner[0], c), there))
        return pairs

    def _same_name(self, key: tuple[str, str], owner: tuple[str, str]) -> bool:
        """Whether ``owner`` is the same container name of a pod of the same namespace and name as our
        record ``key``, under another UID (lock held)."""
        mine = self._allocs.get(key)
        pod = self._pods.get(owner[0])
        if mine is None or pod is None or key[1] != owner[1] or key[0] == owner[0]:
            return False
        return (mine.namespace, mine.pod_name) == podinfo.namespace_name(pod)

    def _swap_of(self, key: tuple[str, str], owner: tuple[str, str]) -> _Swap:
        """The records a swap of our record ``key`` with the kubelet's holder ``owner`` of its IDs makes
        (lock held; nothing changes); AllocationError when the kubelet's view cannot be taken."""
        mine = self._allocs[key]
        theirs = self._allocs.get(owner)
        if theirs is not None and theirs.started and theirs.device_ids and theirs.device_ids != mine.device_ids:
            raise AllocationError(
                f"{names.PRESTART_FAILED}: the kubelet's records name pod {owner[0]} container {owner[1]} as holding "
                f"{ids.describe(mine.device_ids)}, allocated to pod {key[0]} container {key[1]}, but that container "
                f"has started with {ids.describe(theirs.device_ids)}",
                "mismatch",
            )
        pod = self._pods.get(owner[0])
        request = _request_of(pod, owner[1])  # read once: the check and the record below
        if theirs is None:
            if pod is None:
                raise AllocationError(
                    f"{names.PRESTART_FAILED}: {ids.describe(mine.device_ids)} allocated to pod {key[0]} container "
                    f"{key[1]} are used by pod {owner[0]} container {owner[1]}, which this node's pod cache does not "
                    "know",
                    "mismatch",
                )
            if request is None or request.cores != mine.cores:
                raise AllocationError(
                    f"{names.PRESTART_FAILED}: {ids.describe(mine.device_ids)} allocated to pod {key[0]} container "
                    f"{key[1]} are used by pod {owner[0]} container {owner[1]}, whose request differs",
                    "mismatch",
                )
            budget = request.memory_bytes
        elif theirs.cores != mine.cores:
            raise AllocationError(
                f"{names.PRESTART_FAILED}: pod {owner[0]} container {owner[1]} starts with "
                f"{ids.describe(mine.device_ids)} allocated to pod {key[0]} container {key[1]}, and their requests "
                "differ",
                "mismatch",
            )
        else:
            budget = theirs.memory
        # The same cores, perhaps another memory size: the vcuda-core Allocate carries only core IDs, so a
        # pod admitted before another of its size in cores is matched to the one first in line. Each takes
        # the other's allocation (its GPUs, its answer's directory) with its own memory budget.
        meta = (pod or {}).get("metadata") or {}
        taken = replace(
            mine,
            pod_uid=owner[0],
            container=owner[1],
            namespace=str(meta.get("namespace", "")),
            pod_name=str(meta.get("name", "")),
            container_index=request.index if request else -1,
            answered_as=mine.answered,
            init=pod is not None and request is not None and _runs_first(pod, request),
            mirror=_mirror_of(pod) if pod is not None else "",
            memory=budget,
        )
        given = None
        if theirs is not None:
            # Its start waits, when its budget does not fit there, for room among the containers started on
            # those GPUs (:meth:`_crowded`): its answer named them, the kubelet gave it those IDs.
            given = replace(
                theirs,
                pod_uid=key[0],
                container=key[1],
                namespace=mine.namespace,
                pod_name=mine.pod_name,
                container_index=mine.container_index,
                answered_as=theirs.answered,
                init=mine.init,
                mirror=mine.mirror,
                memory=mine.memory,
            )
        return _Swap(mine, theirs, taken, given)

    def _weigh(self, swaps: Sequence[_Swap]) -> None:
        """Refuse (UNAVAILABLE; nothing changes, the kubelet's next try of the start looks again) swaps
        that would leave a container taking over an allocation with a larger memory budget on GPUs without
        room for it, all of them made (lock held)."""
        replaced: dict[tuple[str, str], ContainerAllocation | None] = {}
        for swap in swaps:
            replaced[swap.mine.key] = swap.given
            replaced[swap.taken.key] = swap.taken
        for swap in swaps:
            if swap.taken.memory > swap.mine.memory:
                short = self._short_of_room(swap.taken, swap.mine, replaced)
                if short:
                    raise AllocationError(short, "unavailable")

    def _reassign(self, swap: _Swap) -> None:
        """Make a swap of :meth:`_swap_of` (lock held)."""
        mine, theirs, taken, given = swap.mine, swap.theirs, swap.taken, swap.given
        key, owner, budget = mine.key, taken.key, taken.memory
        # Removed and put back with their charges: one may leave (or join) a pod's init container's share.
        # When their IDs' Allocate reached us stays known: the IDs are held still.
        asked = {
            ids_: self._asked_at[ids_]
            for a in (mine, theirs)
            if a and (ids_ := frozenset(a.device_ids)) in self._asked_at
        }
        guessed = key in self._guessed
        self._free(self._remove(key) or mine)
        if theirs is not None:
            self._free(self._remove(owner) or theirs)
        self._asked_at.update(asked)
        self._place(taken)
        if given is not None:
            self._place(given)
        touched = set(mine.minors) | set(theirs.minors if theirs is not None else ())
        if self._overcommitted & touched:
            self._recharge(touched)  # charged beyond only for a moment, while one of the two was placed
        # Expected after a guess among identical waiting pods (Allocate does not name the pod), or among pods
        # asking for as many cores (it names no memory): said at INFO; a swap of a match that was not a guess
        # is worth an operator's look.
        log.log(
            logging.INFO if guessed or budget != mine.memory else logging.WARNING,
            "pod %s container %s starts with the devices matched to pod %s container %s; swapping the two%s",
            owner[0],
            owner[1],
            key[0],
            key[1],
            (
                f" (the same cores, {budget >> 20} MiB instead of {mine.memory >> 20} MiB: each takes the other's "
                "GPUs and answer with its own memory budget)"
                if budget != mine.memory
                else ""
            ),
        )
        changes = [_del(key), _del(owner)]
        changes += [_put(self._allocs[k]) for k in (owner, key) if k in self._allocs]
        self._save_or_report(changes)

    # -- release and recovery ---------------------------------------------------------------------

    def release_pod(self, pod_uid: str) -> list[ContainerAllocation]:
        """Free every allocation of a pod; returns what was freed."""
        with self._changing():
            freed = self._release_locked(pod_uid)
        if freed:
            self._notify()
        return freed

    def _release_locked(self, pod_uid: str) -> list[ContainerAllocation]:
        freed = []
        repeated = []
        remembered: set[tuple[str, str]] = set()
        for container in sorted(self._by_pod.get(pod_uid, ())):
            asked_again = (pod_uid, container) in self._repeated
            alloc = self._remove((pod_uid, container))
            if alloc is not None:
                self._free(alloc)
                freed.append(alloc)
                if asked_again and not alloc.started:
                    repeated.append(alloc)
                elif not alloc.started and alloc.device_ids:
                    # Perhaps a guess among identical pods: the kubelet may have given the IDs to another;
                    # a new Allocate of them forgets this. Its del record keeps it across a restart.
                    self._remember_freed(alloc)
                    remembered.add(alloc.key)
        self._mirror_gone.pop(pod_uid, None)
        self._stopping.pop(pod_uid, None)
        if freed:
            self._fresh_only.pop(pod_uid, None)
            self._save_or_report([_del(a.key, a if a.key in remembered else None) for a in freed])
            log.info(
                "released pod %s (%s): %s",
                pod_uid,
                freed[0].namespace + "/" + freed[0].pod_name if freed[0].pod_name else "?",
                ", ".join(f"{a.container} on GPUs {list(a.minors)}" for a in freed),
            )
        for alloc in repeated:
            if not self._hand_over(alloc) and alloc.device_ids and frozenset(alloc.device_ids) not in self._by_ids:
                # No pod waits with its request (another memory size, or the cache not showing it): the pod
                # the kubelet gave the IDs to takes it over when it starts, as any allocation freed unstarted.
                self._remember_freed(alloc)
                self._save_or_report([_del(alloc.key, alloc)])
        return freed

    def _remember_freed(self, alloc: ContainerAllocation) -> None:
        """Remember ``alloc``, freed before its container started, by its IDs (lock held): those of one pod
        per set of IDs (an init container's, handed on), at most :data:`_FREED_GUESSES_KEPT` sets."""
        wanted = frozenset(alloc.device_ids)
        same = self._freed_guesses.get(wanted)
        if same is None or same[0].pod_uid != alloc.pod_uid:
            if len(self._freed_guesses) >= _FREED_GUESSES_KEPT:
                self._freed_guesses.pop(next(iter(self._freed_guesses)))  # the oldest
            same = self._freed_guesses[wanted] = []
        same.append(alloc)

    def _hand_over(self, alloc: ContainerAllocation) -> bool:
        """``alloc``, just released, never started, and its IDs were asked for again: the kubelet gave them
        (and so our answer) to another pod after failing this one's admission, before its status said so.
        The container that waits first with the same request takes the allocation over, its answer
        unchanged (lock held); PreStartContainer, which hears from the kubelet who starts, repairs a wrong
        pick among identical pods as after any guess. Returns whether a container took it over."""
        if not alloc.device_ids or frozenset(alloc.device_ids) in self._by_ids:
            return False
        self._retired.add(alloc.key)  # its pod has ended: never matched again
        self._take_pod_changes()
        candidate = self._match_cached(alloc.cores)
        if candidate is None or podinfo.uid(candidate.pod) == alloc.pod_uid:
            return False
        if candidate.request.memory_bytes != alloc.memory:
            return False
        try:
            taken = replace(self._allocation(candidate, alloc.device_ids, alloc.minors), answered_as=alloc.answered)
            self._place(taken)
        except (KeyError, ValueError) as exc:
            log.warning("cannot hand pod %s container %s's GPUs on: %s", *alloc.key, exc)
            return False
        self._guessed.add(taken.key)
        self._save_or_report([_put(taken)])
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

    def recycle(self) -> list[str]:
        """Free pods that are gone or finished (only with a complete view of the node's pods). A
        holder found by asking the API server that the cache has still not shown after
        :data:`FRESH_LIST_GRACE_SECONDS` is freed only once a list of the API server lacks it."""
        with self._changing():
            before = set(self._by_pod)
            changed = self._recycle_locked(every=True)
            overdue = self._overdue()
        if overdue:
            changed |= self._release_unlisted(overdue)
        with self._lock:
            gone = sorted(before - set(self._by_pod))
        if changed:
            self._notify()
        return gone

    def _overdue(self) -> list[str]:
        """Holders the cache has not shown within the grace since a fresh list found them (lock held)."""
        now = time.monotonic()
        return sorted(
            uid
            for uid, fresh in self._fresh_only.items()
            if now - fresh.since >= FRESH_LIST_GRACE_SECONDS and uid in self._by_pod
        )

    def _release_unlisted(self, overdue: list[str]) -> bool:
        """Ask the API server about the ``overdue`` holders (lock released): free those it no longer
        runs; the others wait another grace for the cache."""
        try:
            fresh = self._pods.refresh()
        except Exception as exc:
            log.warning(
                "pods %s, allocated from the API server's list, are still not in the pod cache, and the API server "
                "cannot be asked whether they run (%s): kept",
                ", ".join(overdue),
                exc,
            )
            return False
        alive = {podinfo.uid(p) for p in fresh if not podinfo.is_terminated(p)}
        changed = False
        with self._changing():
            now = time.monotonic()
            for uid in overdue:
                if uid not in self._fresh_only:
                    continue  # the cache shows it now, or it was released meanwhile
                if uid in alive:
                    log.warning(
                        "pod %s, allocated from the API server's list, is still not in the pod cache after %g s "
                        "(its watch may be stalled); the API server lists it, so it keeps its GPUs",
                        uid,
                        FRESH_LIST_GRACE_SECONDS,
                    )
                    self._fresh_only[uid].since = now
                    continue
                log.info("pod %s, allocated from the API server's list, is gone there before the cache showed it", uid)
                del self._fresh_only[uid]
                changed |= bool(self._release_locked(uid))
        return changed

    def _recycle_locked(self, *, every: bool = False) -> bool:
        """Free the holders whose pods are gone or finished: those changed since the last look, or
        ``every`` one (only with a complete view of the node's pods)."""
        self._take_pod_changes()
        if not self._pods.synced():
            return False  # the holders to check stay listed until the view is complete
        if self._unmarked:
            self._mark_from_pods()
        if every or self._verify_all:
            pods = self._pods.pods()
            active = {podinfo.uid(p) for p in pods if not podinfo.is_terminated(p)}
            ended = {uid for uid in set(self._by_pod) - active if not self._fresh(uid) and uid not in self._stopping}
            if ended:
                listed = {podinfo.uid(p) for p in pods}
                ended = {uid for uid in ended if uid in listed or not self._kept_for_mirror(uid, pods)}
            self._verify_all = False
        else:
            unverified = self._unverified
            ended = {uid for uid in unverified if uid in self._by_pod and not self._alive(uid)} if unverified else set()
        self._unverified.clear()
        changed = False
        for pod_uid in sorted(ended) if ended else ():
            changed |= bool(self._release_locked(pod_uid))
        return changed

    def _mark_from_pods(self) -> None:
        """Give the records that carry neither marker their Init (an ordinary init container, whose charge
        is not summed with the others') and Mirror (a static pod's, which outlives its mirror pods) from the
        pod objects of the complete pod cache (lock held; no network I/O): records rebuilt from the kubelet's
        checkpoint or PodResources, which say neither. A record keyed by a static pod's own UID (the
        kubelet's) is matched to a mirror pod of it by its config hash."""
        self._unmarked = False
        pods = self._pods.pods()
        by_uid = {podinfo.uid(p): p for p in pods}
        by_hash: dict[str, Pod] = {}
        for p in pods:
            if _mirror_of(p) and not podinfo.is_terminated(p):
                by_hash.setdefault(_mirror_of(p), p)
        changed: list[ContainerAllocation] = []
        for key, alloc in sorted(self._allocs.items()):
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
            self._allocs[key] = marked
            changed.append(marked)
        if not changed:
            return
        self._generation += 1
        self._recharge({m for a in changed for m in a.minors})
        self._save_or_report([_put(a) for a in changed])
        for a in changed:
            log.info(
                "pod %s container %s, rebuilt from the kubelet's records, is %s",
                *a.key,
                " and ".join(
                    w
                    for w in ("an init container" if a.init else "", f"static pod {a.mirror}'s" if a.mirror else "")
                    if w
                ),
            )

    def _alive(self, pod_uid: str) -> bool:
        pod = self._pods.get(pod_uid)
        if pod is None:
            return pod_uid in self._stopping or self._fresh(pod_uid) or self._kept_for_mirror(pod_uid, None)
        return not podinfo.is_terminated(pod)

    def hold_while_stopping(self, pod: Pod) -> bool:
        """Keep the GPUs of ``pod``, removed from the API server while its containers may still run (a forced
        deletion: the kubelet stops them only after the removal), until :meth:`release_stopped` finds them
        stopped, or for at most its terminationGracePeriodSeconds plus :data:`FORCED_STOP_MARGIN_SECONDS`.
        False when it holds nothing."""
        uid = podinfo.uid(pod)
        grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
        bound = (grace if isinstance(grace, int) and grace >= 0 else 30) + FORCED_STOP_MARGIN_SECONDS
        with self._lock:
            if uid not in self._by_pod:
                return False
            self._stopping.setdefault(uid, time.monotonic() + bound)
        log.info(
            "pod %s was removed while its containers may still run (a forced deletion): its GPUs stay held until "
            "the kubelet has stopped them (at most %g s)",
            podinfo.pod_key(pod),
            bound,
        )
        return True

    def stopping(self) -> list[str]:
        """The pods whose GPUs :meth:`hold_while_stopping` keeps."""
        with self._lock:
            return sorted(self._stopping)

    def release_stopped(self, stopped: Callable[[str], bool]) -> list[ContainerAllocation]:
        """Free the pods held by :meth:`hold_while_stopping` whose containers ``stopped(uid)`` says are gone
        (asked with the lock released), or whose bound has passed. Returns what was freed."""
        with self._lock:
            held = dict(self._stopping)
        now = time.monotonic()
        done = {uid for uid, until in held.items() if now >= until}
        for uid in sorted(set(held) - done):
            if stopped(uid):
                done.add(uid)
        for uid in sorted(done):
            if now >= held[uid]:
                log.warning("pod %s, removed while its containers ran, is still not seen stopped: freed", uid)
        freed: list[ContainerAllocation] = []
        with self._changing():
            for uid in sorted(done):
                if self._stopping.pop(uid, None) is not None:
                    freed += self._release_locked(uid)
        if freed:
            self._notify()
        return freed

    def keep_deleted_mirror(self, pod: Pod) -> bool:
        """Whether the deletion of ``pod`` leaves its GPUs held: a mirror pod whose static pod may still run
        (its status names a container not stopped, or none). The kubelet makes the mirror pod again; the
        GPUs are freed when none shows within :data:`MIRROR_GRACE_SECONDS` or the static pod stops."""
        uid = podinfo.uid(pod)
        if not _mirror_of(pod) or podinfo.phase(pod) in ("Succeeded", "Failed"):
            return False
        statuses = (pod.get("status") or {}).get("containerStatuses") or []
        if statuses and all("running" not in ((s or {}).get("state") or {}) for s in statuses):
            return False
        with self._lock:
            if uid not in self._by_pod:
                return False
            self._mirror_gone.setdefault(uid, time.monotonic())
        log.info(
            "mirror pod %s of a static pod was deleted while its containers run: its GPUs stay held for the pod "
            "the kubelet makes again",
            podinfo.pod_key(pod),
        )
        return True

    def release_static_pod(self, pod: Pod) -> list[ContainerAllocation]:
        """Free what ``pod``'s static pod holds under the UIDs of its earlier mirror pods (deleted while it
        ran): ``pod``, a mirror pod, has ended. Returns what was freed."""
        config_hash = _mirror_of(pod)
        if not config_hash:
            return []
        uid = podinfo.uid(pod)
        with self._changing():
            holders = sorted({a.pod_uid for a in self._allocs.values() if a.mirror == config_hash and a.pod_uid != uid})
            freed = [a for holder in holders for a in self._release_locked(holder)]
        if freed:
            self._notify()
        return freed

    def _kept_for_mirror(self, pod_uid: str, pods: Sequence[Pod] | None) -> bool:
        """Whether a holder gone from the pod cache is a static pod that still runs (lock held): a mirror pod
        of the same static pod (the same config hash) is listed, not ended, in ``pods`` (the cache's when
        None); or it went less than :data:`MIRROR_GRACE_SECONDS` ago, and no mirror pod of its name shows
        another static pod (a changed manifest: the kubelet stops the old one)."""
        held = [self._allocs[(pod_uid, c)] for c in self._by_pod.get(pod_uid, ())]
        hashes = {a.mirror for a in held} - {""}
        if not hashes:
            return False
        listed = self._pods.pods() if pods is None else pods
        if any(_mirror_of(p) in hashes and not podinfo.is_terminated(p) for p in listed):
            self._mirror_gone.pop(pod_uid, None)
            return True
        names_held = {(a.namespace, a.pod_name) for a in held if a.pod_name}
        if any(_mirror_of(p) and podinfo.namespace_name(p) in names_held for p in listed):
            return False  # replaced by another static pod of that name
        now = time.monotonic()
        since = self._mirror_gone.setdefault(pod_uid, now)
        return now - since < MIRROR_GRACE_SECONDS

    def _note_fresh(self, pod: Pod) -> None:
        """A pod was allocated from a fresh list: until the cache shows it, its absence there is no end
        (and the fresh list's copy of it says what it is)."""
        uid = podinfo.uid(pod)
        if self._pods.get(uid) is None:
            self._fresh_only[uid] = _Fresh(time.monotonic(), pod)

    def _pod(self, uid: str) -> Pod | None:
        """The pod from the cache, else as a fresh list showed it while the cache has not (lock held)."""
        pod = self._pods.get(uid)
        if pod is None:
            fresh = self._fresh_only.get(uid)
            return fresh.pod if fresh is not None else None
        return pod

    def _fresh(self, pod_uid: str) -> bool:
        """Whether a holder the cache does not list was found in a fresh list: alive until the cache
        shows it or, past the grace, a list of the API server lacks it (:meth:`recycle`)."""
        return pod_uid in self._fresh_only

    def load(self) -> records.Parsed:
        """Load our checkpoint and occupy the tree; returns what was taken and what must be rebuilt.
        (Until it has returned or raised AllocationError, :meth:`close` leaves the files on disk as they are.)

        A file that cannot be read or parsed as a whole is moved aside (when it can be) and
        AllocationError(kind="unavailable") is raised: the caller rebuilds everything from the
        kubelet's records. An entry that cannot be trusted (a bad field, a GPU this node does not
        have, an unsafe name) is listed in ``untrusted`` for the caller to rebuild; a missing file
        recovers nothing.
        """
        try:
            parsed = self._load()
        except AllocationError:
            self._loaded = True  # set aside: the state rebuilt from the kubelet's records is the one to write
            raise
        self._loaded = True
        return parsed

    def _load(self) -> records.Parsed:
        try:
            with self._lock:
                loaded = self._store.load()
            data = loaded.document
            if data is None:
                return records.Parsed()
            parsed = records.from_json(data, loaded.origins)
            claims, claim_problems = claim_records.from_json(data)
        except (checkpoint.CheckpointError, records.RecordError) as exc:
            self._set_aside_checkpoint(str(exc))
            raise AllocationError(str(exc), "unavailable") from exc
        except Exception as exc:  # a shape no check foresaw: the same as unreadable, never a failed start
            why = f"checkpoint {self._checkpoint_path} cannot be loaded: {type(exc).__name__}: {exc}"
            log.exception("%s", why)
            self._set_aside_checkpoint(why)
            raise AllocationError(why, "unavailable") from exc
        parsed.problems.extend(loaded.problems)
        parsed.journal_damaged = bool(loaded.problems)
        self.claims_in_doubt = bool(loaded.problems or claim_problems)
        # Claims first, without recording them again: they are on disk as loaded.
        self.adopt_claims(claims, source=str(self._checkpoint_path), save=False)
        taken, refused = self._adopt(parsed.allocations, source=str(self._checkpoint_path))
        self._restore_freed(data)
        if loaded.problems or loaded.unnamed:
            # Segments moved aside held changes (a release too) that are now only in memory; a snapshot
            # naming no segment (upstream's, after an upgrade) would have the next start discard every
            # change journaled over it. The whole state is written at once, before any change.
            with self._changing():
                self._save_or_report()
        parsed.allocations = taken
        parsed.untrusted.extend(a.key for a in refused)
        parsed.problems.extend(claim_problems)
        parsed.problems.extend(
            f"pod {a.pod_uid} container {a.container}: GPU(s) {list(a.minors)} not on this node"
            + (f" (the {loaded.origins[a.key]})" if a.key in loaded.origins else "")
            for a in refused
        )
        return parsed

    def _restore_freed(self, document: Mapping[str, Any]) -> None:
        """The allocations freed before their container started that the checkpoint remembers (a container
        the kubelet gave their IDs and our answer to may take one over at its start), but those some of whose
        IDs an allocation holds: given out again since."""
        found, problems = records.freed_from_json(document, key=journal.FREED_KEY, newest=_FREED_GUESSES_KEPT)
        for problem in problems:
            log.warning("checkpoint %s: %s; not remembered", self._checkpoint_path, problem)
        with self._lock:
            held = {i for a in self._allocs.values() for i in a.device_ids} if found else set()
            for wanted, same in found.items():
                # Some of its IDs held: an Allocate gave them out again since (the kubelet had freed them).
                missing = sorted({m for a in same for m in a.minors} - self._by_minor.keys())
                if held.isdisjoint(wanted) and not missing:
                    self._freed_guesses[wanted] = same
                else:
                    log.info(
                        "checkpoint %s: %s %s: pod %s container %s: %s; not remembered",
                        self._checkpoint_path,
                        journal.FREED_KEY,
                        ids.describe(sorted(wanted)),
                        *same[0].key,
                        f"it names GPU(s) {missing}, which this node does not have"
                        if missing
                        else "an allocation holds some of its IDs (given out again since)",
                    )
        if self._freed_guesses:
            log.info(
                "checkpoint %s remembers %d allocations freed before their containers started",
                self._checkpoint_path,
                len(self._freed_guesses),
            )

    def _set_aside_checkpoint(self, why: str) -> None:
        """Move the snapshot and its journal aside: the caller rebuilds from the kubelet's records, and a
        later start must not replay this journal over the state written from then on. The segments go
        first: a start that dies in between finds the unusable snapshot again (never its journal alone,
        replayed over nothing as if it were the whole state)."""
        with self._lock:
            self._store.set_aside_segments(f"its snapshot is unusable ({why})")
        checkpoint.quarantine(self._checkpoint_path)
        self.claims_in_doubt = True

    def adopt(
        self,
        allocs: Sequence[ContainerAllocation],
        *,
        source: str,
        kubelet_holds: bool = False,
        answered: bool = True,
    ) -> int:
        """Take over allocations recorded elsewhere (our checkpoint, the kubelet's); returns how many.

        Containers we already hold are left as they are; entries naming a GPU this node does not
        have or an unsafe name are refused (and logged).

        ``kubelet_holds``: the kubelet's records say each container holds its device IDs now. An allocation
        made for an identical pod's container (the first in line when the kubelet gave its IDs to this one)
        that has not started, or one freed before its container started, with those very IDs and the same
        request, is what the kubelet gave this container our answer of: it is taken over, never kept
        beside (its GPUs charged twice, its pod holding IDs it never got). ``answered``: each record was
        read from the kubelet's copy of our answer, its GPUs and directory the answer's; otherwise
        (PodResources, which has only the IDs) they come from the allocation taken over.
        """
        taken, refused = self._adopt(allocs, source=source, kubelet_holds=kubelet_holds, answered=answered)
        for alloc in refused:
            log.error(
                "%s: cannot take pod %s container %s: GPU(s) %s not on this node",
                source,
                alloc.pod_uid,
                alloc.container,
                list(alloc.minors),
            )
        return len(taken)

    def _adopt(
        self,
        allocs: Sequence[ContainerAllocation],
        *,
        source: str,
        kubelet_holds: bool = False,
        answered: bool = True,
    ) -> tuple[list[ContainerAllocation], list[ContainerAllocation]]:
        taken: list[ContainerAllocation] = []
        refused: list[ContainerAllocation] = []
        dropped: list[tuple[str, str]] = []  # unstarted allocations taken over
        with self._changing():
            for alloc in allocs:
                if kubelet_holds and alloc.key not in self._allocs:
                    alloc = self._taking_over(alloc, source, answered=answered, dropped=dropped)
                try:
                    safenames.pod_uid(alloc.pod_uid)
                    safenames.container_name(alloc.container)
                except safenames.UnsafeNameError as exc:
                    log.error("%s: refusing pod %s container %s: %s", source, alloc.pod_uid, alloc.container, exc)
                    continue
                if not alloc.minors or any(m not in self._by_minor for m in alloc.minors):
                    refused.append(alloc)
                    continue
                if alloc.key in self._allocs:
                    continue
                self._occupy(alloc)
                self._insert(alloc)
                taken.append(alloc)
                self._unmarked |= not (alloc.init or alloc.mirror)
                if self._freed_guesses and alloc.device_ids:
                    # Its IDs given out again (the kubelet freed them): no container starts with all of a
                    # freed allocation's that shares one, as an Allocate of them shows (its put forgets them
                    # on replay too).
                    given = frozenset(alloc.device_ids)
                    for gone in [w for w in self._freed_guesses if not given.isdisjoint(w)]:
                        del self._freed_guesses[gone]
            self._warn_overcommit(source)
            if taken or dropped:
                taken_keys = {a.key for a in taken}
                self._save_or_report([_del(k) for k in dropped if k not in taken_keys] + [_put(a) for a in taken])
        if taken or dropped:
            self._notify()
        return taken, refused

    def _taking_over(
        self, alloc: ContainerAllocation, source: str, *, answered: bool, dropped: list[tuple[str, str]]
    ) -> ContainerAllocation:
        """``alloc``, which the kubelet's records say holds its IDs, as it takes over the allocation made for
        another pod's container with those IDs and request that never started, or one freed before its
        container started (lock held; see :meth:`adopt`). The allocation taken over leaves the state (its
        key added to ``dropped``) or the remembered freed ones."""
        if not alloc.device_ids:
            return alloc
        wanted = frozenset(alloc.device_ids)
        holder = self._by_ids.get(wanted)
        if holder is not None:
            if holder[0] == alloc.pod_uid:
                return alloc
            group = [
                self._allocs[(holder[0], c)]
                for c in sorted(self._by_pod.get(holder[0], ()))
                if frozenset(self._allocs[(holder[0], c)].device_ids) == wanted
            ]
            matched = _same_request(group, alloc)
            if matched is None or matched.started:
                return alloc
            alloc = self._with_own_memory(alloc)
            self._free(self._remove(matched.key) or matched)
            dropped.append(matched.key)
            what = "holds, not started"
        else:
            freed = self._freed_guesses.get(wanted)
            matched = _same_request(freed or [], alloc)
            if freed is None or matched is None or matched.pod_uid == alloc.pod_uid:
                return alloc
            alloc = self._with_own_memory(alloc)
            if not answered and self._answering.get(matched.answered):
                return alloc  # its directory is another container's answer now
            freed.remove(matched)
            if not freed:
                del self._freed_guesses[wanted]
            what = "held, freed before it started"
        if not answered:
            alloc = replace(alloc, minors=matched.minors, answered_as=matched.answered)
        log.info(
            "%s: pod %s container %s holds %s, which pod %s container %s %s (the match of their Allocate among "
            "identical pods): it takes over that allocation (GPUs %s, the directory of pod %s container %s)",
            source,
            *alloc.key,
            ids.describe(alloc.device_ids),
            *matched.key,
            what,
            list(alloc.minors),
            *alloc.answered,
        )
        return alloc

    def _with_own_memory(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """``alloc`` with the memory its pod asks for, when the pod cache shows it asking for as many cores
        (lock held): the kubelet's copy of our answer holds the memory of the container it was made for,
        another pod's after a guess (the pod not yet shown: :meth:`_own_budget` at its start)."""
        request = _request_of(self._pods.get(alloc.pod_uid), alloc.container)
        if request is None or request.cores != alloc.cores:
            return alloc
        return replace(alloc, memory=request.memory_bytes)

    def directory_free(self, answered: tuple[str, str]) -> bool:
        """Whether the (pod UID, container) directory ``answered`` belongs to no one: no container is answered
        with it, no allocation is of its pod, and the pod cache knows no pod of that UID."""
        with self._lock:
            if self._answering.get(answered) or answered[0] in self._by_pod:
                return False
        return self._pods.get(answered[0]) is None

    def holds(self, key: tuple[str, str]) -> bool:
        """Whether (pod UID, container) has an allocation."""
        with self._lock:
            return key in self._allocs

    # -- checkpoint health -----------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path:
        """Where the checkpoint is written."""
        return self._checkpoint_path

    @property
    def checkpoint_error(self) -> str:
        """Why the checkpoint cannot be written now ('' when the last write worked)."""
        return self._checkpoint_error

    def _save_or_report(self, changes: list[dict[str, Any]] | None = None, text: str | None = None) -> None:
        """Stage the changes (made durable when the :meth:`_changing` block ends; the whole snapshot is
        written now for ``None``); on failure keep serving from memory and remember why (for /readyz).
        ``text``: the JSON of a single change, when the caller made it (:func:`_put_text`)."""
        try:
            ticket = self._stage(changes, text)
        except OSError as exc:
            log.error("cannot write checkpoint %s: %s", self._checkpoint_path, exc)
            return
        if ticket:
            self._unsettled.append(ticket)

    def checkpoint_looks_writable(self) -> bool:
        """A look that writes nothing: the snapshot is a regular file (or absent) in a directory that can
        be written, on a filesystem not mounted read-only. :meth:`probe_checkpoint` then tells why not."""
        directory = self._checkpoint_path.parent
        try:
            if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
                return False
            if os.statvfs(directory).f_flag & os.ST_RDONLY:
                return False
            try:
                mode = os.lstat(self._checkpoint_path).st_mode
            except FileNotFoundError:
                return True
            return stat.S_ISREG(mode)
        except OSError:
            return False

    def probe_checkpoint(self) -> str:
        """Write the checkpoint now (it may have become writable again); returns the error or ''."""
        with self._changing():
            self._save_or_report()
            return self._checkpoint_error

    # -- ResourceClaims (DRA mode) ------------------------------------------------------------------

    def claims(self) -> list[ClaimAllocation]:
        """Every prepared claim, ordered by UID."""
        with self._lock:
            return [self._claims[uid] for uid in sorted(self._claims)]

    def claim(self, uid: str) -> ClaimAllocation | None:
        """A prepared claim by UID."""
        with self._lock:
            return self._claims.get(uid)

    def prepare_claim(self, claim: ClaimAllocation, *, allow_unhealthy: frozenset[int] = frozenset()) -> bool:
        """Record a claim and occupy its GPUs; one journal record, durable before returning. Returns False
        when it was already prepared (a repeated Prepare: nothing changes).

        Refused (AllocationError naming the claim, the device and the amounts, nothing changed) when
        a GPU is not on this node, is unhealthy (unless its minor is in ``allow_unhealthy``: the
        result tolerates the taint), or cannot hold what the claim consumes next to the claims
        already prepared.
        """
        who = f"claim {claim.key} ({claim.uid})"
        with self._lock:
            known = self._claims.get(claim.uid)
            if known is not None:
                return False
            wanted: dict[int, tuple[int, int, bool]] = {}
            for dev in claim.devices:
                try:
                    leaf = self._tree.leaf_by_minor(dev.minor)
                except (KeyError, ValueError):
                    raise AllocationError(
                        f"{who}: device {dev.device}: GPU minor {dev.minor} is not on this node"
                    ) from None
                if not leaf.healthy and dev.minor not in allow_unhealthy:
                    raise AllocationError(f"{who}: device {dev.device} is unhealthy", "unavailable")
                if not dev.consumes:
                    continue
                cores, memory, whole = wanted.get(dev.minor, (0, 0, False))
                wanted[dev.minor] = (cores + dev.cores, memory + dev.memory, whole or dev.whole)
            for minor, (cores, memory, whole) in sorted(wanted.items()):
                leaf = self._tree.leaf_by_minor(minor)
                name = next(d.device for d in claim.devices if d.minor == minor)
                free_cores, free_memory = leaf.allocatable_cores, leaf.allocatable_memory
                if whole and free_cores < names.HUNDRED_CORES:
                    raise AllocationError(
                        f"{who}: device {name} is asked for whole but holds {names.HUNDRED_CORES - free_cores} cores "
                        f"of other allocations",
                        "exhausted",
                    )
                if cores > free_cores or memory > free_memory:
                    raise AllocationError(
                        f"{who}: device {name}: consumed capacity cores={cores} memory={memory} is more than the "
                        f"device has left (cores={free_cores} memory={free_memory})",
                        "exhausted",
                    )
            self._occupy_claim(claim)
            self._claims[claim.uid] = claim
            self._generation += 1
            crash_point("prepare-before-checkpoint")
            try:
                ticket = self._stage([_claim_put(claim)])
            except OSError as exc:
                self._drop_claim(claim.uid)
                raise AllocationError(
                    f"{who}: {self._checkpoint_error}; no claim is prepared until it can be written", "unavailable"
                ) from exc
        try:
            self._sync_or_undo(
                ticket, lambda: self._claims.get(claim.uid) is claim and self._drop_claim(claim.uid) is not None
            )
        except OSError as exc:
            raise AllocationError(
                f"{who}: cannot write checkpoint {self._checkpoint_path}: {_oserror(exc)}; no claim is prepared "
                "until it can be written",
                "unavailable",
            ) from exc
        crash_point("prepare-after-checkpoint")
        self._notify()
        log.info(
            "prepared %s: %s",
            who,
            ", ".join(f"{d.device} ({_claim_device_text(d)})" for d in claim.devices),
        )
        return True

    def _drop_claim(self, uid: str) -> ClaimAllocation | None:
        claim = self._claims.pop(uid, None)
        if claim is None:
            return None
        self._generation += 1
        if self._overcommitted.intersection(d.minor for d in claim.devices):
            self._recharge(tuple(d.minor for d in claim.devices))
            return claim
        for dev in claim.devices:
            if not dev.consumes:
                continue
            try:
                leaf = self._tree.leaf_by_minor(dev.minor)
            except (KeyError, ValueError):
                continue
            self._tree.free(leaf.index, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)
        return claim

    def _occupy_claim(self, claim: ClaimAllocation) -> None:
        """Take what the claim's results consume of their GPUs (admin access takes nothing)."""
        for dev in claim.devices:
            if dev.consumes:
                leaf = self._tree.leaf_by_minor(dev.minor)
                self._note_beyond(leaf, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)
                self._tree.occupy(leaf.index, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)

    def unprepare_claim(self, uid: str) -> ClaimAllocation | None:
        """Free a claim's GPUs (one journal record); None when it was not prepared (a repeated Unprepare).

        AllocationError when the record cannot be written: the claim is freed all the same.
        """
        with self._lock:
            claim = self._drop_claim(uid)
            if claim is None:
                return None
            try:
                ticket = self._stage([_claim_del(uid)])
            except OSError as exc:
                # Freed in memory all the same: the kubelet retries an Unprepare that failed, and the
                # next write (a whole snapshot after a failure) records it.
                raise AllocationError(f"claim {claim.key} ({uid}): {self._checkpoint_error}", "unavailable") from exc
        try:
            self._sync(ticket)
        except OSError as exc:
            raise AllocationError(
                f"claim {claim.key} ({uid}): cannot write checkpoint {self._checkpoint_path}: {_oserror(exc)}",
                "unavailable",
            ) from exc
        self._notify()
        log.info("unprepared claim %s (%s)", claim.key, uid)
        return claim

    def adopt_claims(self, claims: Sequence[ClaimAllocation], *, source: str, save: bool = True) -> int:
        """Take over prepared claims (from the checkpoint, or rebuilt); returns how many."""
        taken: list[ClaimAllocation] = []
        with self._changing():
            for claim in claims:
                unknown = [m for m in claim.minors if m not in self._by_minor]
                if unknown:
                    log.warning("%s: dropping claim %s: GPU(s) %s not on this node", source, claim.key, unknown)
                    continue
                if claim.uid in self._claims:
                    continue
                self._occupy_claim(claim)
                self._claims[claim.uid] = claim
                self._generation += 1
                taken.append(claim)
            if taken and save:
                self._save_or_report([_claim_put(c) for c in taken])
        if taken:
            self._notify()
        return len(taken)

    def _charges(self, minors: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
        """(cores, memory) of each charge held on these GPUs: one per group of containers sharing IDs
        (:func:`_share_key`), one per consuming device of a prepared claim."""
        wanted = set(minors)
        holders = sorted({a.pod_uid for a in self._allocs.values() if wanted.intersection(a.minors)})
        out: dict[int, list[tuple[int, int]]] = {m: [] for m in wanted}
        for pod_uid in holders:
            for m in wanted:
                out[m].extend(self._pod_charges(pod_uid, m))
        for claim in self._claims.values():
            for dev in claim.devices:
                if dev.consumes and dev.minor in out:
                    out[dev.minor].append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
        return out

    def _recharge(self, minors: Iterable[int]) -> None:
        """Set these GPUs' accounting from what they hold now (lock held); a GPU no longer charged beyond
        its capacity goes back to the usual incremental accounting."""
        for minor, charges in self._charges(minors).items():
            try:
                leaf = self._tree.leaf_by_minor(minor)
            except (KeyError, ValueError):
                self._overcommitted.discard(minor)
                continue
            self._tree.free(leaf.index, names.HUNDRED_CORES, 0)
            for cores, memory in charges:
                self._tree.occupy(leaf.index, cores, memory)
            if not _beyond(charges, leaf.total_memory):
                self._overcommitted.discard(minor)

    def _warn_overcommit(self, source: str) -> None:
        """Log each GPU the held records charge beyond its capacity, and keep it for :meth:`_recharge`."""
        minors = {m for a in self._allocs.values() for m in a.minors}
        minors |= {d.minor for c in self._claims.values() for d in c.devices if d.consumes}
        for minor, charges in sorted(self._charges(minors).items()):
            gpu = self._by_minor.get(minor)
            if gpu is None or not _beyond(charges, gpu.memory_total):
                continue
            self._overcommitted.add(minor)
            cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
            memory = sum(mem for c, mem in charges if c < names.HUNDRED_CORES)
            holders = sorted(
                f"{a.namespace}/{a.pod_name or a.pod_uid} container {a.container}"
                for a in self._allocs.values()
                if minor in a.minors
            )
            holders += sorted(
                f"claim {c.namespace}/{c.name}"
                for c in self._claims.values()
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
