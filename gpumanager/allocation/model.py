"""The allocator's shared vocabulary: its error, the pod source it reads, the entries it keeps about pods
and containers, its journal records, and the small pure helpers its parts share."""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _quoted
from typing import TYPE_CHECKING, Any, Protocol

from gpumanager import names
from gpumanager.allocation import claims as claim_records
from gpumanager.allocation import ids, records
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
from gpumanager.allocation.pods import GPURequest, Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ResponseSettings

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator


#: How long a static pod keeps its GPUs after its mirror pod was deleted, its containers still running, while
#: no mirror pod of it shows again (the kubelet makes it again at its next sync of the pod).
MIRROR_GRACE_SECONDS = 60.0


#: How long past its terminationGracePeriodSeconds a pod removed from the API server at once (a forced
#: deletion) keeps its GPUs while its containers may still run (the kubelet stops them after the removal).
FORCED_STOP_MARGIN_SECONDS = 30.0


#: The mirror pod's annotation that names its static pod (the config hash, the kubelet's UID of the pod).
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"


#: The most allocations freed before their container started that are remembered, for a pod of the same
#: request the kubelet gave their IDs to (see freed_unstarted.take_freed_guess).
_FREED_GUESSES_KEPT = 1024


#: The most pods whose containers asking for vcuda-memory without vcuda-core are remembered (see
#: Allocator.memory_only_starting); all are forgotten past it, and read again.
_MEMORY_ONLY_KEPT = 8192


class AllocationError(Exception):
    """A refused request. ``kind`` is one of: invalid, not_found, exhausted, unavailable, mismatch."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class FreedRoomWithheld(AllocationError):
    """No GPU has room for a request but where allocations freed before their containers started held it
    (remembered by their IDs, ``freed``): the kubelet may still hold those IDs for the pod it gave them to,
    whose start takes the allocation over on the same GPUs. Whether it does is asked before that room is
    given to another (:func:`~gpumanager.allocation.freed_unstarted.settle_freed_room`)."""

    def __init__(self, message: str, freed: tuple[frozenset[str], ...]) -> None:
        super().__init__(message, "exhausted")
        self.freed = freed


#: How long a list made for one kubelet call of an admission still serves the next to find a pod the cache has
#: not shown yet (:meth:`PodSource.recent`): the kubelet's GetPreferredAllocation, Allocate and the container's
#: PreStartContainer follow each other within that while its watch runs ahead of ours.
RECENT_LIST_SECONDS = 2.0


class PodSource(Protocol):
    """Where the allocator learns about the pods of this node."""

    def synced(self) -> bool:
        """Whether the cache has a complete view (a successful list)."""

    def pods(self) -> list[Pod]:
        """Every pod of this node the cache knows."""

    def get(self, uid: str) -> Pod | None:
        """A pod by UID."""

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        """(the generation now, UIDs of the pods changed after generation ``since``); None for the UIDs
        when the source cannot tell (any pod may have changed). Pods read afterwards are at least as
        new as the generation returned."""

    def refresh(self) -> list[Pod]:
        """Pods of this node freshly listed from the API server, within a short deadline (raises when it
        cannot; the message says the API server did not answer)."""

    def recent(self, within: float, since: float) -> list[Pod] | None:
        """The pods of the last :meth:`refresh`'s list when it was sent at ``since`` (``time.monotonic()``) or
        later, less than ``within`` seconds ago, and the cache has taken in no change since; else None."""


@dataclass(frozen=True)
class AllocatorSettings:
    """What the node allows."""

    share_mode: bool
    response: ResponseSettings


@dataclass(frozen=True)
class Waiting:
    """A pod that may still have a container waiting for GPUs: pending, not assigned, not being deleted."""

    uid: str
    pod: Pod
    requests: tuple[GPURequest, ...]  # the containers that need GPUs, in allocation order
    keys: tuple[tuple[str, str], ...]  # (pod UID, container) of each request
    order: tuple[int, int, str, str]  # (1, predicate time, creation time, namespace/name): upstream's order


@dataclass(frozen=True)
class Candidate:
    """The pod and container an Allocate request was matched to."""

    pod: Pod
    request: GPURequest
    #: Another pod waited with the same request: the kubelet, not the order, tells which pod's
    #: container starts with the IDs (PreStartContainer asks it without naming a pod first).
    guess: bool = False


ChangeListener = Callable[[], None]


@dataclass
class _Fresh:
    """A holder found in a fresh list of the API server that the pod cache has not shown yet."""

    since: float  # when it was found, or last seen listed past the grace
    pod: Pod


@dataclass(frozen=True)
class _Detached:
    """An allocation taken out of the state while its IDs are matched anew, and what goes back with it."""

    alloc: ContainerAllocation
    ticket: int  # its journal record's ticket, if not yet durable
    guessed: bool
    asked: float | None  # when its IDs' Allocate reached us


@dataclass(frozen=True)
class _Swap:
    """Our record of some IDs (``mine``) and the record of the container the kubelet says holds them
    (``theirs``, None when it has none), and what each becomes: ``taken``, ``mine`` as that container's,
    with its own memory budget; ``given``, ``theirs`` as ``mine``'s container's, with that one's."""

    mine: ContainerAllocation
    theirs: ContainerAllocation | None
    taken: ContainerAllocation
    given: ContainerAllocation | None


