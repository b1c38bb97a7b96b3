"""A gRPC server on a unix socket in the device-plugin directory, serving one ResourceServicer."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.servicer import ResourceServicer

SERVICE = "v1beta1.DevicePlugin"

log = logging.getLogger(__name__)


def _passthrough(message: bytes | pb.ListAndWatchResponse) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def method_handlers(servicer: ResourceServicer) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
    """The DevicePlugin service's handlers; ListAndWatch sends its prepared bytes without re-encoding."""
    return {
        "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(
            servicer.GetDevicePluginOptions,
            request_deserializer=pb.Empty.FromString,
            response_serializer=pb.DevicePluginOptions.SerializeToString,
        ),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            servicer.ListAndWatch, request_deserializer=pb.Empty.FromString, response_serializer=_passthrough
        ),
        "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
            servicer.GetPreferredAllocation,
            request_deserializer=pb.PreferredAllocationRequest.FromString,
            response_serializer=pb.PreferredAllocationResponse.SerializeToString,
        ),
        "Allocate": grpc.unary_unary_rpc_method_handler(
            servicer.Allocate,
            request_deserializer=pb.AllocateRequest.FromString,
            response_serializer=pb.AllocateResponse.SerializeToString,
        ),
        "PreStartContainer": grpc.unary_unary_rpc_method_handler(
            servicer.PreStartContainer,
            request_deserializer=pb.PreStartContainerRequest.FromString,
            response_serializer=pb.PreStartContainerResponse.SerializeToString,
        ),
    }


def socket_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a file, or None when it does not exist; tells a re-created file apart."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino)


def check_bindable(path: Path) -> None:
    """Bind a unix socket at ``path`` and remove it again: an OSError with the errno and the path where
    the socket cannot be made (a directory the agent may not write, a read-only file system), which
    gRPC's bind reports only as "Failed to bind to address", with its reason in a line of its own
    written to stderr by the gRPC core."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(str(path))
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def socket_served(path: Path, timeout: float = 0.2) -> bool:
    """Whether a process accepts connections on the unix socket at ``path`` (a live socket, not a stale file)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(str(path))
        except (BlockingIOError, TimeoutError):
            return True  # listening, its backlog full
        except OSError:
            return False
    return True


#: Calls served at once. The kubelet's ListAndWatch holds one for good, and each pod's worker calls
#: PreStartContainer when its containers start: fifty pods starting together are fifty calls, each
#: waiting a moment for PodResources and the disk. A pool of 8 made them queue behind each other.
MAX_WORKERS = 32


class PluginServer:
    """Owns the socket file and the gRPC server of one resource."""

    def __init__(self, servicer: ResourceServicer, socket_path: Path, *, max_workers: int = MAX_WORKERS) -> None:
        self.servicer = servicer
        self.socket_path = socket_path
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
        self.identity: tuple[int, int] | None = None
        self._closed = False
        self._lock = threading.RLock()  # start, restart and close one at a time

    def start(self) -> None:
        """Remove a stale socket, listen, serve. Raises RuntimeError after :meth:`close`."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.servicer.resource} server on {self.socket_path} is closed")
            self._start()

    def _start(self) -> None:
        # The kubelet makes its device-plugin directory with mode 0750; one we make again is the same.
        self.socket_path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        try:
            self.socket_path.unlink()
        except FileNotFoundError:
            pass
        if self._executor is None:
            # One pool for the server's whole life: restarts after a kubelet restart reuse its threads.
            self._executor = futures.ThreadPoolExecutor(
                max_workers=self._max_workers, thread_name_prefix="dp-" + self.socket_path.stem
            )
        check_bindable(self.socket_path)
        server = grpc.server(self._executor)
        handlers = method_handlers(self.servicer)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self._server = server
        self.identity = socket_identity(self.socket_path)
        log.debug("serving %s on %s", self.servicer.resource, self.socket_path)

    def stop(self, *, remove_socket: bool = True, wait: float = 2.0) -> None:
        """Stop serving; remove our socket file unless someone else has replaced it."""
        if remove_socket and self.identity is not None and socket_identity(self.socket_path) == self.identity:
            try:
                self.socket_path.unlink()
            except FileNotFoundError:
                pass
        self.servicer.stop()
        if self._server is not None:
            self._server.stop(grace=min(0.5, wait)).wait(wait)
            self._server = None
        self.identity = None

    def restart(self) -> None:
        """Serve on a fresh socket at once (ours was removed by someone else).

        The old server is cancelled without grace first: its listener removes the socket path when
        it closes, which must not be the new server's.
        """
        with self._lock:
            if self._closed:
                return
            self.servicer.stop()
            old, self._server = self._server, None
            self.identity = None
            if old is not None:
                old.stop(grace=None).wait(1.0)
            self._start()

    def close(self) -> None:
        """Stop for good: also release the worker threads (grpc does not own the pool it was given)."""
        with self._lock:
            self._closed = True
            self.stop(remove_socket=True, wait=0.3)
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None

    def socket_intact(self) -> bool:
        """Whether our socket file is still the one we created."""
        return self.identity is not None and socket_identity(self.socket_path) == self.identity
