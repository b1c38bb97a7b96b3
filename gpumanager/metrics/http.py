"""HTTP endpoints: /graph, /usage, /version (as gpu-manager's gateway), /metric(s), /healthz, /readyz.

HTTP/1.1 with keep-alive (an HTTP/1.0 request is answered in HTTP/1.0 and its connection closed, as
before); answers of :data:`GZIP_MIN` bytes or more from /metric(s) and the display paths go out
gzip-compressed to a client that accepts it (Prometheus always does), as they are to one that does not
(curl without ``--compressed``).

One thread (the loop) holds every connection that is not being answered: it reads request lines and
headers, writes answers as fast as each client takes them, and keeps kept-alive connections until their
next request. A request gets a thread of its own (at most :data:`MAX_CONNECTIONS` at once) only to work
out its answer, so that clients that are slow to send, slow to read or idle hold no thread: a client
that sends a request and never reads the answer costs a socket buffer and a place in the loop, which
closes it after :data:`CLIENT_TIMEOUT` seconds without progress.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import io
import json
import logging
import os
import select
import selectors
import socket
import struct
import sys
import termios
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gpumanager.metrics.page import CONTENT_TYPE

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, object]]]

#: Requests worked out at once (a thread each) other than the probes; one more is answered 503 and closed.
#: A thread is held while the answer is made, not while it is sent (the loop sends what the socket does
#: not take at once).
MAX_CONNECTIONS = 64
#: Threads kept for ``/healthz`` and ``/readyz`` alone, so that the probes are answered however many
#: other requests are in progress (a probe finding them taken too uses one of the others).
PROBE_SLOTS = 4
#: Seconds a client has to send its request line and headers, in all. Until then the connection
#: holds no thread (the accepting thread reads what arrives), so slow clients cannot take the slots.
HEADER_DEADLINE = 10.0
#: Connections the loop holds at once (sending their headers, receiving their answer, or idle between two
#: requests); one more closes an idle one, the longest idle first, or else the one nearest its deadline
#: (answered 503 if it was sending its headers).
MAX_PENDING = 128
#: Most bytes of a request line and headers (a longer request line is answered 414, headers 431).
MAX_HEAD = 128 * 1024
#: Seconds an answer may wait for the client to take more of it (the loop closes the connection then).
#: A client that takes some of it in each such span gets it all, however long that takes.
CLIENT_TIMEOUT = 10.0
#: Seconds a kept-alive connection may wait for its next request (holding no thread), then it is closed
#: without a word: long enough for scrapes every 15 s to reuse it, short enough that connections a client
#: forgot do not stay. At :data:`MAX_PENDING` the idle ones are closed first.
IDLE_TIMEOUT = 30.0
#: Answers of this many bytes or more are gzip-compressed for a client that accepts it (a smaller one would
#: gain little or grow).
GZIP_MIN = 1024
#: zlib level 1, as Prometheus' Go client (promhttp) compresses: a 180 KiB page in about 1 ms, to a 10th.
GZIP_LEVEL = 1
#: accept() errors that say the process or the system is out of something: wait before trying again.
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_PROBES = ("/healthz", "/readyz")


def json_body(value: object) -> bytes:
    """``value`` as JSON the way grpc-gateway's Go marshaller wrote it: compact, UTF-8 text as it is."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def _canned(status: str, error: str) -> bytes:
    body = json_body({"error": error}) + b"\n"
    head = f"HTTP/1.0 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


_BUSY = _canned("503 Service Unavailable", "too many connections; retry")
_SLOW = _canned("408 Request Timeout", "request headers not received in time")
_TOO_BIG = _canned("431 Request Header Fields Too Large", "request headers too large")
_TLS = _canned(
    "400 Bad Request",
    "this port serves plain HTTP, not TLS: scrape it with scheme http, not https",
)
_BLANK = _canned("400 Bad Request", "no request line: the client sent only empty lines and stopped")
_CUT = _canned("400 Bad Request", "the request stopped before the end of its request line and headers")
#: The first byte of a TLS handshake record: no HTTP request starts with it (a method is a token).
_TLS_RECORD = 0x16


