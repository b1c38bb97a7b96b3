"""HTTP endpoints: /graph, /usage, /version (as gpu-manager's gateway), /metric(s), /healthz, /readyz."""

from __future__ import annotations

import json
import logging
import os
import selectors
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from google.protobuf.message import Message

from gpumanager.metrics.page import CONTENT_TYPE

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, object]]]


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
        self._httpd = ThreadingHTTPServer((addr, port), handler)
        self._httpd.daemon_threads = True
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
        with selectors.DefaultSelector() as selector:
            selector.register(httpd.fileno(), selectors.EVENT_READ, "client")
            selector.register(self._wake_r, selectors.EVENT_READ, "stop")
            while True:
                ready = {key.data for key, _ in selector.select()}
                if "stop" in ready:
                    return
                try:
                    request, address = httpd.get_request()
                except OSError:
                    continue  # the client went away before it was accepted
                if httpd.verify_request(request, address):
                    try:
                        httpd.process_request(request, address)  # a thread per connection
                    except Exception:
                        httpd.handle_error(request, address)
                        httpd.shutdown_request(request)
                else:
                    httpd.shutdown_request(request)

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
            def log_message(self, format: str, *args: object) -> None:
                log.debug("http: " + format, *args)

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0].rstrip("/") or "/"
                try:
                    if path in outer._routes:
                        self._send(200, message_json(outer._routes[path]()), "application/json")
                    elif path in ("/metric", "/metrics"):
                        self._send(200, outer._metrics(), CONTENT_TYPE)
                    elif path in ("/healthz", "/readyz"):
                        ok, detail = (outer._health if path == "/healthz" else outer._ready)()
                        body = json.dumps({"ok": ok, **detail}, default=str).encode()
                        self._send(200 if ok else 503, body, "application/json")
                    else:
                        self._send(404, b'{"error":"not found"}', "application/json")
                except Exception as exc:
                    log.exception("http %s failed", path)
                    self._send(500, json.dumps({"error": str(exc)}).encode(), "application/json")

        return Handler
