"""Allocate and PreStartContainer for both resources: validation, conversion to protobuf, error mapping."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from gpumanager import deferred, names
from gpumanager.allocation import ids as device_ids
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.model import RECENT_LIST_SECONDS
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError
from gpumanager.deviceplugin.replaced import ReplacedGPUs, ReplacedRefusal
from gpumanager.deviceplugin.servicer import RequestError
from gpumanager.faults import crash_point

log = logging.getLogger(__name__)

_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "mismatch": grpc.StatusCode.FAILED_PRECONDITION,
}

#: (resource, device IDs, (namespace, pod) to ask first, when their Allocate reached us, when their admission
#: began) -> (pod UID, container).
OwnerFn = Callable[[str, Sequence[str], tuple[str, str] | None, float | None, float | None], tuple[str, str] | None]
#: Blocks (bounded) until Allocate can be served; returns '' or why it cannot be yet.
ReadyFn = Callable[[], str]
PreparedFn = Callable[[ContainerAllocation], None]
Observer = Callable[[str, str, float, bool], None]  # (resource, call, seconds, ok)


def to_pb(resp: ContainerResponse) -> pb.ContainerAllocateResponse:
    """Our plain answer as the kubelet's message."""
    msg = pb.ContainerAllocateResponse()
    fill_pb(resp, msg)
    return msg