@dataclass(frozen=True)
class OwnerHint:
    """What the allocator tells PreStartContainer's look-up of who holds some device IDs."""

    #: (namespace, pod name) to ask the kubelet about first; None when unknown or when the allocation
    #: was a guess among pods waiting with the same request.
    pod: tuple[str, str] | None
    #: When the kubelet's Allocate of these IDs reached us (``time.monotonic()``); None when the
    #: allocation is not of this run (restored from the checkpoint) or unknown.
    since: float | None
    #: When the admission of these IDs began (the GetPreferredAllocation before their Allocate, else that
    #: Allocate): a list of the node's pods sent since then may name the pod (:meth:`PodSource.recent`).
    listed: float | None = None


def _beyond(charges: Sequence[tuple[int, int]], total_memory: int) -> bool:
    """Whether these charges of one GPU exceed it: a whole GPU beside anything else, more than 100 cores,
    or more memory than it has."""
    if any(c >= names.HUNDRED_CORES for c, _ in charges):
        return len(charges) > 1
    return sum(c for c, _ in charges) > names.HUNDRED_CORES or sum(m for _, m in charges) > total_memory


def _mirror_of(pod: Pod) -> str:
    """A mirror pod's static pod (its config hash); '' for any other pod."""
    value = podinfo.pod_annotations(pod).get(MIRROR_ANNOTATION)
    return value if isinstance(value, str) else ""


def _runs_first(pod: Pod, request: GPURequest) -> bool:
    """Whether ``request`` is an init container that ends before its pod's other containers start."""
    return request.index < 0 and not podinfo.is_sidecar(pod, request.name)


def _has_run(pod: Pod, container: str) -> bool:
    """Whether the pod's status shows ``container`` has run (it names a container ID, or a restart)."""
    status = pod.get("status")
    if not isinstance(status, dict):
        return False
    for field in ("containerStatuses", "initContainerStatuses"):
        for cs in status.get(field) or []:
            if isinstance(cs, dict) and cs.get("name") == container:
                return bool(cs.get("containerID")) or bool(cs.get("restartCount"))
    return False


def _same_request(group: Sequence[ContainerAllocation], alloc: ContainerAllocation) -> ContainerAllocation | None:
    """The one of ``group`` (allocations of one pod holding the same IDs) that ``alloc``'s container took the
    answer of: of its request, and of its name when several are; else, likewise, of as many cores (the
    vcuda-core Allocate names no memory: a pod asking for another memory size may have been matched)."""
    for same in (
        [a for a in group if (a.cores, a.memory) == (alloc.cores, alloc.memory)],
        [a for a in group if a.cores == alloc.cores],
    ):
        named = [a for a in same if a.container == alloc.container]
        if named:
            return named[0]
        if len(same) == 1:
            return same[0]
    return None


