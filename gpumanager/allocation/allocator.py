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
started; otherwise the old allocation is freed and the request matched anew,
unless the kubelet forgot that container and the API server shows its pod
running: a kubelet restarted without its ``kubelet_internal_checkpoint`` counts
every ID free while the containers run, so a container that started before the
kubelet's last restart (or this agent's start) and that its checkpoint, read
then, does not list keeps its GPUs and the request is matched beside it. A
container the kubelet listed after its restart and no longer counts ended (a
Job's pod, its status not at the API server yet): its IDs go to the request.

Allocate looks only at what changed: the allocator keeps an index of the pods
that may still wait for GPUs (pending, not assigned, not being deleted) and
of the pods holding GPUs whose end it has not yet checked, both brought up to
date from the pods the cache says changed since the last call
(:meth:`PodSource.changes`). A new list in the cache, or a source that cannot
tell, rebuilds both from every pod; the periodic recycle checks every holder.
A pod found by asking the API server (the cache had not seen it yet) counts
as alive while the cache has not shown it; after :data:`FRESH_LIST_GRACE_SECONDS`
the periodic recycle asks the API server again, and frees it only if it is gone there.

The state and its lock are the Allocator's, here, with the Allocate path and the journal glue; the
work on them is in modules named for it, functions taking the allocator (most called with its lock
held, as their docstrings say): :mod:`~gpumanager.allocation.matching` (which pod container an
Allocate is for), :mod:`~gpumanager.allocation.placement` (which GPUs it gets),
:mod:`~gpumanager.allocation.prestart` (PreStartContainer's checks and swaps),
:mod:`~gpumanager.allocation.freed_unstarted` (allocations freed before their start, IDs handed on),
:mod:`~gpumanager.allocation.release` (pods that end), :mod:`~gpumanager.allocation.adoption`
(taking over the checkpoint's and the kubelet's records), :mod:`~gpumanager.allocation.gpu_charges`
(what each GPU is charged with), :mod:`~gpumanager.allocation.memory_only` (vcuda-memory without
vcuda-core) and :mod:`~gpumanager.allocation.dra_claims` (DRA claims); the shared types and pure
helpers are in :mod:`~gpumanager.allocation.model`.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpumanager import deferred, names
from gpumanager.allocation import (
    adoption,
    dra_claims,
    freed_unstarted,
    gpu_charges,
    ids,
    journal,
    matching,
    memory_only,
    placement,
    prepared,
    prestart,
    records,
    release,
)
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.model import (
    _BATCH_SNAPSHOT,
    _COMPACT_RETRY_MAX,
    _FREED_GUESSES_KEPT,
    _MEMORY_ONLY_KEPT,
    FORCED_STOP_MARGIN_SECONDS,
    MIRROR_ANNOTATION,
    MIRROR_GRACE_SECONDS,
    RECENT_LIST_SECONDS,
    AllocationError,
    AllocatorSettings,
    Candidate,
    ChangeListener,
    FreedRoomWithheld,
    OwnerHint,
    PodSource,
    Waiting,
    _Changing,
    _compat32,
    _del,
    _Detached,
    _document,
    _Fresh,
    _oserror,
    _put,
    _put_text,
    _Swap,
)
from gpumanager.allocation.pods import GPURequest, Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, ResponseSettings, build_response
from gpumanager.device.types import GPUInfo
from gpumanager.faults import crash_point
from gpumanager.kube.apierror import plain
from gpumanager.topology import GPUNode, TopologyTree, render_graph

#: What other modules import from here (the state's parts live in the modules named above).
__all__ = [
    "FORCED_STOP_MARGIN_SECONDS",
    "FRESH_LIST_GRACE_SECONDS",
    "MIRROR_ANNOTATION",
    "MIRROR_GRACE_SECONDS",
    "_FREED_GUESSES_KEPT",
    "_MEMORY_ONLY_KEPT",
    "AllocationError",
    "Allocator",
    "AllocatorSettings",
    "Candidate",
    "ChangeListener",
    "OwnerHint",
    "PodSource",
    "Waiting",
    "_put",
    "_put_text",
]

log = logging.getLogger(__name__)


#: How long a pod allocated from a fresh list (the pod cache had not seen it) counts as alive while the cache
#: has still not shown it: the cache's silence about it is its watch lagging, not the pod's end.
FRESH_LIST_GRACE_SECONDS = 60.0
#: Admissions whose start is kept for their PreStartContainer (Allocator._began): the kubelet starts a
#: container soon after its admission, so older ones are of no use (their lists are too old by then).
_BEGAN_KEPT = 64


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
        #: A GPU's minor when the records being taken over were answered -> its minor now, for each GPU the
        #: driver numbered otherwise since (set before :meth:`load`; see :func:`adoption.renumber`).
        self.renumbered: dict[int, int] = {}
        #: The records so moved, by (pod UID, container): the minors they named (those of their saved answer).
        self.renumbered_from: dict[tuple[str, str], tuple[int, ...]] = {}
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
        # Records a PreStartContainer changed (refused: the change could not be written), until the whole
        # state is written: the kubelet's next try of that start writes it before it is answered.
        self._unwritten_starts: set[tuple[str, str]] = set()
        # While a PreStartContainer may have to mark what changed meanwhile (:func:`prestart._watch`): each
        # key whose record was replaced or removed, with the record it held before.
        self._watchers = 0
        self._touched: list[tuple[tuple[str, str], ContainerAllocation | None]] = []
        # Containers whose device IDs the kubelet handed to another container: never matched again.
        self._retired: set[tuple[str, str]] = set()
        # Allocations matched while other pods waited with the same request, until PreStartContainer.
        self._guessed: set[tuple[str, str]] = set()
        # Allocations freed before their container started, by their IDs: after a guess among identical
        # pods the kubelet may have given the IDs (and our answer) to another, which PreStartContainer names.
        # (Those of one pod: an init container's IDs handed on to the next container.)
        self._freed_guesses: dict[frozenset[str], list[ContainerAllocation]] = {}
        # The kubelet's holder (pod UID, container) of a set of device IDs, None when none: asked (lock
        # released) only when a request's only room is that of an allocation freed before its start.
        self._holder_of: Callable[[Sequence[str]], tuple[str, str] | None] | None = None
        # Whether the kubelet's records hold devices of a (pod UID, container) (set_kubelet_records).
        self._kubelet_records: Callable[[tuple[str, str]], bool] | None = None
        # The containers answered with each (pod UID, container) directory ``<vm>/<pod uid>/<container>``,
        # which they mount (ContainerAllocation.answered): one each, so that no two share a vcuda.config.
        self._answering: dict[tuple[str, str], set[tuple[str, str]]] = {}
        # Unstarted allocations whose IDs came again in an Allocate answered as a repeat: perhaps the
        # kubelet gave them to another pod after failing this one's admission (see freed_unstarted.hand_over).
        self._repeated: set[tuple[str, str]] = set()
        # When the kubelet's Allocate of each allocation's IDs reached us (time.monotonic(); this run's),
        # kept while the IDs are held, whichever container they turn out to be (swaps, records replaced).
        self._asked_at: dict[frozenset[str], float] = {}
        # (size, when it reached us) of the last GetPreferredAllocation: the kubelet sends a container's Allocate
        # right after it (it admits one pod at a time), so the next Allocate takes it, whatever its size, and
        # counts its admission as begun then only when it asks as much and comes within RECENT_LIST_SECONDS. A
        # note whose Allocate never came (refused before the allocator, a kubelet restart) serves no other.
        self._previewed: tuple[int, float] | None = None
        # The placement and answer the last preview made, for the Allocate that follows it (prepared.py).
        self._prepared: prepared.Prepared | None = None
        # When the admission of IDs allocated from a list made for their GetPreferredAllocation began (their
        # PreStartContainer finds the pod in a list sent since then); at most _BEGAN_KEPT, newest last.
        self._began: dict[frozenset[str], float] = {}
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
        #: Init and Mirror markers only the pod objects tell: :func:`release.mark_from_pods` sets them.
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
        # The sizes each pod's containers ask for (memory_only.memory_asks_of), read once per pod.
        self._memory_parsed: dict[str, tuple[tuple[int, bool], ...]] = {}
        self._memory_sizes: dict[int, list[int]] = {}
        # The IDs of vcuda-memory Allocates the pod cache could not explain, with when each came, oldest first
        # (memory_only.note_unexplained): their PreStartContainer looks at whose they are.
        self._memory_unexplained: dict[frozenset[str], float] = {}
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
            since = self._asked_at.get(frozenset(device_ids))
            return OwnerHint(pod, since, self._began.get(frozenset(device_ids), since))

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
                pod = release.pod_of(self, alloc.pod_uid)
            cached = build_response(alloc, self._gpus, self._settings.response, compat32=_compat32(pod, alloc))
            self._responses[key] = cached
        return cached

    def set_holder_lookup(self, holder_of: Callable[[Sequence[str]], tuple[str, str] | None]) -> None:
        """Where the kubelet's holder of vcuda-core device IDs is asked: (pod UID, container), or None when
        no container holds them or nobody can tell. Without it, the room of an allocation freed before
        its start goes to a request that has no other (the kubelet's holder of its IDs is not asked)."""
        with self._lock:
            self._holder_of = holder_of

    def set_kubelet_records(self, records: Callable[[tuple[str, str]], bool]) -> None:
        """Where the kubelet's own records are asked (lock released) whether they still count a (pod UID,
        container)'s vcuda-core devices as held: False only for a container the kubelet forgot, one that
        started before its last restart (or this agent's start) and that its checkpoint, read then, does not
        list (:class:`gpumanager.kube.kubelet_checkpoint.KubeletRecords`: read once per kubelet restart, not
        per call). Asked only when an Allocate names the IDs of a started container whose pod the cache shows
        running: a forgotten one, its pod running at the API server, keeps its GPUs and the request is matched
        beside it. Otherwise (and without it) such IDs mean the container ended."""
        with self._lock:
            self._kubelet_records = records

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
            for minor, charges in gpu_charges.charges_of(self, self._overcommitted).items():
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

    def preview(self, cores: int, offered: AbstractSet[str] = frozenset()) -> list[int] | None:
        """The GPU indices the next Allocate of ``cores`` vcuda-core would place on: the container the
        cache says waits first for that many, placed as Allocate places it (its ``predicate-gpu-idx``,
        else the evaluators with its memory). None when no known container waits for that many or its
        Allocate would be refused.

        A container the cache does not know yet is looked for in a list asked of the API server now (the
        kubelet admits a pod as soon as its own watch shows it; ours may lag).

        Nothing is changed but this: an allocation freed before its container started whose IDs the
        kubelet ``offered`` as available (GetPreferredAllocation) is no longer held for a pod the kubelet
        may have given them to. The kubelet offers only IDs it holds for no pod; without this, that room
        counted as taken here while the Allocate that follows, given those IDs, found it free and placed
        elsewhere than the IDs it was steered to."""
        if isinstance(cores, bool) or not isinstance(cores, int) or cores <= 0:
            return None
        arrived = time.monotonic()
        with self._lock:
            self._previewed = (cores, arrived)
            self._prepared = None
            if offered and self._freed_guesses:
                for gone in [w for w in self._freed_guesses if not w.isdisjoint(offered)]:
                    del self._freed_guesses[gone]
            self._take_pod_changes()
            candidate = self._match_cached(cores)
            if candidate is not None:
                return self._placed_gpus(candidate)
        # The cache has not seen the pod yet (its watch lags the kubelet's): ask the API server, with the
        # lock released. The Allocate that follows finds the pod in the same list.
        try:
            fresh = self._pods.refresh()
        except Exception as exc:
            log.info(
                "GetPreferredAllocation for %d tencent.com/vcuda-core: no pending pod known on this node needs "
                "that many, and the API server cannot be asked (%s): no preference from a pod",
                cores,
                plain(exc),
            )
            return None
        with self._lock:
            candidate = matching.match_waiting(self, fresh, cores)
            return None if candidate is None else self._placed_gpus(candidate)

    def _placed_gpus(self, candidate: Candidate) -> list[int] | None:
        """The GPU indices Allocate would place ``candidate`` on, None when it would be refused (lock held)."""
        try:
            decided = placement.decide(self, candidate, ())
            placed = [self._tree.leaf_by_minor(m).index for m in decided.minors]
        except (AllocationError, ValueError):
            return None
        self._prepared = prepared.prepare(self, candidate, decided)
        return placed

    def memory_only_refusal(self, blocks: int, device_ids: Sequence[str] = ()) -> str:
        """Why a vcuda-memory Allocate of ``blocks`` IDs (``device_ids``) is refused, or "" when it is answered."""
        return memory_only.memory_only_refusal(self, blocks, device_ids)

    def memory_unexplained_since(self, device_ids: Sequence[str]) -> float | None:
        """When the vcuda-memory Allocate of ``device_ids`` came, if the pod cache could not say whose it
        could be (its watch lagged), until a start of their container is let through
        (:meth:`settle_memory_unexplained`)."""
        return memory_only.unexplained_since(self, device_ids)

    def settle_memory_unexplained(self, device_ids: Sequence[str]) -> None:
        """A start with ``device_ids`` was let through: their container's later starts are not looked at again."""
        memory_only.settle_unexplained(self, device_ids)

    def memory_only_init(self, pod_uid: str, blocks: int) -> str:
        """The name of an init container of pod ``pod_uid`` asking for ``blocks`` of vcuda-memory without
        vcuda-core that has not run, else "" (:func:`memory_only.memory_only_init`)."""
        return memory_only.memory_only_init(self, pod_uid, blocks)

    def init_handing_on(self, pod_uid: str, blocks: int) -> str:
        """The name of an init container of pod ``pod_uid`` asking for ``blocks`` of vcuda-memory and vcuda-core
        that has not run, else "" (:func:`memory_only.init_handing_on`)."""
        return memory_only.init_handing_on(self, pod_uid, blocks)

    def memory_only_owner(self, owner: tuple[str, str], since: float) -> str:
        """The name of container ``owner`` when it asks for vcuda-memory and no vcuda-core and has not run,
        else "" (:func:`memory_only.memory_only_owner`)."""
        return memory_only.memory_only_owner(self, owner, since)

    def memory_only_starting(self, blocks: int) -> dict[tuple[str, str], str]:
        """The containers of this node's pods (as the cache shows them) asking for ``blocks`` of vcuda-memory
        without vcuda-core that have not run yet, by (pod UID, container), each with its name for a message."""
        return memory_only.memory_only_starting(self, blocks)

    def allocate(self, device_ids: Sequence[str]) -> ContainerResponse:
        """Answer one kubelet Allocate for ``device_ids`` (vcuda-core IDs, already validated).

        Where the only room is that of allocations freed before their containers started, the kubelet is
        asked (lock released) whether it still holds their IDs: for a pod it gave them to (a guess among
        identical pods), which takes the allocation over now, its room kept; for nobody, the room is free
        (:func:`freed_unstarted.settle_freed_room`). The request is then matched once more."""
        try:
            return self._allocate_once(device_ids)
        except FreedRoomWithheld as exc:
            if not freed_unstarted.settle_freed_room(self, exc.freed):
                raise
        return self._allocate_once(device_ids)

    def _allocate_once(self, device_ids: Sequence[str]) -> ContainerResponse:
        received = time.monotonic()
        cores = len(device_ids)
        if cores == 0:
            raise AllocationError("Allocate for tencent.com/vcuda-core carried no device IDs")
        wanted = frozenset(device_ids)
        if len(wanted) != cores:  # some ID twice: which one, for the message
            doubled = ids.duplicates(device_ids)
            raise AllocationError(
                f"Allocate for {ids.describe(device_ids)}: device ID {ids.shown(doubled[0])} appears more than once"
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
                note, self._previewed = self._previewed, None  # this admission's GetPreferredAllocation
                began = (
                    note[1]
                    if note is not None and note[0] == cores and received - note[1] < RECENT_LIST_SECONDS
                    else None
                )
                self._began.pop(wanted, None)
                # IDs given out again: a guess freed with them no longer tells whose they are. Some of a
                # guess's IDs given out: the kubelet freed them, no container starts with them all.
                self._freed_guesses.pop(wanted, None)
                if self._freed_guesses:
                    for gone in [w for w in self._freed_guesses if not wanted.isdisjoint(w)]:
                        del self._freed_guesses[gone]
                suspect = self._by_ids.get(wanted)
                if suspect is not None:
                    self._take_pod_changes()  # whether a later container of its pod waits for them
                # IDs a started container holds, its pod running in the cache: given on because the pod
                # ended (the cache lagging), or because the kubelet forgot that container (it restarted
                # without its checkpoint). Its records since its restart and the API server tell (lock released).
                records = self._kubelet_records
                running = (
                    suspect
                    if suspect is not None and records is not None and matching.started_and_alive(self, suspect)
                    else None
                )
                if suspect is not None and (
                    not matching.is_repeat(self, suspect)
                    or matching.handed_within_pod(self, suspect, cores) is not None
                ):
                    suspect = None
            handed_on = suspect is not None and matching.gone_at_server(self, suspect)
            runs_on = (
                running is not None
                and records is not None
                and not records(running)
                and matching.alive_at_server(self, running)
            )
            keep: frozenset[tuple[str, str]] = frozenset()  # holders of some of ``wanted`` never taken back
            with self._changing():
                known = self._by_ids.get(wanted)
                within = matching.handed_within_pod(self, known, cores) if known is not None else None
                if within is not None and known is not None:
                    try:
                        alloc, response, ticket = self._allocate_locked(
                            within, ordered, placement.riding(self, within, ordered, self._allocs[known])
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
                    if matching.is_repeat(self, known) and not (handed_on and known == suspect):
                        repeat = self._response(known)
                        ticket = self._unsynced.get(known, 0)
                        self._repeated.add(known)
                        # Perhaps the IDs handed on after a failed admission: a List made before this
                        # Allocate may show the container that held them first.
                        self._asked_at[wanted] = received
                    elif handed_on and known == suspect:
                        # Its pod is gone at the API server: none of its containers holds GPUs or
                        # waits for an Allocate any more, whatever the cache still shows.
                        freed_unstarted.take_back(self, known)
                        release.release_locked(self, known[0])
                        matching.set_waiting(self, known[0], None)
                        changed = True
                    elif runs_on and known == running and self._allocs[known].started:
                        # Its container started, its pod runs at the API server and the kubelet's records
                        # have no devices of it: the kubelet lost them, and counts these IDs free while that
                        # container runs, which keeps its GPUs; the request is matched anew beside it, never
                        # into its room.
                        keep = frozenset({known})
                        kept = self._allocs[known]
                        log.warning(
                            "Allocate for %s: these IDs are held by pod %s/%s (UID %s) container %s, which has "
                            "started, and the API server shows its pod running: the kubelet no longer counts them "
                            "as that container's (it lost its record of it: kubelet_internal_checkpoint removed "
                            "or damaged before the kubelet restarted). That container keeps its GPUs %s and the "
                            "request is matched anew beside it; the kubelet cannot start that container again "
                            "(no devices in its local cache): delete its pod to have it made again",
                            ids.describe(ordered),
                            kept.namespace,
                            kept.pod_name,
                            *known,
                            list(kept.minors),
                        )
                    else:
                        # Given on by the kubelet (its container started or ended), or asked again for
                        # that container: taken back only once another container gets them.
                        held = freed_unstarted.detach(self, known)
                if repeat is None and within is None:
                    changed |= self._recycle_locked()
                    candidate = self._match_cached(cores)
                    if candidate is not None:
                        try:
                            alloc, response, ticket = self._allocate_taking_back(
                                candidate, ordered, wanted, received, keep
                            )
                            changed = True
                            if candidate.guess:
                                self._guessed.add(alloc.key)
                        except AllocationError as exc:
                            changed = True  # an allocation may have been taken back
                            freed_unstarted.reattach(self, held)
                            if exc.kind != "exhausted":
                                raise
                            # Perhaps only because this node's pod watch has not yet delivered the end of a
                            # pod the scheduler already counts as gone: ask the API server (lock released).
                            full, holders = exc, set(self._by_pod)
                            candidate = None
                        else:
                            freed_unstarted.retire(self, held, alloc.key)
                    else:
                        freed_unstarted.reattach(self, held)
            if repeat is not None and known is not None:
                log.info("repeated Allocate for pod %s container %s: same answer", *known)
                try:
                    self._sync(ticket)  # the first answer's record, which may still be on its way
                except OSError as exc:
                    raise self._unwritten(known, ordered, exc) from exc
                return repeat
            if (
                candidate is None
                and full is None
                and began is not None
                and (recent := self._pods.recent(RECENT_LIST_SECONDS, began)) is not None
            ):
                # The cache has not seen the pod yet, but the list made for this admission's
                # GetPreferredAllocation (sent after it came, the cache knowing nothing newer) may show it:
                # it serves as a list asked now would. Not found there: the API server is asked, as below.
                with self._changing():
                    found = matching.match_waiting(self, recent, cores)
                    if found is not None:
                        candidate = found
                        changed = True  # an allocation may be taken back even if this one fails
                        alloc, response, ticket = self._allocate_instead(held, found, ordered, wanted, received, keep)
                        release.note_fresh(self, found.pod)
                        self._began[wanted] = began
                        while len(self._began) > _BEGAN_KEPT:
                            del self._began[next(iter(self._began))]
            if candidate is None and full is not None:
                fresh = matching.refresh_for_room(self, full)
                with self._changing():
                    changed |= matching.release_gone_locked(self, fresh, holders)
                    found = matching.match_waiting(self, fresh, cores)
                    if found is None:  # allocated by a concurrent call meanwhile, or no longer pending
                        raise full
                    candidate = found
                    changed = True  # an allocation may be taken back even if this one fails
                    alloc, response, ticket = self._allocate_instead(held, candidate, ordered, wanted, received, keep)
                    release.note_fresh(self, candidate.pod)
            elif candidate is None:
                # The cache has not seen the pod yet: ask the API server, with the lock released.
                fresh = matching.refresh_pods(self, cores, ordered)
                with self._changing():
                    found = matching.match_waiting(self, fresh, cores)
                    if found is None and held is not None and matching.holds_alive(self, held, fresh):
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
                        and not matching.explain_no_match(self, fresh, cores)  # no other pod that may be asking
                        and (lost := matching.lost_answer(self, fresh, cores, wanted))
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
                        first = freed_unstarted.detach(self, (podinfo.uid(lost.pod), lost.request.name))
                        try:
                            alloc, response, ticket = self._allocate_taking_back(lost, ordered, wanted, received, keep)
                        except AllocationError:
                            freed_unstarted.reattach(self, first)
                            raise
                        freed_unstarted.retire(self, first, alloc.key)
                        release.note_fresh(self, lost.pod)
                    elif found is None:
                        raise AllocationError(
                            f"candidate pod not found for {ids.describe(ordered)} ({cores} tencent.com/vcuda-core): "
                            + (
                                matching.explain_no_match(self, fresh, cores)
                                or "no pending pod on this node has an unallocated container asking for that many"
                            ),
                            "not_found",
                        )
                    else:
                        candidate = found
                        changed = True  # an allocation may be taken back even if this one fails
                        alloc, response, ticket = self._allocate_instead(
                            held, candidate, ordered, wanted, received, keep
                        )
                        release.note_fresh(self, candidate.pod)
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
        """Decide (unless ``decided``: what its GetPreferredAllocation prepared, when it still holds, else
        anew) and stage; returns the allocation, its answer and the journal ticket to sync before answering."""
        made = prepared.take(self, candidate, device_ids) if decided is None else None
        if decided is None:
            decided = made[0] if made is not None else placement.decide(self, candidate, device_ids)
        alloc = self._with_free_answer(decided)
        if alloc.answered != alloc.key:
            # Once answered: the kubelet does not wait for the log.
            deferred.later(
                log.info,
                "pod %s container %s is answered with the directory of pod %s container %s: pod %s container %s, "
                "which started with the IDs first matched to it, mounts its own",
                *alloc.key,
                *alloc.answered,
                *min(self._answering.get(alloc.key) or {("?", "?")}),
            )
        ticket = self._commit(alloc)
        if made is not None and alloc is decided:  # answered with its own directory, as prepared
            self._responses[alloc.key] = made[1]
        # From the candidate's pod: one found in a fresh list is not in the cache yet (its env says compat32).
        response = self._response(alloc.key, candidate.pod)
        assert response is not None
        return alloc, response, ticket

    def _with_free_answer(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """``alloc``, answered with :meth:`free_answer` (lock held): itself where that is its answer already."""
        name = self.free_answer(alloc)
        return alloc if name == alloc.answered else replace(alloc, answered_as=name)

    def free_answer(self, alloc: ContainerAllocation) -> tuple[str, str]:
        """The directory (pod UID, container) to answer ``alloc`` with: one no other container is answered with
        (lock held).

        Its own, unless a container of another pod took over an answer naming it: PreStartContainer
        found that the kubelet gave the IDs matched to ``alloc``'s container (the first of identical
        waiting pods) to that one, which mounts the directory the answer named. Then the directory of
        that container's own name, which it does not mount; if another took that over too, the next
        one along, as the both-allocated swap leaves them. With one container per name, the chain
        ends at a name nobody is answered with."""
        name = alloc.answered
        seen = {alloc.key}
        while True:
            users = self._answering.get(name)
            if not users or (len(users) == 1 and alloc.key in users):
                return name
            holder = min(users - {alloc.key})
            if holder in seen:  # only where records already shared a name (an older agent's): left as it was
                log.warning(
                    "pod %s container %s: no unused directory found for its answer; answered with %s/%s, "
                    "which pod %s container %s is answered with too",
                    *alloc.key,
                    *alloc.answered,
                    *holder,
                )
                return alloc.answered
            seen.add(holder)
            name = holder

    def _allocate_taking_back(
        self,
        candidate: Candidate,
        device_ids: tuple[str, ...],
        wanted: frozenset[str],
        received: float,
        keep: AbstractSet[tuple[str, str]] = frozenset(),
    ) -> tuple[ContainerAllocation, ContainerResponse, int]:
        """:meth:`_allocate_locked`; where no GPU has room, the containers of other pods that held some of
        ``wanted`` are taken back first (:func:`freed_unstarted.take_back_handed_on`), but those of ``keep``
        (found running), and it is tried once more. The same whether the candidate came from the pod cache
        or from a fresh list of the API server."""
        try:
            made = self._allocate_locked(candidate, device_ids)
        except AllocationError as exc:
            if exc.kind != "exhausted" or not freed_unstarted.take_back_handed_on(self, wanted, candidate, keep):
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

    def _allocate_instead(
        self,
        held: _Detached | None,
        candidate: Candidate,
        device_ids: tuple[str, ...],
        wanted: frozenset[str],
        received: float,
        keep: AbstractSet[tuple[str, str]] = frozenset(),
    ) -> tuple[ContainerAllocation, ContainerResponse, int]:
        """:meth:`_allocate_taking_back` after a look at the API server (lock held again): the holder
        of ``wanted`` is taken out again for the attempt (if the state is still as it was), and put
        back if it fails."""
        if held is not None:
            if self._allocs.get(held.alloc.key) is held.alloc:
                freed_unstarted.detach(self, held.alloc.key)
            else:
                held = None  # released or changed meanwhile
        try:
            made = self._allocate_taking_back(candidate, device_ids, wanted, received, keep)
        except AllocationError:
            freed_unstarted.reattach(self, held)
            raise
        freed_unstarted.retire(self, held, made[0].key)
        return made

    def _match_cached(self, cores: int) -> Candidate | None:
        """The candidate among the pods the cache knows, as :meth:`_best` over every waiting pod would
        choose it, from the heap of that size (lock held; the cache's changes taken in just before, by
        :meth:`_recycle_locked`)."""
        return matching.match_cached(self, cores)

    def _take_pod_changes(self) -> None:
        """Bring the index of waiting pods, and the list of holders to check, up to date with the pod
        source (lock held): only the pods it says changed, or every pod when it cannot say."""
        return matching.take_pod_changes(self)

    def _best(self, waiting: Iterable[Waiting], cores: int) -> Candidate | None:
        """The first container that waits for ``cores`` (lock held)."""
        return matching.best(self, waiting, cores)

    # -- state changes ----------------------------------------------------------------------------

    def _occupy(self, alloc: ContainerAllocation) -> None:
        if not alloc.init and not self._by_pod.get(alloc.pod_uid):
            # The pod's first allocation (the common case): nothing to free before, its own charge after,
            # as :func:`gpu_charges.pod_charges` would find them.
            for minor in alloc.minors:
                leaf = self._tree.leaf_by_minor(minor)
                self._note_beyond(leaf, alloc.cores, alloc.memory)
                self._tree.occupy(leaf.index, alloc.cores, alloc.memory)
            return
        for minor in alloc.minors:
            leaf = self._tree.leaf_by_minor(minor)
            before = gpu_charges.pod_charges(self, alloc.pod_uid, minor)
            after = gpu_charges.pod_charges(self, alloc.pod_uid, minor, extra=alloc)
            for charge in before:
                self._tree.free(leaf.index, *charge)
            for charge in after:
                self._note_beyond(leaf, *charge)
                self._tree.occupy(leaf.index, *charge)

    def _note_beyond(self, leaf: GPUNode, cores: int, memory: int) -> None:
        """Remember a GPU about to be charged beyond what it has left (records recovered, put back): its
        counts floor at zero, so releases on it recompute its charge (:func:`gpu_charges.recharge`)."""
        if cores >= names.HUNDRED_CORES:
            beyond = leaf.allocatable_cores < names.HUNDRED_CORES
        else:
            beyond = cores > leaf.allocatable_cores or memory > leaf.allocatable_memory
        if beyond:
            self._overcommitted.add(leaf.minor)

    def _free(self, alloc: ContainerAllocation) -> None:
        if self._overcommitted.intersection(alloc.minors):
            gpu_charges.recharge(self, alloc.minors)
            return
        if gpu_charges.charge_of_group(self, alloc, include=False) == (0, 0):
            self._asked_at.pop(frozenset(alloc.device_ids), None)  # the IDs' Allocate is over with
        for minor in alloc.minors:
            try:
                leaf = self._tree.leaf_by_minor(minor)
            except (KeyError, ValueError):
                continue
            for charge in gpu_charges.pod_charges(self, alloc.pod_uid, minor, extra=alloc):
                self._tree.free(leaf.index, *charge)
            for charge in gpu_charges.pod_charges(self, alloc.pod_uid, minor):
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
        if self._watchers:
            self._touched.append((key, old))
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
            if self._watchers:
                self._touched.append((key, alloc))
        self._guessed.discard(key)
        self._repeated.discard(key)
        self._generation += 1
        waiting = self._waiting.get(key[0]) if alloc is not None else None
        if waiting is not None and len(waiting.requests) == 1 and waiting.keys[0] == key:
            matching.push(self, waiting)  # it may wait again (an allocation undone): back in its heap
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
            order = matching.gpu_containers(self, key[0], pod)
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

    def observe_checkpoint_writes(self, observe: Callable[[str, float], None]) -> None:
        """Tell ``observe(kind, seconds)`` of every durable checkpoint write from now on: ``"journal"``
        (one write of the changes staged so far: what an Allocate waits for) or ``"snapshot"`` (the
        whole state, encoded and written: in the background, or by the call itself after a failed write,
        on a nearly full disk or for a batch too large for one record). Not for writes that failed; see
        :attr:`journal.CheckpointStore.on_write` for when it is called."""
        self._store.on_write = observe

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
            self._unwritten_starts.clear()
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
        """Check a PreStartContainer against our records; return the container's allocation."""
        return prestart.pre_start(self, device_ids, owner)

    def prepare_start(self, device_ids: Sequence[str], owner: tuple[str, str] | None) -> ContainerAllocation:
        """Check a PreStartContainer against our records; return the container's allocation, not yet
        marked started: :meth:`mark_started` once the start's other checks passed and its files are written."""
        return prestart.prepare_start(self, device_ids, owner)

    def mark_started(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """Mark the allocation :meth:`prepare_start` returned started, durably; AllocationError when it cannot be."""
        return prestart.mark_started(self, alloc)

    def _reassign(self, swap: _Swap) -> None:
        """Make a swap of :func:`prestart.swap_of` (lock held)."""
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
            gpu_charges.recharge(self, touched)  # charged beyond only for a moment, while one of the two was placed
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
            freed = release.release_locked(self, pod_uid)
        if freed:
            self._notify()
        return freed

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
                plain(exc),
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
                changed |= bool(release.release_locked(self, uid))
        return changed

    def _recycle_locked(self, *, every: bool = False) -> bool:
        """Free the holders whose pods are gone or finished: those changed since the last look, or
        ``every`` one (only with a complete view of the node's pods)."""
        self._take_pod_changes()
        if not self._pods.synced():
            return False  # the holders to check stay listed until the view is complete
        if self._unmarked:
            release.mark_from_pods(self)
        if every or self._verify_all:
            pods = self._pods.pods()
            active = {podinfo.uid(p) for p in pods if not podinfo.is_terminated(p)}
            ended = {
                uid
                for uid in set(self._by_pod) - active
                if not release.is_fresh(self, uid) and uid not in self._stopping
            }
            if ended:
                listed = {podinfo.uid(p) for p in pods}
                ended = {uid for uid in ended if uid in listed or not release.kept_for_mirror(self, uid, pods)}
            self._verify_all = False
        else:
            unverified = self._unverified
            ended = (
                {uid for uid in unverified if uid in self._by_pod and not release.is_alive(self, uid)}
                if unverified
                else set()
            )
        self._unverified.clear()
        changed = False
        for pod_uid in sorted(ended) if ended else ():
            changed |= bool(release.release_locked(self, pod_uid))
        return changed

    def hold_while_stopping(self, pod: Pod) -> bool:
        """Keep the GPUs of ``pod``, removed from the API server while its containers may still run (a forced
        deletion: the kubelet stops them only after the removal), until :meth:`release_stopped` finds them
        stopped, or for at most its terminationGracePeriodSeconds plus :data:`FORCED_STOP_MARGIN_SECONDS`.
        False when it holds nothing."""
        return release.hold_while_stopping(self, pod)

    def stopping(self) -> list[str]:
        """The pods whose GPUs :meth:`hold_while_stopping` keeps."""
        return release.stopping(self)

    def release_stopped(self, stopped: Callable[[str], bool]) -> list[ContainerAllocation]:
        """Free the pods held by :meth:`hold_while_stopping` whose containers ``stopped(uid)`` says are gone
        (asked with the lock released), or whose bound has passed. Returns what was freed."""
        return release.release_stopped(self, stopped)

    def keep_deleted_mirror(self, pod: Pod) -> bool:
        """Whether the deletion of ``pod`` leaves its GPUs held: a mirror pod whose static pod may still run
        (its status names a container not stopped, or none). The kubelet makes the mirror pod again; the
        GPUs are freed when none shows within :data:`MIRROR_GRACE_SECONDS` or the static pod stops."""
        return release.keep_deleted_mirror(self, pod)

    def release_static_pod(self, pod: Pod) -> list[ContainerAllocation]:
        """Free what ``pod``'s static pod holds under the UIDs of its earlier mirror pods (deleted while it
        ran): ``pod``, a mirror pod, has ended. Returns what was freed."""
        return release.release_static_pod(self, pod)

    def load(self) -> records.Parsed:
        """Load our checkpoint and occupy the tree; returns what was taken and what must be rebuilt.
        (Until it has returned or raised AllocationError, :meth:`close` leaves the files on disk as they are.)"""
        return adoption.load(self)

    def adopt(
        self,
        allocs: Sequence[ContainerAllocation],
        *,
        source: str,
        kubelet_holds: bool = False,
        answered: bool = True,
    ) -> int:
        """Take over allocations recorded elsewhere (our checkpoint, the kubelet's); returns how many."""
        return adoption.adopt(self, allocs, source=source, kubelet_holds=kubelet_holds, answered=answered)

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
        return dra_claims.claims(self)

    def claim(self, uid: str) -> ClaimAllocation | None:
        """A prepared claim by UID."""
        return dra_claims.claim(self, uid)

    def prepare_claim(self, claim: ClaimAllocation, *, allow_unhealthy: frozenset[int] = frozenset()) -> bool:
        """Record a claim and occupy its GPUs; one journal record, durable before returning. Returns False
        when it was already prepared (a repeated Prepare: nothing changes)."""
        return dra_claims.prepare_claim(self, claim, allow_unhealthy=allow_unhealthy)

    def unprepare_claim(self, uid: str, *, keep_unwritten: bool = True) -> ClaimAllocation | None:
        """Free a claim's GPUs (one journal record); None when it was not prepared (a repeated Unprepare).
        When the record cannot be written: AllocationError, the claim kept prepared (unless ``keep_unwritten``
        is False: freed all the same)."""
        return dra_claims.unprepare_claim(self, uid, keep_unwritten=keep_unwritten)

    def adopt_claims(self, claims: Sequence[ClaimAllocation], *, source: str, save: bool = True) -> int:
        """Take over prepared claims (from the checkpoint, or rebuilt); returns how many."""
        return dra_claims.adopt_claims(self, claims, source=source, save=save)
