"""HTTP transport of the API-server simulator: routing, authentication, faults, watch streams.

Plain HTTP/1.1 with keep-alive on a :class:`http.server.ThreadingHTTPServer`; a watch is a
chunked ``application/json`` response with one event per line, as the real server streams it.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from simnode.apiserver_errors import ApiError, forbidden_anonymous, method_not_allowed, server_not_found
from simnode.apiserver_faults import Faults, RequestLog, RequestRecord
from simnode.apiserver_objects import KINDS, PODS, ResourceKind
from simnode.apiserver_ops import Operations, WatchPlan, parse_bool, wrap_error
from simnode.apiserver_rbac import (
    Attributes,
    Authorizer,
    ServiceAccount,
    name_from_field_selector,
    request_attributes,
)
from simnode.apiserver_resource import GROUP, GROUP_KINDS, api_group_list, discovery_document
from simnode.apiserver_store import Key, Store, WatchEnd

log = logging.getLogger(__name__)

JSON = dict[str, Any]

PUBLIC_PATHS = ("/version", "/version/", "/healthz", "/livez", "/readyz")
"""Paths the ``system:public-info-viewer`` role opens to unauthenticated clients."""

_POLL = 0.25
"""How often an idle watch stream checks for a closed client or a due bookmark."""


@dataclass
class HttpContext:
    """Everything a request handler needs; owned by the simulator."""

    store: Store
    ops: Operations
    faults: Faults
    requests: RequestLog
    version: JSON
    token: str | None
    bookmark_interval: float
    stopping: threading.Event = field(default_factory=threading.Event)
    server_address: str = ""
    rbac: Authorizer = field(default_factory=Authorizer)
    # Whether resource.k8s.io/v1 is served (Kubernetes 1.34 and later, unless turned off with
    # --runtime-config=resource.k8s.io/v1=false): when not, its paths answer 404 as unknown ones do.
    resource_api: bool = True


def version_info(git_version: str) -> JSON:
    """A ``/version`` answer for ``git_version`` (``v1.31.4``)."""
    major, minor = git_version.lstrip("v").split(".")[:2]
    return {
        "major": major,
        "minor": minor,
        "gitVersion": git_version,
        "gitCommit": "a78aa47129b8539636eb86a9d00e31b2720fe06b",
        "gitTreeState": "clean",
        "buildDate": "2024-12-10T11:36:58Z",
        "goVersion": "go1.22.9",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


_ALL_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def resource_list() -> JSON:
    """The ``/api/v1`` discovery document for the served resources."""
    return {
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            {
                "name": "nodes",
                "singularName": "node",
                "namespaced": False,
                "kind": "Node",
                "verbs": _ALL_VERBS,
                "shortNames": ["no"],
                "storageVersionHash": "XwShjMxG9Fs=",
            },
            {
                "name": "nodes/status",
                "singularName": "",
                "namespaced": False,
                "kind": "Node",
                "verbs": ["get", "patch", "update"],
            },
            {
                "name": "pods",
                "singularName": "pod",
                "namespaced": True,
                "kind": "Pod",
                "verbs": _ALL_VERBS,
                "shortNames": ["po"],
                "categories": ["all"],
                "storageVersionHash": "xPOwRZ+Yhw8=",
            },
            {"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]},
            {
                "name": "pods/status",
                "singularName": "",
                "namespaced": True,
                "kind": "Pod",
                "verbs": ["get", "patch", "update"],
            },
        ],
    }


class SimHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that knows its open connections (to drop them on demand)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], ctx: HttpContext) -> None:
        self.ctx = ctx
        self._conn_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        super().__init__(address, ApiRequestHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Track the connection, then serve it on its own thread."""
        with self._conn_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        """Forget the connection, then close it."""
        with self._conn_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that resets its connection is normal (a real server does not log it); log others."""
        exc = sys.exc_info()[1]
        if isinstance(exc, ConnectionError):
            return
        log.exception("API-server simulator: error serving %s", client_address)

    def drop_connections(self) -> int:
        """Shut down every open connection (clients see a reset/EOF); returns how many."""
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(conns)


@dataclass(frozen=True)
class _Route:
    kind: ResourceKind
    namespace: str | None
    name: str | None
    subresource: str | None
    watch_path: bool


def _parse_api_path(path: str) -> _Route | None:
    kinds: Mapping[str, ResourceKind] = KINDS
    prefix = "/api/v1/"
    if not path.startswith(prefix):
        group = next((gv for gv in GROUP_KINDS if path.startswith(f"/apis/{gv}/")), None)
        if group is None:
            return None
        kinds, prefix = GROUP_KINDS[group], f"/apis/{group}/"
    rest = path[len(prefix) :].strip("/")
    segs = [unquote(s) for s in rest.split("/")] if rest else []
    watch_path = False
    if segs and segs[0] == "watch":
        watch_path = True
        segs = segs[1:]
    namespace: str | None = None
    if len(segs) >= 3 and segs[0] == "namespaces":
        namespace = segs[1]
        segs = segs[2:]
    if not segs or segs[0] not in kinds or len(segs) > 3:
        return None
    kind = kinds[segs[0]]
    if namespace is not None and not kind.namespaced:
        return None
    name = segs[1] if len(segs) >= 2 else None
    sub = segs[2] if len(segs) == 3 else None
    if name is not None and kind.namespaced and namespace is None:
        return None
    if sub is not None and (watch_path or sub not in ("status", "binding") or (sub == "binding" and kind is not PODS)):
        return None
    return _Route(kind, namespace, name, sub, watch_path)


def _verb(method: str, route: _Route, watch: bool) -> str:
    if method == "GET":
        return "watch" if watch else ("get" if route.name else "list")
    if method == "DELETE":
        return "delete" if route.name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _attributes(method: str, route: _Route, query: Mapping[str, str]) -> Attributes:
    """The authorizer's view of a resource request (``RequestInfo``)."""
    watch = route.watch_path or (method == "GET" and parse_bool(query, "watch"))
    verb = _verb(method, route, watch)
    name = route.name or ""
    if verb in ("list", "watch") and not name:
        name = name_from_field_selector(query.get("fieldSelector", ""))
    group = route.kind.group_version.rpartition("/")[0]
    return Attributes(verb, group, route.kind.resource, route.subresource or "", route.namespace or "", name)