def _share_key(alloc: ContainerAllocation) -> tuple[str, frozenset[str], tuple[int, ...]]:
    """The containers of a pod holding the same device IDs on the same GPUs (an init container and the
    one it handed its IDs to) share one charge: the larger of their cores and memory."""
    return (alloc.pod_uid, frozenset(alloc.device_ids) or frozenset({alloc.container}), alloc.minors)


def _claim_device_text(dev: ClaimDevice) -> str:
    if dev.admin:
        return "admin access"
    return "whole" if dev.whole else f"{dev.cores} cores, {dev.memory >> 20} MiB"


#: A batch larger than this is written as a whole snapshot rather than one journal record.
_BATCH_SNAPSHOT = 64


#: The longest wait of the compactor between two tries to write a checkpoint that failed.
_COMPACT_RETRY_MAX = 5.0


def _document(allocs: Sequence[ContainerAllocation], claims: Sequence[ClaimAllocation]) -> dict[str, Any]:
    """The checkpoint document of these allocations and prepared claims."""
    document = records.to_json(allocs)
    if claims:
        document["Claims"] = claim_records.to_json(claims)
    return document


class _Changing:
    """:meth:`Allocator._changing`: one per allocator, its state all in the allocator (so it nests like
    its re-entrant lock); a class rather than a generator, two calls fewer on every Allocate."""

    __slots__ = ("_owner",)

    def __init__(self, owner: Allocator) -> None:
        self._owner = owner

    def __enter__(self) -> None:
        self._owner._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._owner._settle()


class _Subject:
    """What a refusal of one Allocate names: ``pod ns/name container c (devices ...)``, spelt out only
    when a message is made (describing a whole GPU's 100 IDs sorts them, 0.1 ms of every such Allocate)."""

    __slots__ = ("container", "device_ids", "pod")

    def __init__(self, pod: Pod, container: str, device_ids: Sequence[str]) -> None:
        self.pod, self.container, self.device_ids = pod, container, device_ids

    def __str__(self) -> str:
        return f"pod {podinfo.pod_key(self.pod)} container {self.container} ({ids.describe(self.device_ids)})"


def _put(alloc: ContainerAllocation) -> dict[str, Any]:
    return {"op": "put", "pod": alloc.pod_uid, "container": alloc.container, "entry": alloc.to_json()}


def _put_text(alloc: ContainerAllocation) -> str | None:
    """:func:`_put`'s record as the journal's encoder writes it (compact, keys sorted), by template;
    None when the entry cannot be made so (the journal then encodes the change itself)."""
    entry = alloc.to_json_text()
    if entry is None:
        return None
    try:
        return f'{{"container":{_quoted(alloc.container)},"entry":{entry},"op":"put","pod":{_quoted(alloc.pod_uid)}}}'
    except TypeError:  # a name that is no string
        return None


def _del(key: tuple[str, str], freed: ContainerAllocation | None = None) -> dict[str, Any]:
    """The record of a container's allocation deleted; ``freed``: the allocation, freed before its container
    started, remembered by its IDs (:data:`journal.FREED_KEY`; older readers ignore the key)."""
    if freed is None:
        return {"op": "del", "pod": key[0], "container": key[1]}
    return {"op": "del", "pod": key[0], "container": key[1], "freed": freed.to_json()}


def _claim_put(claim: ClaimAllocation) -> dict[str, Any]:
    return {"op": "claim-put", "uid": claim.uid, "entry": claim.to_json()}


def _claim_del(uid: str) -> dict[str, Any]:
    return {"op": "claim-del", "uid": uid}


def _oserror(exc: OSError) -> str:
    """``[Errno 28] No space left on device (ENOSPC)``: the errno by number and by name."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
    return f"{text} ({name})" if name else text


def _request_of(pod: Pod | None, container: str) -> GPURequest | None:
    if pod is None:
        return None
    try:
        return podinfo.request_named(pod, container)
    except PodSpecError:
        return None


def _compat32(pod: Pod | None, alloc: ContainerAllocation) -> bool:
    if pod is None:
        return False
    for c in podinfo.containers(pod):
        if c.get("name") == alloc.container:
            value = podinfo.container_env(c, "compat32")
            return value is not None and value.lower() == "true"
    return False
