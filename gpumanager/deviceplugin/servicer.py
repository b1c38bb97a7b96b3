"""The DevicePlugin gRPC servicer for one resource (vcuda-core or vcuda-memory)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from gpumanager import deferred
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

#: The encoded ListAndWatchResponse to send now (prepared by :class:`~gpumanager.deviceplugin.devicelists.DeviceLists`).
DeviceSource = Callable[[], bytes]
PreferenceFn = Callable[[Sequence[str], Sequence[str], int], list[str]]
_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
AllocateFn = Callable[[pb.AllocateRequest], pb.AllocateResponse]
PreStartFn = Callable[[pb.PreStartContainerRequest], pb.PreStartContainerResponse]


class RequestError(Exception):
    """A request the plugin refuses; carries the gRPC status code and a message for the kubelet."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ResourceServicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    """Serves one extended resource to the kubelet.

    ListAndWatch sends the full device list at once and again whenever
    :meth:`notify` is called (health changes); the list arrives encoded and is
    sent as it is (:func:`~gpumanager.deviceplugin.server.method_handlers`).
    Allocate and PreStartContainer are delegated to handlers; without one the
    call answers UNIMPLEMENTED.
    """

    def __init__(
        self,
        resource: str,
        *,
        devices: DeviceSource,
        options: pb.DevicePluginOptions,
        preference: PreferenceFn | None = None,
        allocate: AllocateFn | None = None,
        pre_start: PreStartFn | None = None,
        stream_poll: float = 30.0,
    ) -> None:
        self.resource = resource
        self._devices = devices
        self._options = options
        self._preference = preference
        self._allocate = allocate
        self._pre_start = pre_start
        self._poll = stream_poll
        self._cond = threading.Condition()
        self._version = 0
        # Bumped by stop(): streams of an older generation end, new ones start fresh.
        self._generation = 0
        self.streams_served = 0
        #: Set once a ListAndWatch stream has sent its full list (the start's background work waits for it).
        self.first_list_sent = threading.Event()

    def notify(self) -> None:
        """The device list changed: every open ListAndWatch stream sends it again."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def stop(self) -> None:
        """End every ListAndWatch stream opened so far (later streams are served normally)."""
        with self._cond:
            self._generation += 1
            self._cond.notify_all()

    def _changed(self, generation: int, sent: int, context: grpc.ServicerContext) -> Callable[[], bool]:
        return lambda: self._generation != generation or self._version != sent or not context.is_active()

    @property
    def options(self) -> pb.DevicePluginOptions:
        """The options this resource registers with and answers GetDevicePluginOptions with."""
        return self._options

    # -- RPCs ---------------------------------------------------------------------------------------

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return self._options

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[bytes]:
        self.streams_served += 1
        sent = -1
        with self._cond:
            generation = self._generation
        # Wake at once when the kubelet goes away instead of polling for it.
        context.add_callback(self.wake)
        log.info("%s: kubelet opened ListAndWatch", self.resource)
        while True:
            with self._cond:
                self._cond.wait_for(self._changed(generation, sent, context), timeout=self._poll)
                if self._generation != generation:
                    return
                version = self._version
            if not context.is_active():
                log.info("%s: ListAndWatch stream closed by the kubelet", self.resource)
                return
            if version == sent:
                continue
            encoded = self._devices()
            log.debug("%s: sending the device list (%d bytes)", self.resource, len(encoded))
            yield encoded  # resumed once the message is sent, when gRPC asks for the next
            sent = version
            self.first_list_sent.set()

    def wake(self) -> None:
        """Let every stream look at its state again (a stream ended)."""
        with self._cond:
            self._cond.notify_all()

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        responses = []
        for creq in request.container_requests:
            available = creq.available_deviceIDs  # thousands of IDs: read where they are used, not copied first
            must = list(creq.must_include_deviceIDs)
            size = int(creq.allocation_size)
            chosen: list[str] = []
            if self._preference is not None:
                try:
                    chosen = self._preference(available, must, size)
                except RequestError as exc:  # expected (the agent still starting): no traceback
                    log.warning("%s: %s; returning no preference", self.resource, exc)
                    chosen = []
                except Exception:
                    # The answer is advisory: on any failure let the kubelet choose.
                    log.exception("%s: GetPreferredAllocation failed; returning no preference", self.resource)
                    chosen = []
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        if self._allocate is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{self.resource}: Allocate is not implemented by this version of gpu-manager",
            )
        return self._call(self._allocate, request, context, "Allocate")

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        if self._pre_start is None:
            context.abort(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{self.resource}: PreStartContainer is not implemented by this version of gpu-manager",
            )
        return self._call(self._pre_start, request, context, "PreStartContainer")

    def _call(self, fn: Callable[[_Req], _Resp], request: _Req, context: grpc.ServicerContext, name: str) -> _Resp:
        # What the answer does not wait for (log lines, metrics, wake-ups) runs once it has been sent.
        outer = deferred.begin()
        try:
            return fn(request)
        except RequestError as exc:
            log.warning("%s %s refused: %s", self.resource, name, exc)
            context.abort(exc.code, str(exc))
        except Exception as exc:
            log.exception("%s %s failed", self.resource, name)
            context.abort(grpc.StatusCode.INTERNAL, f"{self.resource} {name} failed: {exc}")
        finally:
            deferred.end(outer, context)
        raise AssertionError("unreachable")  # context.abort always raises