class ApiRequestHandler(BaseHTTPRequestHandler):
    """Answers one connection's requests."""

    protocol_version = "HTTP/1.1"
    server_version = "kube-apiserver-sim"
    # Go's net/http (the real API server) sets TCP_NODELAY; without it a response written as
    # headers then body waits for the client's delayed ACK (about 40 ms) on a reused connection.
    disable_nagle_algorithm = True
    server: SimHTTPServer
    # Headers and body are separate writes; as Go's net/http (TCP_NODELAY), do not let the body
    # wait for the client's delayed ACK of the headers (40 ms on Linux).
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        """Route the access log to :mod:`logging` (debug)."""
        log.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        """GET."""
        self._dispatch("GET")

    def do_POST(self) -> None:
        """POST."""
        self._dispatch("POST")

    def do_PUT(self) -> None:
        """PUT."""
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        """PATCH."""
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        """DELETE."""
        self._dispatch("DELETE")

    # ------------------------------------------------------------------ plumbing

    @property
    def ctx(self) -> HttpContext:
        """The simulator's shared state."""
        return self.server.ctx

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _headers(
        self, code: int, content_type: str, length: int | None, extra: Mapping[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Audit-Id", str(uuid.uuid4()))
        if length is None:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(length))
        for key, value in (extra or {}).items():
            self.send_header(key, value)
        self.end_headers()

    def _send_json(self, code: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self._headers(code, "application/json", len(data))
        self.wfile.write(data)

    def _send_text(self, code: int, text: str) -> None:
        data = text.encode()
        self._headers(code, "text/plain; charset=utf-8", len(data), {"X-Content-Type-Options": "nosniff"})
        self.wfile.write(data)

    def _send_error(self, err: ApiError) -> None:
        data = json.dumps(err.status(), separators=(",", ":")).encode()
        extra = {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None
        self._headers(err.code, "application/json", len(data), extra)
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, etype: str, obj: JSON) -> None:
        self._chunk(json.dumps({"type": etype, "object": obj}, separators=(",", ":")).encode() + b"\n")

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            peek: bytes = self.connection.recv(1, socket.MSG_PEEK)
            return peek == b""
        except (OSError, ValueError):
            return True

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, method: str) -> None:
        ctx = self.ctx
        split = urlsplit(self.path)
        path = split.path or "/"
        query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
        raw = self._read_body()
        content_type = self.headers.get("Content-Type")
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                body = None

        def record(status: int) -> None:
            ctx.requests.add(RequestRecord(method, path, query, status, content_type, body))

        if ctx.faults.down == "refuse":
            record(0)
            self._drop()
            return
        if ctx.faults.down == "hang" and not ctx.faults.hold_while_hanging(ctx.stopping):
            record(0)
            self._drop()
            return
        if ctx.faults.down == "503":
            err = ApiError(503)
            record(503)
            self._send_error(err)
            return
        pause = ctx.faults.delay_for(method, path)
        if pause > 0 and ctx.stopping.wait(pause):
            record(0)
            self._drop()
            return
        injected = ctx.faults.take_failure(method, path)
        if injected is not None:
            record(injected.code)
            self._send_error(injected)
            return
        try:
            account = self._authenticate(method, path, query)
            self._route(method, path, query, raw, body, content_type or "", record, account)
        except ApiError as err:
            record(err.code)
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:
            log.exception("API-server simulator failed on %s %s", method, self.path)
            internal = wrap_error(exc)
            record(internal.code)
            self._send_error(internal)

    def _authenticate(self, method: str, path: str, query: Mapping[str, str]) -> ServiceAccount | None:
        """The service account the request is made as (its rules apply), None for the simulator's
        own user (anything goes); 401 or 403 as the real server answers a request it cannot trust."""
        token = self.ctx.token
        header = self.headers.get("Authorization")
        if header is not None:
            scheme, _, presented = header.partition(" ")
            account = self.ctx.rbac.account(presented) if scheme.lower() == "bearer" else None
            if account is not None:
                return account
            if token is None and scheme.lower() == "bearer":
                # A token no authenticator accepts (made up, revoked) is refused, never the server's own user.
                raise ApiError(401)
        if token is None:
            return None
        if header is None:
            if path in PUBLIC_PATHS:
                return None
            route = _parse_api_path(path)
            if route is None:
                raise forbidden_anonymous(method.lower(), None, None, path)
            watch = route.watch_path or query.get("watch") in ("1", "true", "True")
            raise forbidden_anonymous(_verb(method, route, watch), route.kind.resource, route.namespace, path)
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or presented != token:  # the scheme in any case, as a real server
            raise ApiError(401)
        return None

    def _route(
        self,
        method: str,
        path: str,
        query: Mapping[str, str],
        raw: bytes,
        body: Any,
        content_type: str,
        record: Any,
        account: ServiceAccount | None = None,
    ) -> None:
        ctx = self.ctx
        if path in ("/healthz", "/livez", "/readyz") and method == "GET":
            record(200)
            self._send_text(200, "ok")
            return
        if path in ("/version", "/version/") and method == "GET":
            record(200)
            self._send_json(200, ctx.version)
            return
        if path in ("/api", "/api/") and method == "GET":
            record(200)
            self._send_json(
                200,
                {
                    "kind": "APIVersions",
                    "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ctx.server_address}],
                },
            )
            return
        if path in ("/api/v1", "/api/v1/") and method == "GET":
            record(200)
            self._send_json(200, resource_list())
            return
        unserved = not ctx.resource_api and (path == f"/apis/{GROUP}" or path.startswith(f"/apis/{GROUP}/"))
        if path in ("/apis", "/apis/") and method == "GET":
            record(200)
            groups = api_group_list()
            if not ctx.resource_api:
                groups["groups"] = [g for g in groups["groups"] if g.get("name") != GROUP]
            self._send_json(200, groups)
            return
        discovery = discovery_document(path) if method == "GET" and not unserved else None
        if discovery is not None:
            record(200)
            self._send_json(200, discovery)
            return
        if not path.startswith(("/api/", "/apis/")):
            record(404)
            self._send_text(404, "404 page not found\n")
            return
        route = None if unserved else _parse_api_path(path)
        if route is None:
            # The real server authorizes before it looks for the resource: a service account is
            # refused (403) what it may not do, served here or not, and told 404 only after.
            attrs = request_attributes(method, path, query) if account is not None else None
            if account is not None and attrs is not None:
                ctx.rbac.authorize(account, attrs)
            raise server_not_found()
        if account is not None:
            ctx.rbac.authorize(account, _attributes(method, route, query))
        if method in ("POST", "PUT") and raw and body is None:
            raise ApiError(400, "the body of the request could not be decoded as JSON")
        status, answer = self._call(method, route, query, raw, body, content_type, record)
        if answer is not None:
            record(status)
            self._send_json(status, answer)

    def _call(
        self,
        method: str,
        route: _Route,
        query: Mapping[str, str],
        raw: bytes,
        body: Any,
        content_type: str,
        record: Any,
    ) -> tuple[int, JSON | None]:
        ops = self.ctx.ops
        kind = route.kind
        ns = route.namespace
        key: Key = (ns or "", route.name or "")
        watch = route.watch_path or (method == "GET" and parse_bool(query, "watch"))
        if route.subresource == "binding":
            if method != "POST":
                raise method_not_allowed()
            return 201, ops.bind(key, body, query)
        if route.subresource == "status":
            if method == "GET":
                return 200, ops.get(kind, key)
            if method == "PUT":
                return 200, ops.replace(kind, key, body, query, status=True)
            if method == "PATCH":
                return 200, ops.patch(kind, key, raw, content_type, query, status=True)
            raise method_not_allowed()
        if route.name is None:
            if method == "GET" and watch:
                self._watch(ops.open_watch(kind, ns, None, query), record)
                return 200, None
            if method == "GET":
                return 200, ops.list(kind, ns, query)
            if method == "POST" and (ns is not None or not kind.namespaced):
                return 201, ops.create(kind, ns, body, query)
            if method == "DELETE" and (ns is not None or not kind.namespaced):
                return 200, ops.delete_collection(kind, ns, body, query)
            raise method_not_allowed()
        if method == "GET" and watch:
            self._watch(ops.open_watch(kind, ns, route.name, query), record)
            return 200, None
        if method == "GET":
            return 200, ops.get(kind, key)
        if method == "PUT":
            return 200, ops.replace(kind, key, body, query)
        if method == "PATCH":
            return 200, ops.patch(kind, key, raw, content_type, query)
        if method == "DELETE":
            return 200, ops.delete(kind, key, body, query)
        raise method_not_allowed()

    # ------------------------------------------------------------------ watch

    def _watch(self, plan: WatchPlan, record: Any) -> None:
        ctx = self.ctx
        record(200)
        self._headers(200, "application/json", None)
        watcher = plan.watcher
        try:
            if watcher is None:
                if plan.error is not None:
                    self._event("ERROR", plan.error.status())
                self._chunk(b"")
                return
            deadline = time.monotonic() + plan.timeout if plan.timeout is not None else None
            interval = ctx.bookmark_interval
            next_bookmark = time.monotonic() + interval
            while True:
                if ctx.faults.down == "hang":
                    # A hung server's open watches go silent too: no event, no bookmark, no end.
                    if ctx.stopping.wait(_POLL):
                        break
                    if self._client_gone():
                        self.close_connection = True
                        return
                    continue
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait = _POLL if deadline is None else min(_POLL, deadline - now)
                try:
                    item = watcher.queue.get(timeout=max(wait, 0.001))
                except queue.Empty:
                    if ctx.stopping.is_set():
                        break
                    if plan.bookmarks and time.monotonic() >= next_bookmark:
                        mark = ctx.store.bookmark(watcher)
                        if mark is not None:
                            self._event("BOOKMARK", mark)
                            next_bookmark = time.monotonic() + interval
                    if self._client_gone():
                        self.close_connection = True
                        return
                    continue
                if isinstance(item, WatchEnd):
                    if item.abrupt:
                        self._drop()
                        return
                    break
                etype, obj = item
                if etype == "BOOKMARK" and not plan.bookmarks:
                    continue
                if not ctx.faults.hold_watch_event(ctx.stopping):
                    break
                self._event(etype, obj)
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True
        finally:
            if watcher is not None:
                ctx.store.unwatch(watcher)
