"""The extender's HTTP(S) server: the verbs under the URL prefix, health, version and metrics.

``POST <prefix>/filter`` (also ``<prefix>/predicates``, gpu-admission's name, so scheduler
configurations written for it keep working), ``POST <prefix>/prioritize`` (also
``<prefix>/priorities``, gpu-admission's), ``POST <prefix>/bind``; ``GET /healthz``, ``/readyz``
(503 until the watches have listed, and while one has failed for longer than 30 s or
``--assume-ttl``), ``/version`` (also ``<prefix>/version``), ``/metrics``. HTTP/1.1 with
keep-alive, as the scheduler's Go client reuses connections (a GET's body is read and dropped, so
the connection stays in step; HEAD answers GET's headers). Bodies are JSON; a body that is not
the verb's argument answers 400 with ``{"Error": ...}`` naming what is wrong, as does a request
with Content-Length headers that differ (its connection is closed). A connection may wait for its
next request as long as the idle timeout between bytes, but a request must arrive whole within the
idle timeout of its first byte (a client dripping it a byte at a time is dropped).

Bounds, so that no client can take the memory the process is given: a body larger than
:data:`MAX_BODY` is answered 413 naming the bound; large bodies share a budget of that size while
they are read and answered (one that does not fit within :data:`BODY_WAIT` seconds gets 503); at most
:data:`MAX_CONNECTIONS` connections are served at once, the idle ones closed to make room for new
ones, and a connection beyond them while every one is busy gets 503 within :data:`ACCEPT_WAIT` s.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gpumanager.extender.api import BadRequestError, encode
from gpumanager.extender.metrics import ExtenderMetrics

log = logging.getLogger(__name__)

#: The largest request body taken (413 beyond, naming it): ExtenderArgs carrying 5,000 Node objects of
#: 10 KiB on average (a Node with the kubelet's list of 50 images is 10-15 KiB, without it about 5 KiB; the
#: scheduler sends only the nodes its own filters passed, which for a vcuda pod are the GPU nodes). A
#: scheduler that sends more should send names (``nodeCacheCapable: true``, some 20 bytes a node): the
#: extender judges every node its watch has shown from the watch anyway.
MAX_BODY = 48 << 20
#: Bodies larger than this share a budget of ``max_body`` bytes while they are read and answered (an answer
#: holds about as much again: the Node objects that pass), so that many large bodies at once cannot add
#: up past the memory limit; smaller ones (a bind, names of a few thousand nodes) are never held up.
SMALL_BODY = 128 << 10
#: Seconds a large body waits for room in that budget before it is answered 503.
BODY_WAIT = 3.0
#: Connections served at once, each by a thread of its own. At the limit, idle ones (waiting for their
#: next request) are closed, the longest idle first; when every one is busy with a request, a new
#: connection waits :data:`ACCEPT_WAIT` seconds for one to end, then is answered 503 and closed.
MAX_CONNECTIONS = 128
ACCEPT_WAIT = 1.0
#: Seconds between two warnings about connections refused because every connection was busy.
_REFUSED_LOG_EVERY = 10.0
#: gpu-admission's verb names (its routes), so scheduler configurations written for it keep working.
_ALIASES = {"predicates": "filter", "priorities": "prioritize"}

Verb = Callable[[bytes], tuple[Any, int]]
"""A verb: request body -> (answer, HTTP status); raises BadRequestError for a body it cannot take."""


@dataclass
class Routes:
    """What the server answers with."""

    verbs: dict[str, Verb]
    """Verb name (after the prefix) -> handler."""
    ready: Callable[[], tuple[bool, dict[str, object]]]
    version: dict[str, str]


class RefusedError(Exception):
    """A request refused before its verb ran, with the HTTP status to answer (413, 503)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Connections:
    """The open connections, each idle (waiting for its next request) or busy with one; at most ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Condition()
        self._idle: dict[socket.socket, None] = {}  # the longest idle first
        self._busy: set[socket.socket] = set()
        self._refused = 0
        self._refused_logged = -_REFUSED_LOG_EVERY

    def admit(self, sock: socket.socket, wait: float) -> bool:
        """Count a new connection in (idle), closing idle ones to make room; False when every connection
        stayed busy for ``wait`` seconds."""
        deadline = time.monotonic() + wait
        with self._lock:
            while len(self._idle) + len(self._busy) >= self.limit:
                if self._idle:
                    oldest = next(iter(self._idle))
                    del self._idle[oldest]
                    try:  # its thread reads the end of the connection and stops
                        socket.socket.shutdown(oldest, socket.SHUT_RDWR)
                    except OSError:
                        pass
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    self._refused += 1
                    now = time.monotonic()
                    if now - self._refused_logged >= _REFUSED_LOG_EVERY:
                        log.warning(
                            "%d connection(s) refused (503): all %d connections are busy with requests",
                            self._refused,
                            self.limit,
                        )
                        self._refused, self._refused_logged = 0, now
                    return False
                self._lock.wait(left)
            self._idle[sock] = None
            return True

    def busy(self, sock: socket.socket) -> bool:
        """A request began on ``sock``; False when the connection was closed as idle meanwhile."""
        with self._lock:
            if sock not in self._idle:
                return False
            del self._idle[sock]
            self._busy.add(sock)
            return True

    def idle(self, sock: socket.socket) -> None:
        """The request on ``sock`` was answered: it waits for the next (the newest idle)."""
        with self._lock:
            if sock in self._busy:
                self._busy.discard(sock)
                self._idle[sock] = None

    def closed(self, sock: socket.socket) -> None:
        """``sock`` is about to be closed (before its descriptor can be reused)."""
        with self._lock:
            self._idle.pop(sock, None)
            self._busy.discard(sock)
            self._lock.notify_all()


class _Budget:
    """Bytes of large request bodies being read and answered, at most ``size`` at once."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = 0
        self._lock = threading.Condition()

    def take(self, n: int, wait: float) -> int:
        """Take ``n`` bytes, waiting up to ``wait`` seconds for room; returns the bytes in use by others
        when there was none (0 when taken)."""
        deadline = time.monotonic() + wait
        with self._lock:
            while self.used + n > self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    return self.used
                self._lock.wait(left)
            self.used += n
            return 0

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n
            self._lock.notify_all()