@dataclass
class _Conn:
    """A connection that the loop holds: its request line and headers are arriving (``out`` None), or its
    answer is being sent (the bytes left in ``out``)."""

    sock: socket.socket
    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    #: Empty lines came before the request line (skipped, as RFC 9112 section 2.2 asks).
    blank: bool = False
    #: Requests answered on this connection so far.
    served: int = 0
    #: The part of the answer the client has not taken yet.
    out: memoryview | None = None
    #: Close the connection once ``out`` is sent (else wait for the next request).
    close: bool = False
    #: Bytes the client had not taken from the socket when last looked at (see :func:`_unsent`).
    unsent: int = -1

    @property
    def idle(self) -> bool:
        """Kept alive after an answer, and nothing of the next request has come."""
        return self.served > 0 and not self.head and self.out is None


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` value (RFC 9110 section 12.5.3) takes gzip: ``gzip`` (or ``x-gzip``)
    listed with a weight above 0, or not listed and ``*`` listed with one. A weight that is not a number
    counts as 0."""
    weights: dict[str, float] = {}
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        weight = 1.0
        for param in params.split(";"):
            name, _, value = param.partition("=")
            if name.strip().lower() == "q":
                try:
                    weight = float(value.strip())
                except ValueError:
                    weight = 0.0
        if coding == "x-gzip":
            coding = "gzip"
        if coding:
            weights[coding] = max(weights.get(coding, weight), weight)
    return weights.get("gzip", weights.get("*", 0.0)) > 0


def _head_state(head: bytes | bytearray) -> str:
    """``done`` when the request line and headers are all there (or the handler can answer what it has:
    an HTTP/0.9 or unreadable request line, one too long), ``big`` when headers passed MAX_HEAD, else ``more``."""
    end = head.find(b"\n")
    if end < 0:
        return "done" if len(head) > 65536 else "more"  # the handler answers 414
    if len(head[:end].split()) < 3 or head.find(b"\n\r\n", end) >= 0 or head.find(b"\n\n", end) >= 0:
        return "done"
    return "big" if len(head) > MAX_HEAD else "more"


def request_path(target: str) -> str:
    """The path a request target names, without its query and trailing slashes: ``/metrics`` for
    ``/metrics/?x=1`` and for the absolute form ``http://node:5678/metrics`` (which servers must accept)."""
    path = target.split("?", 1)[0]
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        path = rest[rest.find("/") :] if "/" in rest else "/"
    return path.rstrip("/") or "/"


def _path(head: bytes) -> str:
    words = head[: head.find(b"\n")].split()
    return request_path(words[1].decode("latin-1") if len(words) > 1 else "")


_SILENT = (ConnectionError, TimeoutError)


def _unsent(sock: socket.socket) -> int:
    """Bytes in the socket's send queue that the client has not taken (Linux ``SIOCOUTQ``), -1 if unknown.
    The socket says it is writable only once a third of its buffer is free (the kernel grows the buffer
    of a connection to megabytes), so a client that reads steadily can go for seconds without a write
    of ours: that it took bytes is seen here."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
    except OSError:
        return -1


def _http_1_1(version: str) -> bool:
    """Whether a request's ``HTTP/x.y`` is 1.1 or later (keep-alive by default); not for 1.0, 0.9, ''."""
    try:
        major, minor = version.removeprefix("HTTP/").split(".")
        return (int(major), int(minor)) >= (1, 1)
    except ValueError:
        return False


class _Server(ThreadingHTTPServer):
    """A thread per request being answered, at most ``slots`` at once; a full listen queue of the kernel's
    size. An answer made, ``handback`` gives the connection back to the loop."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        slots: int,
        probe_slots: int,
        handback: Callable[[_Conn], None],
    ) -> None:
        if address[0]:
            # An IPv6 address, or a name with no IPv4 address, listens on IPv6. A name with both listens on
            # its IPv4 address, as gpu-manager did (Go's net.Listen): resolvers list ::1 first for the
            # default "localhost", and local scrapers look on 127.0.0.1.
            found = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            families = [entry[0] for entry in found]
            self.address_family = socket.AF_INET if socket.AF_INET in families else families[0]
        self.slots = threading.BoundedSemaphore(slots)
        self.probe_slots = threading.BoundedSemaphore(probe_slots)
        self.handback = handback
        self.handler = handler
        #: The request line and headers read for a connection before its thread starts (taken by its handler).
        self.heads: dict[socket.socket, bytes] = {}
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" serves IPv4 too
        super().server_bind()

    def serve(self, conn: _Conn, head: bytes, slot: threading.BoundedSemaphore) -> None:
        """Answer the request whose line and headers are ``head`` in a thread of its own, holding ``slot``."""
        self.heads[conn.sock] = head
        thread = threading.Thread(target=self.process_request_thread, args=(conn, slot))
        thread.daemon = True
        try:
            thread.start()
        except BaseException:
            self.heads.pop(conn.sock, None)
            slot.release()
            raise

    def process_request_thread(  # type: ignore[override]
        self, conn: _Conn, slot: threading.BoundedSemaphore
    ) -> None:
        """Work out the answer, send what the socket takes at once, and give the rest (or the kept-alive
        connection) to the loop: the thread never waits for the client."""
        request = conn.sock
        try:
            handler = self.handler(request, conn.address, self)
        except Exception:
            self.handle_error(request, conn.address)
            self.shutdown_request(request)
            return
        finally:
            self.heads.pop(request, None)
            slot.release()
        answer: bytes = getattr(handler, "answer", b"")
        conn.close = handler.close_connection or not answer
        conn.head = bytearray(getattr(handler, "rest", b""))
        conn.served += 1
        sent = 0
        try:
            request.setblocking(False)
            sent = request.send(answer) if answer else 0
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            log.debug("http: client %s went away", conn.address)
            self.shutdown_request(request)
            return
        conn.out = memoryview(answer)[sent:] if sent < len(answer) else None
        if conn.out is None and conn.close:
            self.shutdown_request(request)
            return
        self.handback(conn)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], _SILENT):
            log.debug("http: client %s went away", client_address)
        else:
            log.exception("http: error serving %s", client_address)


def message_json(message: Message) -> bytes:
    """JSON like grpc-gateway v1: original proto field names, zero values omitted."""
    return json_body(json_format.MessageToDict(message, preserving_proto_field_name=True))


class QueryServer:
    """A small threaded HTTP server bound to ``--query-addr:--query-port``."""

    def __init__(
        self,
        addr: str,
        port: int,
        *,
        routes: dict[str, Callable[[], Message]],
        metrics: Callable[[], bytes],
        health: HealthFn,
        ready: HealthFn | None = None,
    ) -> None:
        self._routes = routes
        self._metrics = metrics
        self._health = health
        self._ready = ready or health
        handler = self._handler_class()
        self._httpd = _Server((addr, port), handler, MAX_CONNECTIONS, PROBE_SLOTS, self._handback)
        self._thread: threading.Thread | None = None
        self._warned = 0.0
        #: Connections whose answer is made, for the loop to take back; None once the loop has ended.
        self._returned: deque[_Conn] | None = deque()
        self._returned_lock = threading.Lock()
        self._stopping = False

    def _not_found(self, path: str) -> bytes:
        """The 404 body: the path asked for (its first 200 characters) and the paths served."""
        served = " ".join([*sorted(self._routes), "/metric", "/metrics", "/healthz", "/readyz"])
        shown = path if len(path) <= 200 else path[:200] + "..."
        return json_body({"error": f"no endpoint {shown}; this agent serves {served}"})

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        """Serve in a background thread."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self._thread.start()
        log.info(
            "HTTP on %s:%d (/graph /usage /version /metric /metrics /healthz /readyz)", *self._httpd.server_address[:2]
        )

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the loop has wake-ups to read already
        except OSError:
            pass  # stopped

    def _handback(self, conn: _Conn) -> None:
        """From a request's thread: the loop takes ``conn`` back (to send the rest of its answer, or to wait
        for its next request); closed if the loop has ended."""
        with self._returned_lock:
            if self._returned is not None:
                self._returned.append(conn)
                self._wake()
                return
        self._httpd.shutdown_request(conn.sock)

    def _serve(self) -> None:
        """Accept connections, read their request lines and headers, send answers and keep idle connections
        until :meth:`stop`; a request gets a thread once its headers are all there. The thread sleeps until a
        client, an answer or the stop comes (``serve_forever`` would wake twice a second to look for a stop)."""
        pending: dict[int, _Conn] = {}  # by file descriptor
        with selectors.DefaultSelector() as selector:
            selector.register(self._httpd.fileno(), selectors.EVENT_READ, "client")
            selector.register(self._wake_r, selectors.EVENT_READ, "wake")
            try:
                while True:
                    timeout = None
                    if pending:
                        timeout = max(0.0, min(c.deadline for c in pending.values()) - time.monotonic())
                    for key, _ in selector.select(timeout):
                        if key.data == "wake":
                            try:
                                os.read(self._wake_r, 4096)
                            except BlockingIOError:
                                pass
                            if self._stopping:
                                return
                            with self._returned_lock:
                                assert self._returned is not None
                                returned = list(self._returned)
                                self._returned.clear()
                            for conn in returned:
                                self._resume(selector, pending, conn)
                        elif key.data == "client":
                            if not self._accept(selector, pending):
                                return
                        elif (ready := pending.get(key.fd)) is not None and ready.sock is key.fileobj:
                            if ready.out is not None:
                                self._write(selector, pending, ready)
                            else:
                                self._read(selector, pending, ready)
                    now = time.monotonic()
                    for fd in [fd for fd, c in pending.items() if c.deadline <= now]:
                        conn = pending[fd]
                        if conn.out is not None and 0 <= (unsent := _unsent(conn.sock)) < conn.unsent:
                            conn.unsent, conn.deadline = unsent, now + CLIENT_TIMEOUT  # it reads, slowly
                            continue
                        self._drop(selector, pending, fd, b"" if conn.out is not None or conn.idle else _SLOW)
            finally:
                with self._returned_lock:
                    returned = list(self._returned or ())
                    self._returned = None
                for conn in returned:
                    self._httpd.shutdown_request(conn.sock)
                for fd in list(pending):
                    self._drop(selector, pending, fd, b"")

    def _make_room(self, selector: selectors.BaseSelector, pending: dict[int, _Conn]) -> None:
        """Below :data:`MAX_PENDING` connections: close idle ones first, the longest idle first, then the
        one nearest its deadline (sending its headers: answered 503)."""
        while len(pending) >= MAX_PENDING:
            fd, conn = min(pending.items(), key=lambda item: (not item[1].idle, item[1].deadline))
            sending_head = conn.out is None and not conn.idle
            self._drop(selector, pending, fd, _BUSY if sending_head else b"")

    def _accept(self, selector: selectors.BaseSelector, pending: dict[int, _Conn]) -> bool:
        """Take a new connection and wait for its headers; False when :meth:`stop` came meanwhile."""
        httpd = self._httpd
        try:
            request, address = httpd.get_request()
        except OSError as exc:
            if exc.errno in _OUT_OF:
                # The listener stays readable: trying again at once would spin a core.
                if time.monotonic() - self._warned > 60:
                    self._warned = time.monotonic()
                    log.warning("http: cannot accept a connection (%s); waiting", exc)
                if select.select([self._wake_r], [], [], 0.1)[0]:
                    return False
            return True  # or the client went away before it was accepted
        if not httpd.verify_request(request, address):
            httpd.shutdown_request(request)
            return True
        self._make_room(selector, pending)
        request.setblocking(False)
        # An answer goes out in one send: Nagle's algorithm would only hold its last segment back until the
        # client acknowledges the others (up to its delayed-ACK time, 40 ms on Linux).
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(request, address, time.monotonic() + HEADER_DEADLINE)
        pending[request.fileno()] = conn
        selector.register(request, selectors.EVENT_READ)
        return True

    def _resume(self, selector: selectors.BaseSelector, pending: dict[int, _Conn], conn: _Conn) -> None:
        """Take back a connection whose answer is made: send the rest of it, or wait for the next request
        (of which ``conn.head`` holds what came with the last one)."""
        self._make_room(selector, pending)
        now = time.monotonic()
        pending[conn.sock.fileno()] = conn
        if conn.out is not None:
            conn.deadline, conn.unsent = now + CLIENT_TIMEOUT, _unsent(conn.sock)
            selector.register(conn.sock, selectors.EVENT_WRITE)
            return
        selector.register(conn.sock, selectors.EVENT_READ)
        self._next_request(selector, pending, conn, now)

    def _next_request(
        self, selector: selectors.BaseSelector, pending: dict[int, _Conn], conn: _Conn, now: float
    ) -> None:
        """The answer is sent and the connection kept: wait for the next request (or serve the one that
        came with the last)."""
        came, conn.head, conn.blank = bytes(conn.head), bytearray(), False
        conn.deadline = now + IDLE_TIMEOUT
        if came:
            self._received(selector, pending, conn, came)

    def _write(self, selector: selectors.BaseSelector, pending: dict[int, _Conn], conn: _Conn) -> None:
        """Send what the client takes of the rest of its answer."""
        assert conn.out is not None
        fd = conn.sock.fileno()
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            log.debug("http: client %s went away", conn.address)
            self._drop(selector, pending, fd, b"")
            return
        now = time.monotonic()
        conn.out = conn.out[sent:] if sent < len(conn.out) else None
        conn.deadline = now + CLIENT_TIMEOUT
        if conn.out is not None:
            conn.unsent = _unsent(conn.sock)
            return
        if conn.close:
            self._drop(selector, pending, fd, b"")
            return
        selector.modify(conn.sock, selectors.EVENT_READ)
        self._next_request(selector, pending, conn, now)

    def _read(self, selector: selectors.BaseSelector, pending: dict[int, _Conn], conn: _Conn) -> None:
        """Read what a connection sent; once its headers are there, serve it in a thread, or answer busy."""
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client stopped writing: it may still read why its request is not served
            answer = _CUT if conn.head else b"" if conn.served else _BLANK if conn.blank else b""
            self._drop(selector, pending, conn.sock.fileno(), answer)
            return
        self._received(selector, pending, conn, chunk)

    def _received(self, selector: selectors.BaseSelector, pending: dict[int, _Conn], conn: _Conn, chunk: bytes) -> None:
        """Add ``chunk`` to the request line and headers that came; once they are all there, serve them."""
        fd = conn.sock.fileno()
        if not conn.head:
            stripped = chunk.lstrip(b"\r\n")  # empty lines before the request line are ignored
            conn.blank = conn.blank or len(stripped) < len(chunk)
            chunk = stripped
            if not chunk:
                return
            if chunk[0] == _TLS_RECORD:  # a TLS client (scheme https): say so now, in plain HTTP
                self._drop(selector, pending, fd, _TLS)
                return
            if conn.served:  # the next request has begun: its headers have the header deadline
                conn.deadline = time.monotonic() + HEADER_DEADLINE
        conn.head += chunk
        state = _head_state(conn.head)
        if state == "more":
            return
        if state == "big":
            self._drop(selector, pending, fd, _TOO_BIG)
            return
        selector.unregister(conn.sock)
        del pending[fd]
        head, conn.head = bytes(conn.head), bytearray()
        httpd = self._httpd
        slot = httpd.slots
        if _path(head) in _PROBES and httpd.probe_slots.acquire(blocking=False):
            slot = httpd.probe_slots
        elif not slot.acquire(blocking=False):
            self._answer_and_close(conn.sock, _BUSY)
            return
        try:
            httpd.serve(conn, head, slot)
        except Exception:
            httpd.handle_error(conn.sock, conn.address)
            httpd.shutdown_request(conn.sock)

    def _drop(self, selector: selectors.BaseSelector, pending: dict[int, _Conn], fd: int, answer: bytes) -> None:
        conn = pending.pop(fd)
        selector.unregister(conn.sock)
        self._answer_and_close(conn.sock, answer)

    def _answer_and_close(self, request: socket.socket, answer: bytes) -> None:
        """Answer ``answer`` (as much as the socket takes at once) without a thread, and close."""
        try:
            request.setblocking(False)
            if answer:
                request.send(answer)
        except OSError:
            pass
        self._httpd.shutdown_request(request)

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:
            self._stopping = True
            self._wake()
            self._thread.join(timeout=1.0)
            self._thread = None
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._httpd.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            """Answers one request from its line and headers read by the loop, into ``answer`` (sent by the
            thread and the loop, not here); ``rest`` is what came after the headers (the next request)."""

            default_request_version = "HTTP/1.0"  # an unreadable request line still gets a status line
            protocol_version = "HTTP/1.1"
            server_version = "gpu-manager"
            answer = b""
            rest = b""

            def version_string(self) -> str:  # http.server's adds " Python/3.x", or a space without it
                return self.server_version

            def setup(self) -> None:
                # The request line and headers were read before the thread started; the socket is not used here.
                self.connection = self.request
                self.rfile = io.BytesIO(outer._httpd.heads.pop(self.request, b""))
                self.wfile = io.BytesIO()

            def handle(self) -> None:
                self.close_connection = True
                self.handle_one_request()

            def finish(self) -> None:
                assert isinstance(self.wfile, io.BytesIO) and isinstance(self.rfile, io.BytesIO)
                self.answer = self.wfile.getvalue()
                self.rest = self.rfile.read()

            def parse_request(self) -> bool:
                self.protocol_version = "HTTP/1.1"  # so that http.server reads an HTTP/1.1 request's Connection
                if not super().parse_request():
                    return False
                if not _http_1_1(self.request_version):
                    self.protocol_version = "HTTP/1.0"  # answered as before: HTTP/1.0, and closed
                    self.close_connection = True
                elif self.headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in self.headers:
                    self.close_connection = True  # its body is not read: the next request would start in it
                if not hasattr(self, "do_" + self.command):  # http.server would answer 501, in HTML
                    self._not_allowed()
                    return False
                return True

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """A request http.server cannot serve (unreadable, too long, another HTTP version): answered
                in JSON as every other request, under the standard reason (not the request's bytes)."""
                self.close_connection = True
                self.protocol_version = "HTTP/1.1" if _http_1_1(self.request_version) else "HTTP/1.0"
                reason = self.responses.get(code, ("Error", ""))[0]
                self.log_error("code %d, message %s", code, message or reason)
                body = json_body({"error": message or reason})
                self.send_response(code, reason)
                self.send_header("Connection", "close")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

            def _send(
                self, code: int, body: bytes, content_type: str, *, head: bool = False, compress: bool = False
            ) -> None:
                """Answer ``body``; ``compress``: gzip-compressed if the client takes it and it is large
                enough (``Vary: Accept-Encoding`` either way, so that a cache keeps the two apart)."""
                gzipped = False
                if compress and len(body) >= GZIP_MIN:
                    accept = ", ".join(self.headers.get_all("Accept-Encoding") or [])
                    if accepts_gzip(accept):
                        body = gzip.compress(body, GZIP_LEVEL, mtime=0)
                        gzipped = True
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                if gzipped:
                    self.send_header("Content-Encoding", "gzip")
                if compress:
                    self.send_header("Vary", "Accept-Encoding")
                self.send_header("Content-Length", str(len(body)))
                if code == 405:
                    self.send_header("Allow", "GET, HEAD")
                if self.close_connection and self.protocol_version == "HTTP/1.1":
                    self.send_header("Connection", "close")
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _answer(self, head: bool) -> None:
                path = request_path(self.path)
                try:
                    if path in outer._routes:
                        body = message_json(outer._routes[path]())
                        self._send(200, body, "application/json", head=head, compress=True)
                    elif path in ("/metric", "/metrics"):
                        self._send(200, outer._metrics(), CONTENT_TYPE, head=head, compress=True)
                    elif path in ("/healthz", "/readyz"):
                        ok, detail = (outer._health if path == "/healthz" else outer._ready)()
                        body = json_body({"ok": ok, **detail})
                        self._send(200 if ok else 503, body, "application/json", head=head)
                    else:
                        self._send(404, outer._not_found(path), "application/json", head=head)
                except Exception as exc:
                    log.exception("http %s failed", path)
                    # Nothing has gone out yet: whatever was written of the answer gives way to the 500.
                    self.wfile = io.BytesIO()
                    self._headers_buffer: list[bytes] = []
                    self.close_connection = True
                    self._send(500, json_body({"error": str(exc)}), "application/json")

            def do_GET(self) -> None:
                self._answer(head=False)

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def _not_allowed(self) -> None:
                self._send(405, b'{"error":"only GET and HEAD"}', "application/json")

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        return Handler
