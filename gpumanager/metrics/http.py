"""HTTP endpoints: /graph, /usage, /version (as gpu-manager's gateway), /metric(s), /healthz, /readyz."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import select
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gpumanager.metrics.page import CONTENT_TYPE

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, object]]]

#: Requests served at once (a thread each) other than the probes; one more is answered 503 and closed.
MAX_CONNECTIONS = 64
#: Threads kept for ``/healthz`` and ``/readyz`` alone, so that the probes are answered however many
#: other requests are in progress (a probe finding them taken too uses one of the others).
PROBE_SLOTS = 4
#: Seconds a client has to send its request line and headers, in all. Until then the connection
#: holds no thread (the accepting thread reads what arrives), so slow clients cannot take the slots.
HEADER_DEADLINE = 10.0
#: Connections still sending their headers at once; one more closes the one that has taken longest.
MAX_PENDING = 128
#: Most bytes of a request line and headers (a longer request line is answered 414, headers 431).
MAX_HEAD = 128 * 1024
#: Seconds a connection with a thread may wait for the client between two reads or writes.
CLIENT_TIMEOUT = 10.0
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
class _Pending:
    """A connection whose request line and headers have not all arrived."""

    sock: socket.socket
    address: Any
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    #: Empty lines came before the request line (skipped, as RFC 9112 section 2.2 asks).
    blank: bool = False


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


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``slots`` at once; a full listen queue of the kernel's size."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(
        self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], slots: int, probe_slots: int
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
        #: The request line and headers read for a connection before its thread starts (taken by its handler).
        self.heads: dict[socket.socket, bytes] = {}
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" serves IPv4 too
        super().server_bind()

    def serve(self, request: socket.socket, client_address: Any, head: bytes, slot: threading.BoundedSemaphore) -> None:
        """Serve a connection whose request line and headers are ``head`` in a thread of its own, holding ``slot``."""
        self.heads[request] = head
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address, slot))
        thread.daemon = True
        try:
            thread.start()
        except BaseException:
            self.heads.pop(request, None)
            slot.release()
            raise

    def process_request_thread(  # type: ignore[override]
        self, request: Any, client_address: Any, slot: threading.BoundedSemaphore
    ) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.heads.pop(request, None)
            slot.release()

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
        self._httpd = _Server((addr, port), handler, MAX_CONNECTIONS, PROBE_SLOTS)
        self._thread: threading.Thread | None = None
        self._warned = 0.0

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
        self._thread = threading.Thread(target=self._serve, name="http", daemon=True)
        self._thread.start()
        log.info(
            "HTTP on %s:%d (/graph /usage /version /metric /metrics /healthz /readyz)", *self._httpd.server_address[:2]
        )

    def _serve(self) -> None:
        """Accept connections and read their request lines and headers until :meth:`stop`; a connection
        gets a thread once its headers are all there. The thread sleeps until a client or the stop comes
        (``serve_forever`` would wake twice a second to look for a stop)."""
        pending: dict[int, _Pending] = {}  # by file descriptor, oldest first (so by deadline)
        with selectors.DefaultSelector() as selector:
            selector.register(self._httpd.fileno(), selectors.EVENT_READ, "client")
            selector.register(self._wake_r, selectors.EVENT_READ, "stop")
            try:
                while True:
                    timeout = None
                    if pending:
                        timeout = max(0.0, next(iter(pending.values())).deadline - time.monotonic())
                    for key, _ in selector.select(timeout):
                        if key.data == "stop":
                            return
                        if key.data == "client":
                            if not self._accept(selector, pending):
                                return
                        else:
                            self._read(selector, pending, key.fd)
                    now = time.monotonic()
                    while pending and next(iter(pending.values())).deadline <= now:
                        self._drop(selector, pending, next(iter(pending)), _SLOW)
            finally:
                for fd in list(pending):
                    self._drop(selector, pending, fd, b"")

    def _accept(self, selector: selectors.BaseSelector, pending: dict[int, _Pending]) -> bool:
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
        if len(pending) >= MAX_PENDING:  # the one that has taken longest makes room
            self._drop(selector, pending, next(iter(pending)), _BUSY)
        request.setblocking(False)
        fd = request.fileno()
        pending[fd] = _Pending(request, address, time.monotonic() + HEADER_DEADLINE)
        selector.register(fd, selectors.EVENT_READ, "request")
        return True

    def _read(self, selector: selectors.BaseSelector, pending: dict[int, _Pending], fd: int) -> None:
        """Read what a connection sent; once its headers are there, serve it in a thread, or answer busy."""
        entry = pending[fd]
        try:
            chunk = entry.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client stopped writing: it may still read why its request is not served
            self._drop(selector, pending, fd, _CUT if entry.head else _BLANK if entry.blank else b"")
            return
        if not entry.head:
            stripped = chunk.lstrip(b"\r\n")  # empty lines before the request line are ignored
            entry.blank = entry.blank or len(stripped) < len(chunk)
            chunk = stripped
            if not chunk:
                return
            if chunk[0] == _TLS_RECORD:  # a TLS client (scheme https): say so now, in plain HTTP
                self._drop(selector, pending, fd, _TLS)
                return
        entry.head += chunk
        state = _head_state(entry.head)
        if state == "more":
            return
        if state == "big":
            self._drop(selector, pending, fd, _TOO_BIG)
            return
        selector.unregister(fd)
        del pending[fd]
        head = bytes(entry.head)
        httpd = self._httpd
        slot = httpd.slots
        if _path(head) in _PROBES and httpd.probe_slots.acquire(blocking=False):
            slot = httpd.probe_slots
        elif not slot.acquire(blocking=False):
            self._answer_and_close(entry.sock, _BUSY)
            return
        try:
            entry.sock.setblocking(True)
            httpd.serve(entry.sock, entry.address, head, slot)
        except Exception:
            httpd.handle_error(entry.sock, entry.address)
            httpd.shutdown_request(entry.sock)

    def _drop(self, selector: selectors.BaseSelector, pending: dict[int, _Pending], fd: int, answer: bytes) -> None:
        entry = pending.pop(fd)
        selector.unregister(fd)
        self._answer_and_close(entry.sock, answer)

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
            os.write(self._wake_w, b"x")
            self._thread.join(timeout=1.0)
            self._thread = None
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._httpd.server_close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT
            default_request_version = "HTTP/1.0"  # an unreadable request line still gets a status line
            server_version = "gpu-manager"

            def version_string(self) -> str:  # http.server's adds " Python/3.x", or a space without it
                return self.server_version

            def setup(self) -> None:
                super().setup()
                # The request line and headers were read before the thread started; nothing else is read.
                self.rfile.close()
                self.rfile = io.BytesIO(outer._httpd.heads.pop(self.request, b""))

            def parse_request(self) -> bool:
                if not super().parse_request():
                    return False
                if not hasattr(self, "do_" + self.command):  # http.server would answer 501, in HTML
                    self._not_allowed()
                    return False
                return True

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """A request http.server cannot serve (unreadable, too long, another HTTP version): answered
                in JSON as every other request, under the standard reason (not the request's bytes)."""
                self.close_connection = True
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

            def _send(self, code: int, body: bytes, content_type: str, *, head: bool = False) -> None:
                self._answered = True
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if code == 405:
                    self.send_header("Allow", "GET, HEAD")
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _answer(self, head: bool) -> None:
                self._answered = False
                path = request_path(self.path)
                try:
                    if path in outer._routes:
                        self._send(200, message_json(outer._routes[path]()), "application/json", head=head)
                    elif path in ("/metric", "/metrics"):
                        self._send(200, outer._metrics(), CONTENT_TYPE, head=head)
                    elif path in ("/healthz", "/readyz"):
                        ok, detail = (outer._health if path == "/healthz" else outer._ready)()
                        body = json_body({"ok": ok, **detail})
                        self._send(200 if ok else 503, body, "application/json", head=head)
                    else:
                        self._send(404, outer._not_found(path), "application/json", head=head)
                except _SILENT:
                    log.debug("http %s: the client went away", path)
                except Exception as exc:
                    log.exception("http %s failed", path)
                    if not self._answered:  # never a second status line after the first
                        try:
                            self._send(500, json_body({"error": str(exc)}), "application/json")
                        except OSError:
                            pass

            def do_GET(self) -> None:
                self._answer(head=False)

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def _not_allowed(self) -> None:
                try:
                    self._send(405, b'{"error":"only GET and HEAD"}', "application/json")
                except OSError:
                    pass

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        return Handler
