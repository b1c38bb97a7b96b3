"""The ``display.GPUDisplay`` gRPC service (PrintGraph, PrintUsages, Version).

Served by grpc.aio on a loop of its own: grpc's threaded server wakes five times a second to
look for signals, each server on its own; the asyncio server sleeps until a call comes. The
calls themselves run in a small pool of threads (they read the allocator and NVML).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from gpumanager.api import display_pb2 as pb
from gpumanager.api import display_pb2_grpc as pb_grpc
from gpumanager.deviceplugin.server import check_bindable

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
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: futures.ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Replace a stale socket and serve; anything else at the path is left there (OSError)."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = os.lstat(self.socket_path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):  # a file named by mistake is never removed
                raise OSError(f"{self.socket_path} exists and is not a socket; it is left as it is")
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        check_bindable(self.socket_path)
        pool = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="display")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="display-loop", daemon=True)
        thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(self._serve(pool), loop).result(timeout=10)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=1)
            pool.shutdown(wait=False)
            raise
        self._loop, self._thread, self._pool = loop, thread, pool
        log.info("display service on %s", self.socket_path)

    async def _serve(self, pool: futures.ThreadPoolExecutor) -> grpc.aio.Server:
        server = grpc.aio.server(migration_thread_pool=pool)
        pb_grpc.add_GPUDisplayServicer_to_server(self._servicer, server)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        await server.start()
        return server

    def stop(self) -> None:
        """Stop serving and remove the socket (only a socket: a file there was never ours)."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                self.socket_path.unlink()
        loop, server = self._loop, self._server
        if loop is not None and server is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(server.stop(0.2), loop).result(timeout=0.5)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=0.5)
            if not loop.is_running():
                loop.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._server = self._loop = self._thread = self._pool = None
