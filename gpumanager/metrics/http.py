"""HTTP endpoints: /graph, /usage, /version (as gpu-manager's gateway), /metric(s), /healthz, /readyz."""

from __future__ import annotations

import errno
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message

from gpumanager.metrics.page import CONTENT_TYPE

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, object]]]

#: Connections served at once (a thread each); more are answered 503 at once and closed.
MAX_CONNECTIONS = 64
#: Seconds a connection may wait for the client between two reads or writes: a client that sends half
#: a request, or stops reading, lets its thread go.
CLIENT_TIMEOUT = 10.0
#: accept() errors that say the process or the system is out of something: wait before trying again.
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n" + (
    b'{"error":"too many connections; retry"}\n'
)

_SILENT = (ConnectionError, TimeoutError)


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``slots`` at once; a full listen queue of the kernel's size."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], slots: int) -> None:
        if address[0]:  # an IPv6 address (or a name that resolves to one first) listens on IPv6
            found = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            self.address_family = found[0][0]
        self.slots = threading.BoundedSemaphore(slots)
        super().__init__(address, handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # "::" serves IPv4 too
        super().server_bind()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], _SILENT):
            log.debug("http: client %s went away", client_address)
        else:
            log.exception("http: error serving %s", client_address)


def message_json(message: Message) -> bytes:
    """JSON like grpc-gateway v1: original proto field names, zero values omitted."""
    return json.dumps(json_format.MessageToDict(message, preserving_proto_field_name=True)).encode()


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
        self._httpd = _Server((addr, port), handler, MAX_CONNECTIONS)
        self._thread: threading.Thread | None = None

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
        """Accept connections until :meth:`stop`; the thread sleeps until a client or the stop comes
        (``serve_forever`` would wake twice a second to look for a stop)."""
        httpd = self._httpd
        warned = 0.0
        with selectors.DefaultSelector() as selector:
            selector.register(httpd.fileno(), selectors.EVENT_READ, "client")
            selector.register(self._wake_r, selectors.EVENT_READ, "stop")
            while True:
                ready = {key.data for key, _ in selector.select()}
                if "stop" in ready:
                    return
                try:
                    request, address = httpd.get_request()
                except OSError as exc:
                    if exc.errno in _OUT_OF:
                        # The listener stays readable: trying again at once would spin a core.
                        if time.monotonic() - warned > 60:
                            warned = time.monotonic()
                            log.warning("http: cannot accept a connection (%s); waiting", exc)
                        if select.select([self._wake_r], [], [], 0.1)[0]:
                            return
                    continue  # or the client went away before it was accepted
                if not httpd.slots.acquire(blocking=False):
                    self._refuse(request)
                    continue
                if httpd.verify_request(request, address):
                    try:
                        httpd.process_request(request, address)  # a thread per connection
                    except Exception:
                        httpd.slots.release()
                        httpd.handle_error(request, address)
                        httpd.shutdown_request(request)
                else:
                    httpd.slots.release()
                    httpd.shutdown_request(request)

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 to a connection over the limit, without a thread, and close it."""
        try:
            request.setblocking(False)
            request.send(_BUSY)
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
            sys_version = ""

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
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                try:
                    if path in outer._routes:
                        self._send(200, message_json(outer._routes[path]()), "application/json", head=head)
                    elif path in ("/metric", "/metrics"):
                        self._send(200, outer._metrics(), CONTENT_TYPE, head=head)
                    elif path in ("/healthz", "/readyz"):
                        ok, detail = (outer._health if path == "/healthz" else outer._ready)()
                        body = json.dumps({"ok": ok, **detail}, default=str).encode()
                        self._send(200 if ok else 503, body, "application/json", head=head)
                    else:
                        self._send(404, b'{"error":"not found"}', "application/json", head=head)
                except _SILENT:
                    log.debug("http %s: the client went away", path)
                except Exception as exc:
                    log.exception("http %s failed", path)
                    if not self._answered:  # never a second status line after the first
                        try:
                            self._send(500, json.dumps({"error": str(exc)}).encode(), "application/json")
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
