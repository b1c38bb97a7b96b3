"""A cache of this node's pods: list, then watch from the list's resourceVersion.

Pods are kept as the plain JSON objects the API server sends (no model
conversion). The watch resumes from the last resourceVersion it saw; a "too old
resource version" answer (410) starts over with a fresh list; errors back off
(0.5 s doubling to 10 s) and each change of state is logged once.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kubernetes import client

log = logging.getLogger(__name__)

Pod = Mapping[str, Any]
PodListener = Callable[[str, Pod], None]

_BACKOFF_START = 0.5
_BACKOFF_MAX = 10.0


class WatchExpiredError(Exception):
    """The API server no longer has the history the watch asked for (HTTP 410)."""


def _lines(response: Any) -> Iterator[bytes]:
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=True):
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


class PodCache:
    """List+watch of the pods whose ``spec.nodeName`` is this node. Thread-safe."""

    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        *,
        request_timeout: float = 10.0,
        watch_timeout: int = 300,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._node = node_name
        self._selector = f"spec.nodeName={node_name}"
        self._timeout = request_timeout
        self._watch_timeout = watch_timeout
        self._lock = threading.Lock()
        self._pods: dict[str, Pod] = {}
        self._rv = ""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._listeners: list[PodListener] = []
        self._last_error = ""
        self.lists = 0
        self.watch_restarts = 0

    # -- PodSource --------------------------------------------------------------------------------

    def synced(self) -> bool:
        """Whether a list has completed (the cache has a complete view)."""
        return self._synced.is_set()

    def pods(self) -> list[Pod]:
        """Every cached pod of this node."""
        with self._lock:
            return list(self._pods.values())

    def get(self, uid: str) -> Pod | None:
        """A cached pod by UID."""
        with self._lock:
            return self._pods.get(uid)

    def find(self, namespace: str, name: str) -> Pod | None:
        """A cached pod by namespace and name."""
        with self._lock:
            for pod in self._pods.values():
                meta = pod.get("metadata") or {}
                if meta.get("namespace") == namespace and meta.get("name") == name:
                    return pod
        return None

    def refresh(self) -> list[Pod]:
        """List the node's pods from the API server now (raises on failure); the cache is not changed."""
        items, _ = self._list()
        return items

    # -- lifecycle --------------------------------------------------------------------------------

    def add_listener(self, listener: PodListener) -> None:
        """``listener(event_type, pod)`` for ADDED, MODIFIED and DELETED (from the watch thread)."""
        self._listeners.append(listener)

    def start(self) -> None:
        """Start listing and watching in the background."""
        self._thread = threading.Thread(target=self._run, name="pod-cache", daemon=True)
        self._thread.start()

    def wait_synced(self, timeout: float) -> bool:
        """Wait for the first complete list."""
        return self._synced.wait(timeout)

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        response = self._response
        if response is not None:
            # close() waits for the reading thread to let go of the stream, which it does only when
            # the next bytes come (possibly a minute later); shutting the socket wakes it at once.
            sock = getattr(getattr(response, "connection", None), "sock", None)
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
                response.close()
            except Exception:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- the loop ---------------------------------------------------------------------------------

    def _list(self) -> tuple[list[Pod], str]:
        response: Any = self._core.list_pod_for_all_namespaces(
            field_selector=self._selector, _preload_content=False, _request_timeout=self._timeout
        )
        data = json.loads(response.data)
        items: list[Pod] = [dict(p) for p in data.get("items") or []]
        return items, str((data.get("metadata") or {}).get("resourceVersion", ""))

    def _relist(self) -> None:
        items, rv = self._list()
        self.lists += 1
        fresh = {str((p.get("metadata") or {}).get("uid", "")): p for p in items}
        with self._lock:
            old = self._pods
            self._pods = fresh
            self._rv = rv
        for uid, pod in fresh.items():
            self._emit("MODIFIED" if uid in old else "ADDED", pod)
        for uid, pod in old.items():
            if uid not in fresh:
                self._emit("DELETED", pod)
        self._synced.set()
        log.info("listed %d pods on node %s (resourceVersion %s)", len(fresh), self._node, rv)

    def _watch(self) -> None:
        response: Any = self._core.list_pod_for_all_namespaces(
            field_selector=self._selector,
            watch=True,
            resource_version=self._rv,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout,
            _preload_content=False,
            _request_timeout=(self._timeout, self._watch_timeout + 30),
        )
        self._response = response
        try:
            for line in _lines(response):
                if self._stop.is_set():
                    return
                self._apply(json.loads(line))
        finally:
            self._response = None
            response.release_conn()

    def _apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise WatchExpiredError(str(obj.get("message", "")))
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        rv = str((obj.get("metadata") or {}).get("resourceVersion", ""))
        if kind == "BOOKMARK":
            with self._lock:
                self._rv = rv or self._rv
            return
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        with self._lock:
            if kind == "DELETED":
                self._pods.pop(uid, None)
            elif kind in ("ADDED", "MODIFIED"):
                self._pods[uid] = obj
            else:
                return
            self._rv = rv or self._rv
        self._emit(str(kind), obj)

    def _emit(self, kind: str, pod: Pod) -> None:
        for listener in self._listeners:
            try:
                listener(kind, pod)
            except Exception:
                log.exception("pod listener failed")

    def _report(self, message: str) -> None:
        if message != self._last_error:
            if message:
                log.warning("pod cache: %s (retrying)", message)
            else:
                log.info("pod cache: API server reachable again")
            self._last_error = message

    def _run(self) -> None:
        backoff = _BACKOFF_START
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._relist()
                    need_list = False
                self._report("")
                backoff = _BACKOFF_START
                self._watch()
                self.watch_restarts += 1
            except WatchExpiredError as exc:
                log.info("pod watch expired (%s); listing again", exc)
                need_list = True
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._report(f"{type(exc).__name__}: {exc}")
                # The watch resumes from the last resourceVersion; the server answers 410 if it
                # no longer has that history, and then we list again.
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
