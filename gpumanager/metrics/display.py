"""The ``display.GPUDisplay`` gRPC service (PrintGraph, PrintUsages, Version)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from gpumanager.api import display_pb2 as pb
from gpumanager.api import display_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DisplayServicer(pb_grpc.GPUDisplayServicer):  # type: ignore[misc]
    """Answers display queries from providers owned by the agent."""

    def __init__(
        self,
        *,
        graph: Callable[[], str],
        usages: Callable[[], pb.UsageResponse],
        version: str,
    ) -> None:
        self._graph = graph
        self._usages = usages
        self._version = version

    def PrintGraph(self, request: empty_pb2.Empty, context: grpc.ServicerContext) -> pb.GraphResponse:
        return pb.GraphResponse(graph=self._graph())

    def PrintUsages(self, request: empty_pb2.Empty, context: grpc.ServicerContext) -> pb.UsageResponse:
        return self._usages()

    def Version(self, request: empty_pb2.Empty, context: grpc.ServicerContext) -> pb.VersionResponse:
        return pb.VersionResponse(version=self._version)


class DisplayServer:
    """Serves DisplayServicer on a unix socket (``/var/run/gpu-manager.sock`` by default)."""

    def __init__(self, servicer: DisplayServicer, socket_path: Path) -> None:
        self._servicer = servicer
        self.socket_path = socket_path
        self._server: grpc.Server | None = None

    def start(self) -> None:
        """Replace a stale socket and serve."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="display"))
        pb_grpc.add_GPUDisplayServicer_to_server(self._servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        log.info("display service on %s", self.socket_path)

    def stop(self) -> None:
        """Stop serving and remove the socket."""
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        if self._server is not None:
            self._server.stop(grace=0.2).wait(0.3)
            self._server = None