def fill_pb(resp: ContainerResponse, msg: pb.ContainerAllocateResponse) -> None:
    """Write our plain answer into ``msg`` (empty), built in place: a message given to a repeated field
    or a constructor is copied, and a map given to a constructor goes through the MutableMapping ABC's
    update (several Python calls per map, on every Allocate)."""
    mounts, devices, envs, annotations = msg.mounts, msg.devices, msg.envs, msg.annotations
    for m in resp.mounts:
        mounts.add(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
    for d in resp.devices:
        devices.add(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
    for key, value in resp.envs.items():
        envs[key] = value
    for key, value in resp.annotations.items():
        annotations[key] = value


class Handlers:
    """The kubelet-facing calls that change allocation state."""

    def __init__(
        self,
        *,
        allocator: Allocator,
        layout: DeviceLayout,
        owner: OwnerFn,
        prepared: PreparedFn,
        observe: Observer | None = None,
        ready: ReadyFn | None = None,
        replaced: ReplacedGPUs | None = None,
    ) -> None:
        self._allocator = allocator
        self._replaced = replaced if replaced is not None and replaced.active else None
        self._ready = ready
        self._layout = layout
        self._owner = owner
        self._prepared = prepared
        self._observe = observe

    def _validate(self, resource: str, ids: Sequence[str]) -> None:
        # The common case in one pass of C: no ID twice, every one of this node. Otherwise each ID
        # is looked at, for a message that names the first wrong one.
        unique = set(ids)
        if len(unique) == len(ids) and self._layout.positions(resource).keys() >= unique:
            return
        doubled = device_ids.duplicates(ids)
        if doubled:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{resource}: {device_ids.describe(ids)}: device ID {device_ids.shown(doubled[0])} "
                "appears more than once",
            )
        for device_id in ids:
            try:
                self._layout.gpu_of(resource, device_id)
            except UnknownDeviceError as exc:
                raise RequestError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"{resource}: {device_ids.describe(ids)}: {exc}"
                ) from exc

    def _timed(self, resource: str, call: str, started: float, ok: bool) -> None:
        if self._observe is not None:  # recorded once the call is answered
            deferred.later(self._observe, resource, call, time.perf_counter() - started, ok)

    def allocate_core(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """vcuda-core Allocate: one answer per container request (the kubelet sends one)."""
        started = time.perf_counter()
        ok = False
        try:
            if not request.container_requests:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty container request")
            answer = pb.AllocateResponse()
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                self._validate(names.VCORE_RESOURCE, ids)
                problem = self._ready() if self._ready is not None else ""
                if problem:
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE, f"Allocate for {device_ids.describe(ids)}: {problem}"
                    )
                try:
                    allocated = self._allocator.allocate(ids)
                except AllocationError as exc:
                    raise RequestError(_CODES.get(exc.kind, grpc.StatusCode.UNKNOWN), str(exc)) from exc
                fill_pb(allocated, answer.container_responses.add())
            ok = True
            return answer
        finally:
            self._timed(names.VCORE_RESOURCE, "Allocate", started, ok)

    def allocate_memory(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        """vcuda-memory Allocate: validated, and one empty answer per container request (the memory
        size is read from the pod spec by the vcuda-core side); refused for a container that asks for
        memory without cores (:meth:`Allocator.memory_only_refusal`)."""
        started = time.perf_counter()
        ok = False
        try:
            for creq in request.container_requests:
                ids = list(creq.devices_ids)
                self._validate(names.VMEMORY_RESOURCE, ids)
                problem = self._allocator.memory_only_refusal(len(ids), ids) if self._allocator is not None else ""
                if problem:
                    raise RequestError(
                        grpc.StatusCode.INVALID_ARGUMENT, f"Allocate for {device_ids.describe(ids)}: {problem}"
                    )
            answer = pb.AllocateResponse()
            for _ in request.container_requests:
                answer.container_responses.add()  # an empty answer each, made in place (not copied)
            ok = True
            return answer
        finally:
            self._timed(names.VMEMORY_RESOURCE, "Allocate", started, ok)

    def pre_start_core(self, request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        """vcuda-core PreStartContainer: who starts (the kubelet's view), check, write the limit files."""
        started = time.perf_counter()
        ok = False
        try:
            ids = list(request.devices_ids)
            self._validate(names.VCORE_RESOURCE, ids)
            hint = self._allocator.owner_hint(ids)
            owner = self._owner(names.VCORE_RESOURCE, ids, hint.pod, hint.since, hint.listed)
            try:
                alloc = self._allocator.prepare_start(ids, owner)  # marked started once its files are written
            except AllocationError as exc:
                why = (
                    self._replaced.explain_missing(*owner)
                    if self._replaced and owner and exc.kind == "not_found"
                    else ""
                )
                if why:  # its record could not be kept: it named a device node that is no GPU now
                    raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"{names.PRESTART_FAILED}: {why}") from exc
                raise RequestError(_CODES.get(exc.kind, grpc.StatusCode.UNKNOWN), str(exc)) from exc
            replaced = self._replaced
            on_replacement = False  # its room on a replacement reserved until noted or dropped
            if replaced is not None:
                try:
                    on_replacement = replaced.check(alloc)
                except ReplacedRefusal as exc:
                    # For good: "PreStartContainer check failed" (the pod is to be placed again); a start
                    # waiting for room on the replacement is retried by the kubelet (UNAVAILABLE).
                    if exc.lasting:
                        raise RequestError(
                            grpc.StatusCode.FAILED_PRECONDITION, f"{names.PRESTART_FAILED}: {exc}"
                        ) from exc
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc
            try:
                self._start(alloc, ids)
            except BaseException:
                if on_replacement and replaced is not None:
                    replaced.forget(alloc)  # it did not start: no room taken there
                raise
            if on_replacement and replaced is not None:
                replaced.note_started(alloc)  # counted there from now on (and at the agent's next start)
            crash_point("prestart-after-files")
            ok = True
            return pb.PreStartContainerResponse()
        finally:
            self._timed(names.VCORE_RESOURCE, "PreStartContainer", started, ok)

    def _start(self, alloc: ContainerAllocation, ids: Sequence[str]) -> None:
        """A start let through by the checks: write the container's files, then mark its record started."""
        crash_point("prestart-before-files")
        try:
            self._prepared(alloc)
        except OSError as exc:
            # The kubelet retries the start; the message says whose files could not be written and why.
            # Not upstream's "PreStartContainer check failed": the kubelet puts the message in the
            # container's waiting state, where it marks the pod failed for good (its GPUs freed by
            # the allocation check, the pod deleted when a controller owns it).
            raise RequestError(
                grpc.StatusCode.UNAVAILABLE,
                f"PreStartContainer for pod {alloc.pod_uid} container {alloc.container} "
                f"({device_ids.describe(ids)}): cannot write its files: {_oserror(exc)}; "
                "the kubelet's next try of the start writes them again",
            ) from exc
        try:
            self._allocator.mark_started(alloc)
        except AllocationError as exc:
            raise RequestError(_CODES.get(exc.kind, grpc.StatusCode.UNKNOWN), str(exc)) from exc

    def pre_start_memory(self, request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        """vcuda-memory PreStartContainer: nothing to do beyond validation.

        IDs past the last this node advertises are accepted (logged): memory IDs are numbered from each
        GPU's size, so a GPU with less memory after a restart (ECC turned on, or replaced by a smaller one)
        leaves the kubelet holding IDs for running containers that are no longer listed, and it names them
        at every start of those containers. They only counted memory (the size comes from the pod spec):
        refusing them would keep the container from ever starting again."""
        ids = list(request.devices_ids)
        try:
            self._validate(names.VMEMORY_RESOURCE, ids)
        except RequestError:
            if device_ids.duplicates(ids) or not all(self._past_the_last(i) for i in self._unknown_memory(ids)):
                raise
            unknown = self._unknown_memory(ids)
            log.warning(
                "vcuda-memory PreStartContainer for %s: %d of them (%s) are past the last ID this node "
                "advertises (%d): a GPU has less memory than when the kubelet handed them out (ECC turned on, "
                "or the GPU replaced); accepted, as the container's memory limit comes from its pod spec",
                device_ids.describe(ids),
                len(unknown),
                device_ids.describe(unknown),
                self._layout.count(names.VMEMORY_RESOURCE),
            )
        self._refuse_memory_only(ids)
        return pb.PreStartContainerResponse()

    def _refuse_memory_only(self, ids: Sequence[str]) -> None:
        """Refuse the start of a container asking for vcuda-memory without vcuda-core whose Allocate was
        answered beside a pending share of its size (:meth:`Allocator.memory_only_starting`): the kubelet's
        records say whose IDs these are. So is one whose Allocate the pod cache could not explain (its watch
        lagged: :meth:`Allocator.memory_unexplained_since`), from its pod's spec. Nothing is asked otherwise."""
        if self._allocator is None:
            return
        suspects = self._allocator.memory_only_starting(len(ids))
        since = self._allocator.memory_unexplained_since(ids)
        if not suspects and since is None:
            return
        # The pod's UID from the cache, else from a list sent for this admission: its vcuda-core Allocate, which
        # may have come just before this memory's (the kubelet allocates a container's resources in any order).
        listed = since - RECENT_LIST_SECONDS if since is not None else None
        owner = self._owner(names.VMEMORY_RESOURCE, ids, None, since, listed)
        if owner is None:
            log.warning(
                "vcuda-memory PreStartContainer for %s: neither the kubelet's PodResources nor its checkpoint "
                "names the container holding these IDs; started without checking that it asks for %s too",
                device_ids.describe(ids),
                names.VCORE_RESOURCE,
            )
            self._allocator.settle_memory_unexplained(ids)
            return
        who = suspects.get(owner)
        why = "a pending container with cores asked for the same memory"
        handed = False  # the memory-only container is an init container, not the holder the records name
        if who is None:
            # The kubelet's records name the app container its init container handed the IDs on to.
            who = self._allocator.memory_only_init(owner[0], len(ids)) or None
            why = f"the kubelet hands its IDs on to container {owner[1]}, which asks for cores"
            handed = who is not None
        if who is None:
            # Not a container the cache shows (its watch lags): its pod's spec says, from a list if need be.
            seen = since if since is not None else time.monotonic() - RECENT_LIST_SECONDS
            who = self._allocator.memory_only_owner(owner, seen) or None
            why = "the pod was not yet known to this node's agent"
        if who is None:
            self._allocator.settle_memory_unexplained(ids)
            return
        # The holder is at fault; where it is an app container and an init container with cores has not run,
        # the start is that init container's, which hands it these IDs: the pod cannot run as written.
        starting = "" if handed else self._allocator.init_handing_on(owner[0], len(ids))
        raise RequestError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{names.PRESTART_FAILED}: {who} asks for {len(ids)} {names.VMEMORY_RESOURCE} without "
            f"{names.VCORE_RESOURCE} ({device_ids.describe(ids)}): memory alone gives no GPU (a share asks for "
            f"both, a whole GPU for {names.VCORE_RESOURCE} in hundreds); its Allocate was answered because {why}"
            + (
                f"; this is the start of {starting}, whose IDs the kubelet hands on to container {owner[1]}: "
                "the pod cannot run as written"
                if starting
                else ""
            ),
        )

    def _unknown_memory(self, ids: Sequence[str]) -> list[str]:
        known = self._layout.positions(names.VMEMORY_RESOURCE)
        return [i for i in ids if i not in known]

    def _past_the_last(self, device_id: str) -> bool:
        """Whether ``device_id`` is a well-formed vcuda-memory ID numbered past this node's last one."""
        prefix = self._layout.prefix(names.VMEMORY_RESOURCE)
        text = device_id[len(prefix) :] if device_id.startswith(prefix) else ""
        number = device_ids.tail_number(text)
        return number is not None and text == str(number) and number >= self._layout.count(names.VMEMORY_RESOURCE)


def _oserror(exc: OSError) -> str:
    """``/path: [Errno 28] No space left on device (ENOSPC)``: the file, the errno by number and by name."""
    name = errno.errorcode.get(exc.errno or 0, "")
    text = f"[Errno {exc.errno}] {exc.strerror}" if exc.errno else str(exc)
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{text} ({name})" if name else f"{where}{text}"
