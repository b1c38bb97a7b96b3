"""Every pod's ``vcuda.sock`` served by one gRPC server.

The upstream vcuda-controller library registers a container by calling
``vcuda.VCUDAService/RegisterVDevice`` on ``/etc/vcuda/vcuda.sock``, the
pod's own socket (``<vm>/<pod uid>/vcuda.sock`` on the host). A gRPC server
per pod would cost a server, its threads and its memory for each running pod,
and grpcio cannot add a listening port to a server that has started.

So one gRPC server (grpc.aio) listens on a unix socket in a private directory
(mode 0700, made at start: no container reaches it; an abstract address would be
open to every process in the host's network namespace, a hostNetwork pod
included, which finds it in ``/proc/net/unix`` and could connect to it without
any limit; it is the fallback, logged, when no temporary directory is writable),
and the same thread (one asyncio loop) listens on every pod's
``vcuda.sock``. Each connection accepted there is relayed, byte for byte, to the
gRPC server over a new connection whose own address names it
(``<server name>.<random>``, an abstract address bound for that connection only,
unguessable); the server looks that address up among the relayed connections and
so knows which pod's socket the call came in on. A call on any other connection
is refused.

A call waits without holding a thread (a registration may wait for the pod's
status), and a pod holds at most :data:`MAX_CONNECTIONS_PER_POD` connections
with one call each (at most :data:`MAX_WAITING_PER_POD` more wait
:data:`SLOT_WAIT_SECONDS` for one of them to end, then are closed; any further one
is closed at once, and the closings are logged at most once a minute per pod, naming
the connecting process and its container), all pods together at most
:data:`MAX_CONNECTIONS_TOTAL` (fewer under a low descriptor limit), and a connection
without a call in progress (idle, or stopped half-way through its first bytes) is
closed after :data:`IDLE_SECONDS`; so no pod can keep another pod's calls waiting,
nor hold the agent's descriptors or fill its log by connecting without pause. A pod costs
one listening socket and a dictionary entry; a call in progress costs two
sockets. When a pod's socket is no longer served, its relayed connections end.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import os
import re
import resource
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from gpumanager.api import vcuda_pb2 as pb

log = logging.getLogger(__name__)

#: The longest unix socket path (sun_path holds 108 bytes with the NUL).
MAX_SOCKET_PATH = 107
#: serve() calls of pods in one stripe take turns (two calls for one pod always do).
POD_LOCK_STRIPES = 64
#: Connections relayed at once for one pod; more are closed at once (a container cannot take them all).
MAX_CONNECTIONS_PER_POD = 16
#: How long a connection over that limit waits for one of the pod's others to end before it is closed.
SLOT_WAIT_SECONDS = 0.5
#: Connections of one pod waiting so at once; one more is closed as soon as it is accepted.
MAX_WAITING_PER_POD = 16
#: Connections closed over the limit are logged once per pod in each such window (with their count).
CLOSED_LOG_WINDOW_SECONDS = 60.0
#: Connections relayed at once for all pods together (each costs the agent three descriptors); under a
#: low descriptor limit at most an eighth of it.
MAX_CONNECTIONS_TOTAL = 1024
#: A connection without a call in progress (one that sends nothing, or stops half-way through a
#: request) is closed after this long; a call waiting for its pod's status is not idle.
IDLE_SECONDS = 10.0
#: Calls at once on one connection (the clients make one call per connection).
CALLS_PER_CONNECTION = 1
#: The longest a relayed connection lives (a registration is one short call).
CONNECTION_LIFETIME_SECONDS = 300.0
#: The largest request the server reads (a RegisterVDevice request is a few hundred bytes; a larger
#: one is refused by gRPC, RESOURCE_EXHAUSTED, before it is decoded or logged).
MAX_REQUEST_BYTES = 16 * 1024
_RELAY_CHUNK = 64 * 1024
_ABSTRACT_PEER = "unix-abstract:"
#: The private directories of the server's socket: ``<tmp>/gpu-manager-vcuda.<pid>.<random>``.
_PRIVATE_PREFIX = "gpu-manager-vcuda."
_SERVICE = "vcuda.VCUDAService"

#: Handles one call on the relay's loop: (pod UID of the socket, request, seconds left before the
#: caller's deadline or None). It must not block the loop (waits are awaited; file work in a thread).
Handler = Callable[[str, pb.VDeviceRequest, float | None], Awaitable[None]]


@dataclass(eq=False)
class _Listener:
    """A pod's listening socket: bound and listening from :meth:`PodSockets.serve` on, accepted from
    once the loop has taken it up (``server``). ``closed``: the pod is no longer served."""

    sock: socket.socket
    path: Path
    ident: tuple[int, int]  # (st_dev, st_ino) of the socket file we made
    server: asyncio.Server | None = None
    taken_up: bool = False
    closed: bool = False


class CallRefused(Exception):
    """A call the handler refuses; ``code`` is the gRPC status it is answered with."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class _Servicer:
    """``vcuda.VCUDAService``, given each request as the bytes that came (decoded here: bytes that are no
    ``VDeviceRequest`` are a refusal of the caller's, not an error of the agent with a traceback)."""

    def __init__(self, sockets: PodSockets) -> None:
        self._sockets = sockets

    def add_to(self, server: grpc.aio.Server) -> None:
        """Serve ``vcuda.VCUDAService/RegisterVDevice`` on ``server``."""
        handlers = {
            # Request-streaming on our side (a unary call on the wire): the handler runs once the call's
            # headers came, so a request that never comes whole is given up after IDLE_SECONDS.
            "RegisterVDevice": grpc.stream_unary_rpc_method_handler(
                self.RegisterVDevice, response_serializer=pb.VDeviceResponse.SerializeToString
            )
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))

    async def RegisterVDevice(
        self, _requests: object, context: grpc.aio.ServicerContext[bytes, pb.VDeviceResponse]
    ) -> pb.VDeviceResponse:
        peer = context.peer()
        pod_uid = self._sockets.pod_of_peer(peer)
        if pod_uid is None:
            self._sockets.log_stray(peer)
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "this connection did not come in on a pod's vcuda.sock"
            )
            raise AssertionError("abort returned")  # abort always raises
        # A call whose request stops half-way (headers, then nothing) is no call in progress: it would
        # hold its pod's connection slot for CONNECTION_LIFETIME_SECONDS.
        try:
            raw = await asyncio.wait_for(context.read(), IDLE_SECONDS)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no request came within {IDLE_SECONDS:g} s of the call"
            )
            raise AssertionError("abort returned") from None
        if not isinstance(raw, bytes):  # grpc.aio.EOF: the call ended without a request
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request")
            raise AssertionError("abort returned")
        try:
            request = pb.VDeviceRequest.FromString(raw)
        except DecodeError as exc:
            self._sockets.log_malformed(pod_uid, len(raw), exc)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a VDeviceRequest: {exc}")
            raise AssertionError("abort returned") from None
        try:
            await self._sockets.handler(pod_uid, request, context.time_remaining())
        except CallRefused as exc:
            await context.abort(exc.code, str(exc))
        return pb.VDeviceResponse()