def _refuse_busy(sock: socket.socket, limit: int) -> None:
    """Answer 503 on a connection not served (a plain one; a TLS one is only closed), without blocking."""
    if isinstance(sock, ssl.SSLSocket):
        return
    body = _json_bytes({"Error": f"the extender is serving {limit} connections, each busy with a request; try again"})
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    try:
        sock.setblocking(False)
        sock.send(head + body)
        # What the client sent already is read, so that closing does not reset the connection (and the
        # answer with it) before the client reads it.
        for _ in range(16):
            if not sock.recv(65536):
                break
    except OSError:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128
    connections: _Connections

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.admit(request, ACCEPT_WAIT):
            _refuse_busy(request, self.connections.limit)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.closed(request)
        super().shutdown_request(request)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _ServerDual(_Server6):
    """Every address of both families, as Go's ``:port`` listens (one IPv6 socket that also takes IPv4)."""

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class ExtenderServer:
    """Serves :class:`Routes` on ``host:port`` in background threads."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Routes,
        metrics: ExtenderMetrics,
        *,
        url_prefix: str = "/scheduler",
        tls: tuple[str, str] | None = None,
        idle_timeout: float | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_body: int = MAX_BODY,
    ) -> None:
        self._idle_timeout = idle_timeout
        self._max_body = max_body
        self._budget = _Budget(max_body)
        self._routes = routes
        self._metrics = metrics
        self._prefix = "/" + url_prefix.strip("/") if url_prefix.strip("/") else ""
        server_class: type[_Server] = _Server6 if ":" in host else _Server
        if host in ("", "0.0.0.0") and socket.has_dualstack_ipv6():
            # The wildcard: on an IPv6 (or dual-stack) cluster the scheduler and the kubelet's probes
            # reach the pod over IPv6, which a socket bound to 0.0.0.0 never answers.
            server_class, host = _ServerDual, "::"
        self._httpd = server_class((host, port), self._handler_class())
        self._httpd.connections = _Connections(max_connections)
        self.tls = tls is not None
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(tls[0], tls[1])
            # The handshake happens in the request's thread, so a slow client cannot stall accept().
            self._httpd.socket = context.wrap_socket(
                self._httpd.socket, server_side=True, do_handshake_on_connect=False
            )
        self._thread: threading.Thread | None = None
        # Verb requests being answered, and whether the server is stopping (see stop()).
        self._busy = threading.Condition()
        self._in_flight = 0
        self._closing = False

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="extender-http", daemon=True)
        self._thread.start()
        host, port = self._httpd.server_address[:2]
        log.info(
            "serving %s on %s:%d: POST %s/{filter,prioritize,bind}, GET /healthz /readyz /version /metrics",
            "HTTPS" if self.tls else "HTTP",
            host,
            port,
            self._prefix,
        )

    def stop(self, drain: float = 0.0) -> None:
        """Stop serving and close the socket. ``drain``: seconds to wait for the verb requests being
        answered (a bind cut short between its annotations and its Binding leaves the pod chosen for a
        node and not bound); connections kept alive are closed after their answer."""
        with self._busy:
            self._closing = True
        self._httpd.shutdown()
        deadline = time.monotonic() + drain
        with self._busy:
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._busy.wait(left)
            if self._in_flight:
                log.warning("stopping with %d request(s) not answered yet", self._in_flight)
        self._httpd.server_close()

    def _request_started(self) -> bool:
        """Count a verb request in; False when the server is stopping (answer it, then close)."""
        with self._busy:
            self._in_flight += 1
            return not self._closing

    def _request_done(self) -> None:
        with self._busy:
            self._in_flight -= 1
            self._busy.notify_all()

    def _verb_of(self, path: str) -> str | None:
        if self._prefix and not path.startswith(self._prefix + "/"):
            return None
        name = path[len(self._prefix) + 1 :]
        return _ALIASES.get(name, name)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Every read and write of the connection: a client silent that long (one that vanished, or
            # that promised a body it never sends) is dropped instead of holding its thread for ever.
            timeout = outer._idle_timeout
            # Headers and body go out in two writes; with Nagle's algorithm the body would wait for
            # the client's delayed ACK (40 ms on Linux). Go's clients and servers disable it too.
            disable_nagle_algorithm = True

            def setup(self) -> None:
                if isinstance(self.request, ssl.SSLSocket):
                    self.request.settimeout(30)
                    try:
                        self.request.do_handshake()
                    except (OSError, ssl.SSLError) as exc:
                        log.info("TLS handshake with %s failed: %s", self.client_address[0], exc)
                        raise
                    self.request.settimeout(None)
                super().setup()
                self._taken = 0  # bytes of the body budget this request holds
                sock = self.request
                self._reader = _DeadlineReader(
                    self.connection, self.timeout, lambda: outer._httpd.connections.busy(sock)
                )
                self.rfile.close()  # the plain reader setup() made (it holds a reference to the socket)
                self.rfile = io.BufferedReader(
                    self._reader, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE
                )

            def handle_one_request(self) -> None:
                try:
                    super().handle_one_request()
                finally:
                    if self._taken:
                        outer._budget.give(self._taken)
                        self._taken = 0
                    self._reader.request_done()
                    outer._httpd.connections.idle(self.request)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

            def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, code: int, answer: object) -> None:
                self._send(code, _json_bytes(answer))

            def do_HEAD(self) -> None:
                """The headers GET would answer (as Go's server answers HEAD on every GET route)."""
                self.do_GET()

            def do_GET(self) -> None:
                try:
                    # A body nobody reads would be parsed as the next request on this connection.
                    self._read_body()
                except BadRequestError as exc:
                    log.warning("%s %s from %s refused (400): %s", self.command, self.path, self.client_address[0], exc)
                    self._json(400, {"Error": str(exc)})
                    return
                except RefusedError as exc:
                    log.warning(
                        "%s %s from %s refused (%d): %s", self.command, self.path, self.client_address[0], exc.code, exc
                    )
                    self._json(exc.code, {"Error": str(exc)})
                    return
                except OSError:
                    self.close_connection = True
                    return
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                if path in ("/healthz", "/livez"):
                    self._send(200, b"ok", "text/plain; charset=utf-8")
                elif path == "/readyz":
                    ok, detail = outer._routes.ready()
                    self._json(200 if ok else 503, {"ready": ok, **detail})
                elif path in ("/version", f"{outer._prefix}/version"):
                    self._json(200, outer._routes.version)
                elif path == "/metrics":
                    self._send(200, generate_latest(outer._metrics.registry), CONTENT_TYPE_LATEST)
                else:
                    self._json(404, {"Error": f"no such path {path!r}"})

            def do_POST(self) -> None:
                if not outer._request_started():
                    self.close_connection = True
                try:
                    self._post()
                finally:
                    outer._request_done()

            def _post(self) -> None:
                started = time.perf_counter()
                path = self.path.split("?", 1)[0].rstrip("/")
                verb = outer._verb_of(path)
                handler = outer._routes.verbs.get(verb) if verb else None
                code, payload = 500, b""
                try:
                    body = self._read_body()
                    if handler is None or verb is None:
                        code = 404
                        payload = _json_bytes({"Error": f"no such verb {path!r} (prefix {outer._prefix or '/'})"})
                    else:
                        answer, code = handler(body)
                        payload = encode(answer)
                except BadRequestError as exc:
                    # The kube-scheduler reports only the status of an answer other than 200 ("failed
                    # filter with extender at URL ..., code 400"): the reason is logged here.
                    log.warning("%s from %s refused (400): %s", path, self.client_address[0], exc)
                    code, payload = 400, _json_bytes({"Error": str(exc)})
                except RefusedError as exc:
                    log.warning("%s from %s refused (%d): %s", path, self.client_address[0], exc.code, exc)
                    code, payload = exc.code, _json_bytes({"Error": str(exc)})
                except OSError:  # the client went away, or stalled past the timeout: nobody to answer
                    code = 0
                    self.close_connection = True
                except Exception as exc:
                    log.exception("%s failed", verb)
                    code, payload = 500, _json_bytes({"Error": f"{verb}: internal error: {exc}"})
                # Counted before the answer leaves: a client that scrapes /metrics after its answer
                # finds its request there.
                known = handler is not None and verb is not None
                outer._metrics.requests.labels(verb if known else "unknown", str(code)).inc()
                if known:
                    outer._metrics.latency.labels(verb).observe(time.perf_counter() - started)
                if code:
                    try:
                        self._send(code, payload)
                    except OSError:
                        self.close_connection = True

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding"):
                    self.close_connection = True  # the chunks would be read as the next request
                    raise BadRequestError(
                        f"Transfer-Encoding {self.headers.get('Transfer-Encoding')!r} is not supported: send the "
                        "body with a Content-Length (as the kube-scheduler does)"
                    )
                given = self.headers.get_all("Content-Length") or []
                if len(set(given)) > 1:
                    self.close_connection = True  # which one the body follows is anyone's guess
                    raise BadRequestError(f"the request has {len(given)} Content-Length headers that differ: {given}")
                raw = given[0] if given else None
                text = (raw or "0").strip()
                length = int(text) if text.isascii() and text.isdigit() else -1  # no sign, ASCII digits: Go's rule
                if length < 0:
                    self.close_connection = True  # where this body ends is unknown
                    raise BadRequestError(f"Content-Length {raw!r} is not a byte count")
                limit = outer._max_body
                if length > limit:
                    self.close_connection = True  # the body is not read
                    raise RefusedError(
                        413,
                        f"the body is {length} bytes, more than the extender takes ({limit} bytes, "
                        f"{limit / (1 << 20):g} MiB); a scheduler with this many nodes should send their names "
                        "(nodeCacheCapable: true)",
                    )
                if length > SMALL_BODY:
                    others = outer._budget.take(length, BODY_WAIT)
                    if others:
                        self.close_connection = True  # the body is not read
                        raise RefusedError(
                            503,
                            f"request bodies of {others} bytes are being read or answered; this one's {length} "
                            f"bytes would pass the {limit} bytes taken at once; try again",
                        )
                    self._taken = length
                body = self.rfile.read(length) if length > 0 else b""
                if len(body) < length:
                    raise ConnectionResetError(f"the client sent {len(body)} of {length} bytes")
                return body

        return Handler


class _DeadlineReader(io.RawIOBase):
    """A connection's reads: waiting for a request may last ``limit`` seconds between bytes (an idle
    keep-alive connection), but once its first byte has come the request must arrive whole within
    ``limit`` seconds, so a client that drips it a byte at a time cannot hold its thread for ever
    (``limit`` None: no timeout). ``on_request`` is called at a request's first byte (False: the
    connection was closed as idle meanwhile)."""

    def __init__(self, sock: socket.socket, limit: float | None, on_request: Callable[[], bool]) -> None:
        super().__init__()
        self._sock = sock
        self._limit = limit
        self._on_request = on_request
        self._started = False
        self._deadline: float | None = None

    def readable(self) -> bool:
        return True

    def request_done(self) -> None:
        """The request was answered: the next one's time starts with its first byte."""
        self._started = False
        self._deadline = None

    def readinto(self, buffer: Any) -> int:
        if self._deadline is None:
            self._sock.settimeout(self._limit)
        else:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not arrive whole within {self._limit:g} s")
            self._sock.settimeout(left)
        n = self._sock.recv_into(buffer)
        if n and not self._started:
            self._started = True
            if self._limit is not None:
                self._deadline = time.monotonic() + self._limit
            if not self._on_request():
                raise ConnectionResetError("the connection was closed as idle to make room for others")
        return n


def parse_listen(text: str) -> tuple[str, int]:
    """``host:port``, ``:port`` or ``[v6]:port`` -> (host, port); ValueError names the problem."""
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ValueError("expected host:port or :port")
    host = host.strip("[]")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is out of range")
    if host:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ValueError(f"host {host!r} does not resolve: {exc}") from None
    return host or "0.0.0.0", port


def _json_bytes(answer: object) -> bytes:
    return json.dumps(answer, separators=(",", ":")).encode()
