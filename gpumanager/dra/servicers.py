"""gRPC servicers of DRA mode: pluginregistration.Registration, DRAPlugin v1 and v1beta1, DRAResourceHealth."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from gpumanager.api import dra_v1_pb2 as v1
from gpumanager.api import dra_v1_pb2_grpc as v1_grpc
from gpumanager.api import dra_v1beta1_pb2 as v1beta1
from gpumanager.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from gpumanager.api import drahealth_v1_pb2 as health_pb
from gpumanager.api import drahealth_v1_pb2_grpc as health_grpc
from gpumanager.api import pluginregistration_v1_pb2 as reg_pb
from gpumanager.api import pluginregistration_v1_pb2_grpc as reg_grpc
from gpumanager.dra import constants as c
from gpumanager.dra.claims import ClaimRef
from gpumanager.dra.prepare import ClaimPreparer

log = logging.getLogger(__name__)

#: Longest health message the kubelet keeps.
MAX_HEALTH_MESSAGE = 1024
#: The kubelet's own health timeout: a device not reported again within it shows as Unknown.
KUBELET_HEALTH_TIMEOUT_SECONDS = 30


class RegistrationServicer(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    """Answers the kubelet's plugin watcher: who we are, where our service socket is."""

    def __init__(self, driver: str, endpoint: str, on_status: Callable[[bool, str], None]) -> None:
        self._info = reg_pb.PluginInfo(
            type=c.PLUGIN_TYPE, name=driver, endpoint=endpoint, supported_versions=list(c.SUPPORTED_VERSIONS)
        )
        self._on_status = on_status

    def GetInfo(self, request: reg_pb.InfoRequest, context: grpc.ServicerContext) -> reg_pb.PluginInfo:
        log.info("kubelet asked for plugin info: %s at %s", self._info.name, self._info.endpoint)
        return self._info

    def NotifyRegistrationStatus(
        self, request: reg_pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> reg_pb.RegistrationStatusResponse:
        self._on_status(bool(request.plugin_registered), str(request.error))
        return reg_pb.RegistrationStatusResponse()


def _refs(claims: Sequence[Any]) -> list[ClaimRef]:
    return [ClaimRef(namespace=cl.namespace, name=cl.name, uid=cl.uid) for cl in claims]


class DRAPluginV1(v1_grpc.DRAPluginServicer):  # type: ignore[misc]
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin``."""

    def __init__(self, preparer: ClaimPreparer, observe: Callable[[str, float, bool], None]) -> None:
        self._preparer = preparer
        self._observe = observe

    def NodePrepareResources(
        self, request: v1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodePrepareResourcesResponse:
        start = time.perf_counter()
        outcomes = self._preparer.prepare(_refs(request.claims))
        resp = v1.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = resp.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for d in outcome.devices:
                dev = entry.devices.add(
                    request_names=[d.request], pool_name=d.pool, device_name=d.device, cdi_device_ids=[d.cdi_id]
                )
                if d.share_id:
                    dev.share_id = d.share_id
        self._observe("NodePrepareResources", time.perf_counter() - start, all(not o.error for o in outcomes.values()))
        return resp

    def NodeUnprepareResources(
        self, request: v1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1.NodeUnprepareResourcesResponse:
        start = time.perf_counter()
        errors = self._preparer.unprepare(_refs(request.claims))
        resp = v1.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            resp.claims[uid].error = error
        self._observe("NodeUnprepareResources", time.perf_counter() - start, all(not e for e in errors.values()))
        return resp


class DRAPluginV1beta1(v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc]
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (no share IDs on the wire)."""

    def __init__(self, preparer: ClaimPreparer, observe: Callable[[str, float, bool], None]) -> None:
        self._preparer = preparer
        self._observe = observe

    def NodePrepareResources(
        self, request: v1beta1.NodePrepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodePrepareResourcesResponse:
        start = time.perf_counter()
        outcomes = self._preparer.prepare(_refs(request.claims))
        resp = v1beta1.NodePrepareResourcesResponse()
        for uid, outcome in outcomes.items():
            entry = resp.claims[uid]
            if outcome.error:
                entry.error = outcome.error
                continue
            for d in outcome.devices:
                entry.devices.add(
                    request_names=[d.request], pool_name=d.pool, device_name=d.device, cdi_device_ids=[d.cdi_id]
                )
        self._observe("NodePrepareResources", time.perf_counter() - start, all(not o.error for o in outcomes.values()))
        return resp

    def NodeUnprepareResources(
        self, request: v1beta1.NodeUnprepareResourcesRequest, context: grpc.ServicerContext
    ) -> v1beta1.NodeUnprepareResourcesResponse:
        start = time.perf_counter()
        errors = self._preparer.unprepare(_refs(request.claims))
        resp = v1beta1.NodeUnprepareResourcesResponse()
        for uid, error in errors.items():
            resp.claims[uid].error = error
        self._observe("NodeUnprepareResources", time.perf_counter() - start, all(not e for e in errors.values()))
        return resp


@dataclass(frozen=True)
class DeviceHealthState:
    """Health of one device as the stream reports it."""

    device: str
    healthy: bool
    message: str
    updated: float  # Unix seconds


class HealthFeed:
    """The latest health of every device, and a condition to wait for the next change.

    The kubelet takes a device's health as Unknown once it has not heard of the device for the
    report's ``health_check_timeout_seconds`` (30 s when unset), so the full list is sent again
    every ``report_period`` seconds (each GPU is probed that often) and the timeout announced is
    three periods, at least the kubelet's default.
    """

    def __init__(self, pool: str, states: Callable[[], list[DeviceHealthState]], report_period: float = 1.0) -> None:
        self.pool = pool
        self._states = states
        self.report_period = report_period
        self.timeout_seconds = max(KUBELET_HEALTH_TIMEOUT_SECONDS, math.ceil(3 * report_period))
        self._cond = threading.Condition()
        self._version = 0
        self._closed = False

    def changed(self) -> None:
        """A device's health changed: wake every stream."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()

    def close(self) -> None:
        """End every stream."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def message(self) -> health_pb.NodeWatchResourcesResponse:
        """The complete list, as sent on the stream (every device observed now)."""
        resp = health_pb.NodeWatchResourcesResponse()
        now = int(time.time())
        for s in self._states():
            resp.devices.add(
                device=health_pb.DeviceIdentifier(pool_name=self.pool, device_name=s.device),
                health=health_pb.HEALTHY if s.healthy else health_pb.UNHEALTHY,
                last_updated_time=now,
                health_check_timeout_seconds=self.timeout_seconds,
                message=s.message[:MAX_HEALTH_MESSAGE],
            )
        return resp

    def wait(self, seen: int, timeout: float) -> tuple[int, bool]:
        """Wait for a version newer than ``seen``; returns (version, closed)."""
        with self._cond:
            if self._version == seen and not self._closed:
                self._cond.wait(timeout)
            return self._version, self._closed


def add_health_servicer(servicer: HealthServicer, server: grpc.Server) -> None:
    """Serve the health stream as ``v1.DRAResourceHealth`` and, for kubelets of the beta and alpha
    APIs, as ``v1beta1.DRAResourceHealth`` and ``v1alpha1.DRAResourceHealth`` (the same messages)."""
    health_grpc.add_DRAResourceHealthServicer_to_server(servicer, server)
    for name in c.HEALTH_SERVICES[1:]:  # the first, v1, is the generated servicer's
        handler = grpc.unary_stream_rpc_method_handler(
            servicer.NodeWatchResources,
            request_deserializer=health_pb.NodeWatchResourcesRequest.FromString,
            response_serializer=health_pb.NodeWatchResourcesResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, {"NodeWatchResources": handler}),))


class HealthServicer(health_grpc.DRAResourceHealthServicer):  # type: ignore[misc]
    """``v1.DRAResourceHealth``: the full device list at once and after every health change."""

    def __init__(self, feed: HealthFeed) -> None:
        self._feed = feed

    def NodeWatchResources(
        self, request: health_pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[health_pb.NodeWatchResourcesResponse]:
        version, closed = self._feed.wait(-1, 0)
        yield self._feed.message()
        sent = time.monotonic()
        while context.is_active():
            due = sent + self._feed.report_period
            new, closed = self._feed.wait(version, max(0.0, min(1.0, due - time.monotonic())))
            if closed:
                return
            if new != version or time.monotonic() >= due:
                version = new
                yield self._feed.message()
                sent = time.monotonic()