class PodSockets:
    """Listens on pods' ``vcuda.sock`` files and serves them all from one gRPC server."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        # Abstract names: nothing on disk to clean up; unique per process and start.
        self._name = f"gpu-manager-vcuda.{os.getpid()}.{secrets.token_hex(6)}"
        self._lock = threading.Lock()
        self._peers: dict[str, str] = {}  # bound name of a relayed connection -> pod UID
        self._listeners: dict[str, _Listener] = {}
        self._active: dict[str, int] = {}  # pod UID -> relayed connections now
        self._total = 0  # relayed connections of all pods now
        self._waiting: dict[str, int] = {}  # pod UID -> connections waiting for one of its slots
        # pod UID -> (when its last closing over the limit was logged, closings not logged since)
        self._closed_log: dict[str, tuple[float, int]] = {}
        self._malformed_log: dict[str, tuple[float, int]] = {}  # the same, for requests that do not decode
        self._relays: dict[str, set[asyncio.Task[None]]] = {}  # pod UID -> its relay tasks (on the loop)
        self._server: grpc.aio.Server | None = None
        # serve() for one pod at a time (a lock per stripe of pods: fifty pods served at once do not
        # wait for each other's bind); stop() waits for the serves in progress and refuses later ones.
        self._pod_locks = [threading.Lock() for _ in range(POD_LOCK_STRIPES)]
        self._serves = 0
        self._serves_done = threading.Condition(self._lock)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._private: str | None = None  # the directory of the server's socket, while it runs
        self._address = ""  # the server's socket in it

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the relay thread and, on its loop, the gRPC server (no pod socket yet)."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="vcuda-relay", daemon=True)
        thread.start()
        try:
            self._server = asyncio.run_coroutine_threadsafe(self._start_server(), loop).result(timeout=10)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            self._remove_private()
            raise
        self._loop, self._thread = loop, thread
        self._stopping = False

    async def _start_server(self) -> grpc.aio.Server:
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", CALLS_PER_CONNECTION),
                ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ("grpc.max_connection_idle_ms", max(1, int(IDLE_SECONDS * 1000))),
                ("grpc.server_handshake_timeout_ms", max(1, int(IDLE_SECONDS * 1000))),
            ]
        )
        _Servicer(self).add_to(server)
        try:
            address = self._make_private()
            target = f"unix:{address}"
        except OSError as exc:  # a read-only root file system, say: the abstract address, open to the host network
            log.warning(
                "vcuda.sock: no private directory for the server behind the pod sockets (%s); it listens on an "
                "abstract address, which processes in the host's network namespace can reach",
                exc,
            )
            address, target = "\0" + self._name, f"unix-abstract:{self._name}"
        if server.add_insecure_port(target) == 0:
            raise OSError(f"cannot listen on the unix socket {target}")
        self._address = address
        await server.start()
        return server

    def _make_private(self) -> str:
        """A fresh private directory (mode 0700) for the server's socket; the path of that socket. In the
        temporary directory (``/tmp`` when that path is too long for a unix socket); the directories of
        agents no longer running are removed first (one killed leaves its directory behind)."""
        prefix = f"{_PRIVATE_PREFIX}{os.getpid()}."
        for parent in dict.fromkeys([tempfile.gettempdir(), "/tmp"]):
            if len(os.fsencode(os.path.join(parent, prefix + "x" * 8, "grpc.sock"))) > MAX_SOCKET_PATH:
                continue
            _remove_stale(parent)
            self._private = tempfile.mkdtemp(prefix=prefix, dir=parent)
            return os.path.join(self._private, "grpc.sock")
        raise OSError(f"no temporary directory with a path short enough for a unix socket ({MAX_SOCKET_PATH} bytes)")

    def _remove_private(self) -> None:
        if self._private is not None:
            shutil.rmtree(self._private, ignore_errors=True)
            self._private = None

    def stop(self) -> None:
        """Stop listening on every pod socket (the files are removed) and stop the server."""
        with self._lock:  # the serves in progress end first; later ones refuse
            self._stopping = True
            while self._serves:
                self._serves_done.wait()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=5)
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
            if not loop.is_running():
                loop.close()
        self._loop = self._thread = self._server = None
        self._remove_private()

    # -- pod sockets ------------------------------------------------------------------------------

    def serve(self, pod_uid: str, path: Path) -> None:
        """Listen on ``path`` for ``pod_uid`` (a stale file there is replaced). OSError when impossible.

        The socket is bound and listening when this returns, so a client may connect at once (the
        kernel queues the connection); the loop takes it up and accepts as soon as it runs, without
        the caller (PreStartContainer) waiting for it.
        """
        if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
            raise OSError(f"{path} is longer than {MAX_SOCKET_PATH} bytes, too long for a unix socket")
        with self._lock:  # none after stop() began
            loop = self._loop
            if loop is None or self._stopping:
                raise OSError(f"cannot serve {path}: the vcuda.sock server is not running")
            self._serves += 1
        try:
            # One at a time per pod: two calls for one pod (start-up's resume and a PreStartContainer)
            # must not each remove the other's socket file.
            with self._pod_locks[zlib.crc32(pod_uid.encode()) % POD_LOCK_STRIPES]:
                listener = _bind_listening(path)
                with self._lock:
                    old = self._listeners.get(pod_uid)
                    self._listeners[pod_uid] = listener
                if old is not None:
                    asyncio.run_coroutine_threadsafe(self._retire(old), loop)
                asyncio.run_coroutine_threadsafe(self._take_up(pod_uid, listener), loop)
        finally:
            with self._lock:
                self._serves -= 1
                if not self._serves:
                    self._serves_done.notify_all()

    def unserve(self, pod_uid: str) -> None:
        """Stop listening for ``pod_uid`` and remove its socket file (if it is still ours)."""
        loop = self._loop
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close(pod_uid), loop).result(timeout=10)
        except concurrent.futures.CancelledError:
            if not self._stopping:
                raise
            # stop() cancelled it on the loop; it closes every pod's socket itself.

    def serving(self) -> list[str]:
        """UIDs of the pods whose socket is listened on."""
        with self._lock:
            return sorted(self._listeners)

    def is_serving(self, pod_uid: str) -> bool:
        """Whether ``pod_uid``'s socket is listened on."""
        with self._lock:
            return pod_uid in self._listeners

    def pod_of_peer(self, peer: str) -> str | None:
        """The pod whose socket a call's connection came in on (from ``context.peer()``), or None."""
        if not peer.startswith(_ABSTRACT_PEER):
            return None
        with self._lock:
            return self._peers.get(peer[len(_ABSTRACT_PEER) :])

    # -- the relay (runs on the loop) -------------------------------------------------------------

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the vcuda.sock server is not started")
        return self._loop

    async def _take_up(self, pod_uid: str, listener: _Listener) -> None:
        """Accept on a listening socket that :meth:`serve` made (unless the pod was let go meanwhile)."""
        if listener.closed:
            return
        listener.taken_up = True
        try:
            server = await asyncio.start_unix_server(
                lambda r, w: self._relay(pod_uid, r, w), sock=listener.sock, limit=_RELAY_CHUNK
            )
        except Exception as exc:
            log.error("vcuda.sock of pod %s: cannot accept on %s: %s", pod_uid, listener.path, exc)
            with self._lock:
                if self._listeners.get(pod_uid) is listener:
                    del self._listeners[pod_uid]
            _unlink_ours(listener)
            listener.sock.close()
            return
        listener.server = server
        if listener.closed:  # let go while the server started
            server.close()

    async def _retire(self, listener: _Listener) -> None:
        """An earlier socket of a pod served again stops listening. The connections it accepted go on:
        they are the same pod's, and a client keeping its channel (gRPC reuses one connection per
        address) would otherwise see its next call fail."""
        _close_listener(listener)

    async def _close(self, pod_uid: str) -> None:
        with self._lock:
            listener = self._listeners.pop(pod_uid, None)
            self._closed_log.pop(pod_uid, None)
            self._malformed_log.pop(pod_uid, None)
        # The pod's connections end with its socket: nothing is relayed for a pod no longer served.
        for task in list(self._relays.pop(pod_uid, ())):
            task.cancel()
        if listener is not None:
            _close_listener(listener)

    async def _shutdown(self) -> None:
        for uid in self.serving():
            await self._close(uid)
        if self._server is not None:
            await self._server.stop(0.2)
        relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in relays:
            task.cancel()
        await asyncio.gather(*relays, return_exceptions=True)

    async def _relay(self, pod_uid: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # At the limit (the pod's or all pods'), a slot is waited for a moment: a client calling again at
        # once, each call on a new connection, may find its earlier connections not yet torn down (on a
        # busy node). A few wait so; any further one is closed at once (each waiting one holds a descriptor).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SLOT_WAIT_SECONDS
        waiting = False
        admitted = False
        try:
            while True:
                per_pod, total = MAX_CONNECTIONS_PER_POD, _total_limit()
                with self._lock:
                    busy, all_busy = self._active.get(pod_uid, 0), self._total
                    if busy < per_pod and all_busy < total:
                        self._active[pod_uid] = busy + 1
                        self._total += 1
                        admitted = True
                    elif not waiting and self._waiting.get(pod_uid, 0) < MAX_WAITING_PER_POD:
                        waiting = True
                        self._waiting[pod_uid] = self._waiting.get(pod_uid, 0) + 1
                if admitted or not waiting or loop.time() >= deadline:
                    break
                await asyncio.sleep(0.01)
        finally:
            if waiting:
                with self._lock:
                    self._waiting[pod_uid] -= 1
                    if not self._waiting[pod_uid]:
                        del self._waiting[pod_uid]
        if not admitted:
            if busy >= per_pod:
                why = f"{busy} connections open already"
            else:
                why = f"{all_busy} connections of all pods open already (limit {total})"
            self._log_closed(pod_uid, why, _describe_peer(writer), loop.time())
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._relays.setdefault(pod_uid, set()).add(task)
        name = ""
        upstream: socket.socket | None = None
        up_writer: asyncio.StreamWriter | None = None
        try:
            name, upstream = self._bind_relay_end(pod_uid)
            await asyncio.get_running_loop().sock_connect(upstream, self._address)
            up_reader, up_writer = await asyncio.open_unix_connection(sock=upstream, limit=_RELAY_CHUNK)
            await asyncio.wait_for(_relay_both(reader, writer, up_reader, up_writer), CONNECTION_LIFETIME_SECONDS)
        except TimeoutError:
            log.warning("vcuda.sock of pod %s: connection open for %g s; closed", pod_uid, CONNECTION_LIFETIME_SECONDS)
        except OSError as exc:
            log.warning("vcuda.sock of pod %s: relay failed: %s", pod_uid, exc)
        finally:
            with self._lock:
                if name:
                    self._peers.pop(name, None)
                self._active[pod_uid] -= 1
                self._total -= 1
                if not self._active[pod_uid]:
                    del self._active[pod_uid]
            tasks = self._relays.get(pod_uid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._relays[pod_uid]
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
            if up_writer is None and upstream is not None:
                upstream.close()

    def _admit(self, memo: dict[str, tuple[float, int]], key: str, now: float) -> int | None:
        """None: leave this one out of the log (one was logged for ``key`` in this window; counted); else how
        many were left out before it."""
        with self._lock:
            last, left_out = memo.get(key, (None, 0))
            if last is not None and now - last < CLOSED_LOG_WINDOW_SECONDS:
                memo[key] = (last, left_out + 1)
                return None
            if len(memo) >= 4096:
                memo.clear()
            memo[key] = (now, 0)
        return left_out

    def log_malformed(self, pod_uid: str, size: int, exc: Exception) -> None:
        """Log a request that is no VDeviceRequest: the first of each window per pod, with those left out."""
        left_out = self._admit(self._malformed_log, pod_uid, time.monotonic())
        if left_out is None:
            return
        more = f" ({left_out} more since the last report)" if left_out else ""
        log.warning(
            "vcuda.sock of pod %s: refused a request of %d bytes that is not a VDeviceRequest (%s)%s",
            pod_uid,
            size,
            exc,
            more,
        )

    def log_stray(self, peer: str) -> None:
        """Log a call that did not come in on a pod's socket (a process in the host's network namespace
        calling the server's abstract address): the first of each window, with those left out."""
        left_out = self._admit(self._malformed_log, "", time.monotonic())  # no pod's key is empty
        if left_out is None:
            return
        more = f" ({left_out} more refused since the last report)" if left_out else ""
        log.warning("RegisterVDevice from %s refused: it did not come in on a pod's vcuda.sock%s", peer, more)

    def _log_closed(self, pod_uid: str, why: str, peer: Callable[[], str], now: float) -> None:
        """Log a connection closed over the limit: the first of each window, with those left out before;
        ``peer`` describes the connecting process (called only for a line that is logged)."""
        left_out = self._admit(self._closed_log, pod_uid, now)
        if left_out is None:
            return
        more = f" ({left_out} more closed since the last report)" if left_out else ""
        log.warning("vcuda.sock of pod %s: %s; closing another, from %s%s", pod_uid, why, peer(), more)

    def _bind_relay_end(self, pod_uid: str) -> tuple[str, socket.socket]:
        """Our end of a relayed connection, bound to a fresh unguessable abstract name for ``pod_uid``."""
        for _ in range(8):
            name = f"{self._name}.{secrets.token_hex(8)}"
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind("\0" + name)
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    continue
                raise
            sock.setblocking(False)
            with self._lock:
                self._peers[name] = pod_uid
            return name, sock
        raise OSError(errno.EADDRINUSE, "no free abstract name for a relayed connection")


def _bind_listening(path: Path) -> _Listener:
    """A unix socket listening on ``path`` (a stale socket file there is removed first)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)  # left by an earlier agent: nobody listens on it any more
        sock.bind(str(path))
        os.chmod(path, 0o777)  # the library in the container may run as any user
        sock.listen(64)
        sock.setblocking(False)
        st = os.stat(path)
    except BaseException:
        sock.close()
        raise
    return _Listener(sock, path, (st.st_dev, st.st_ino))


def _close_listener(listener: _Listener) -> None:
    """Remove the socket file if it is still the one we made, then stop listening (on the loop).

    In that order: while our socket is open its inode stays taken, so a newer socket file at the same
    path (a pod served again) cannot have been given the same inode number and be removed in its place.
    """
    listener.closed = True
    _unlink_ours(listener)
    if listener.server is not None:
        listener.server.close()
    elif not listener.taken_up:
        listener.sock.close()
    # else: the loop is starting its server on it; _take_up closes that server when it is up.


def _unlink_ours(listener: _Listener) -> None:
    with contextlib.suppress(OSError):
        st = os.lstat(listener.path)
        if (st.st_dev, st.st_ino) == listener.ident:
            os.unlink(listener.path)


def _remove_stale(parent: str) -> None:
    """Remove the private directories in ``parent`` of agents no longer running (by the PID in the name)."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        if not entry.startswith(_PRIVATE_PREFIX):
            continue
        pid_text = entry[len(_PRIVATE_PREFIX) :].split(".", 1)[0]
        # A PID is a positive pid_t: a larger number (anyone may create a directory here) is no agent's, and
        # os.kill() would raise OverflowError for it.
        if not (pid_text.isascii() and pid_text.isdigit() and len(pid_text) <= 10) or not 0 < int(pid_text) < 2**31:
            continue
        if int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue  # that agent runs (or another process took its PID: left alone)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        path = os.path.join(parent, entry)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)


def _total_limit() -> int:
    """:data:`MAX_CONNECTIONS_TOTAL`, or an eighth of the descriptor limit when that is lower (a relayed
    connection holds three; the kubelet's and the API server's connections need the rest)."""
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return MAX_CONNECTIONS_TOTAL
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_TOTAL
    return max(MAX_CONNECTIONS_PER_POD, min(MAX_CONNECTIONS_TOTAL, soft // 8))


_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")
_PEERCRED = struct.Struct("3i")


def _describe_peer(writer: asyncio.StreamWriter) -> Callable[[], str]:
    """``pid 1234 (uid 0, container 0123456789ab)``: the process at the other end of an accepted connection
    (its PID in the agent's PID namespace; 0 when it is in none the agent sees) and its container, read
    from its cgroup; computed when called."""

    def describe() -> str:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except (AttributeError, OSError, struct.error):
            return "an unknown process"
        if pid <= 0:
            return f"a process outside the agent's PID namespace (uid {uid})"
        container = ""
        try:
            with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
                found = _CONTAINER_ID.findall(f.read(65536))
            if found:
                container = f", container {found[-1][:12]}"
        except OSError:
            pass
        return f"pid {pid} (uid {uid}{container})"

    return describe


async def _relay_both(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Relay both ways until the server's side ends (the server closed the connection: it answers nothing
    more, and a client that keeps its end open must not keep the relay), or until both sides have ended."""
    to_server = asyncio.ensure_future(_pump(reader, up_writer))
    to_client = asyncio.ensure_future(_pump(up_reader, writer))
    try:
        await to_client
    finally:
        if to_server.done():
            if not to_server.cancelled():
                to_server.exception()  # retrieved: asyncio would report one nobody read
        else:
            to_server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await to_server
        if not to_client.done():
            to_client.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await to_client


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then pass the end on (half-close); a reset ends it quietly."""
    try:
        while True:
            data = await reader.read(_RELAY_CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
