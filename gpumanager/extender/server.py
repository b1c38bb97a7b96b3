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

MAX_BODY = 64 << 20
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


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
    ) -> None:
        self._idle_timeout = idle_timeout
        self._routes = routes
        self._metrics = metrics
        self._prefix = "/" + url_prefix.strip("/") if url_prefix.strip("/") else ""
        server_class: type[_Server] = _Server6 if ":" in host else _Server
        if host in ("", "0.0.0.0") and socket.has_dualstack_ipv6():
            # The wildcard: on an IPv6 (or dual-stack) cluster the scheduler and the kubelet's probes
            # reach the pod over IPv6, which a socket bound to 0.0.0.0 never answers.
            server_class, host = _ServerDual, "::"
        self._httpd = server_class((host, port), self._handler_class())
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
                if self.timeout is not None:
                    self._reader = _DeadlineReader(self.connection, self.timeout)
                    self.rfile.close()  # the plain reader setup() made (it holds a reference to the socket)
                    self.rfile = io.BufferedReader(
                        self._reader, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE
                    )

            def handle_one_request(self) -> None:
                super().handle_one_request()
                reader: _DeadlineReader | None = getattr(self, "_reader", None)
                if reader is not None:
                    reader.request_done()

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
                if length > MAX_BODY:
                    self.close_connection = True
                    raise BadRequestError(f"the body is {length} bytes, more than {MAX_BODY}")
                body = self.rfile.read(length) if length > 0 else b""
                if len(body) < length:
                    raise ConnectionResetError(f"the client sent {len(body)} of {length} bytes")
                return body

        return Handler


class _DeadlineReader(io.RawIOBase):
    """A connection's reads: waiting for a request may last ``limit`` seconds between bytes (an idle
    keep-alive connection), but once its first byte has come the request must arrive whole within
    ``limit`` seconds, so a client that drips it a byte at a time cannot hold its thread for ever."""

    def __init__(self, sock: socket.socket, limit: float) -> None:
        super().__init__()
        self._sock = sock
        self._limit = limit
        self._deadline: float | None = None

    def readable(self) -> bool:
        return True

    def request_done(self) -> None:
        """The request was answered: the next one's time starts with its first byte."""
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
        if n and self._deadline is None:
            self._deadline = time.monotonic() + self._limit
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
