"""List, then watch from the list's resourceVersion: a cache of one kind of object for any reader.

The list is asked for in pages (:mod:`gpumanager.kube.pager`: ``limit`` and ``continue``, each page
with its own timeout, started again when a continue token expired) and replaces what was known only
once every page is in. Objects stay the plain JSON the API server sends, less
``metadata.managedFields``. Listeners hear every change as ``(event_type, object, previous)``:
``ADDED``, ``MODIFIED`` or ``DELETED``; a relist (first start, or a watch answered "too old resource
version", 410, or "too large resource version", 504) is delivered as the difference to what was
known. The watch resumes from the last resourceVersion seen (bookmarks included); errors back off
0.5 s doubling to 10 s and each change of state is logged once.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Set
from typing import Any

from gpumanager.kube import shape
from gpumanager.kube.apierror import failure, resource_version_unusable, too_large_status
from gpumanager.kube.pager import LIST_PAGE_SIZE, list_pages
from gpumanager.kube.rest import read_body

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Listener = Callable[[str, Obj, Obj | None], None]
#: ``list_fn(resource_version)``-style calls of ``CoreV1Api`` taking the client's keyword arguments.
ListCall = Callable[..., Any]

_BACKOFF_START = 0.5
_BACKOFF_MAX = 10.0
_SHORT_WATCH_SECONDS = 1.0


def watch_read_timeout(watch_timeout: float) -> float:
    """Seconds a watch asked to end after ``watch_timeout`` may stay silent before it counts as broken.

    The API server ends a watch at its ``timeoutSeconds`` (with a bookmark just before, when asked
    for them); one that sends nothing for longer hangs (an API server or a path to it that stopped
    answering without closing the connection) and is dropped, to be watched again.
    """
    return watch_timeout + max(5.0, watch_timeout / 10)


class WatchExpiredError(Exception):
    """The API server no longer has the history the watch asked for (HTTP 410)."""


#: The longest watch event taken (bytes): far above the largest object the API server stores (etcd takes
#: 1.5 MiB a request), so only a stream gone wrong (bytes without a line end, from a broken proxy) reaches it.
MAX_EVENT_BYTES = 16 << 20


class WatchEventTooLargeError(ValueError):
    """A watch stream sent more than :data:`MAX_EVENT_BYTES` without ending its line."""


def event_lines(response: Any, limit: int = MAX_EVENT_BYTES) -> Iterator[bytes]:
    """The non-blank lines of a watch stream (one JSON event each), each at most ``limit`` bytes:
    :class:`WatchEventTooLargeError` past it. Read into memory without a bound, an endless line took the
    process to its out-of-memory kill; each chunk's lines are cut without copying the rest of it again."""
    pending = bytearray()
    for chunk in response.stream(amt=None, decode_content=True):
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            if end < 0:
                pending += chunk[start:]
                break
            pending += chunk[start:end]
            start = end + 1
            if pending.strip():
                yield bytes(pending)
            pending.clear()
        if len(pending) > limit:
            raise WatchEventTooLargeError(
                f"a watch event longer than {limit >> 20} MiB (no line end in {len(pending)} bytes); watching again"
            )
    if pending.strip():
        yield bytes(pending)


def object_key(obj: Obj) -> str:
    """The object's UID (the cache key)."""
    meta = obj.get("metadata")
    return str(meta.get("uid", "")) if isinstance(meta, dict) else ""


def _drop_managed_fields(obj: Obj) -> None:
    """Drop ``metadata.managedFields`` (the server's record of which client set which field, never read
    here), most of a pod's size: 20,000 pods held 193 MiB with them, 38 MiB without."""
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}


def _version(obj: Obj) -> object:
    meta = obj.get("metadata")
    return meta.get("resourceVersion") if isinstance(meta, dict) else None


class Reflector:
    """List+watch of one resource through a ``CoreV1Api`` list call (e.g. ``list_node``). Thread-safe.

    ``keep(obj)`` decides which objects are stored (others are treated as absent, so an object
    that stops matching is delivered as ``DELETED``).
    """

    def __init__(
        self,
        name: str,
        list_call: ListCall,
        *,
        field_selector: str = "",
        keep: Callable[[Obj], bool] | None = None,
        request_timeout: float = 30.0,
        watch_timeout: int = 300,
        page_size: int = LIST_PAGE_SIZE,
    ) -> None:
        self.name = name
        self._call = list_call
        self._selector = field_selector
        self._keep = keep or (lambda _obj: True)
        self._timeout = request_timeout
        self._watch_timeout = watch_timeout
        self._page_size = page_size
        self._lock = threading.Lock()
        self._objects: dict[str, Obj] = {}
        self._rv = ""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._listeners: list[Listener] = []
        self._last_error = ""
        self.lists = 0
        self.watch_restarts = 0

    # -- reading ----------------------------------------------------------------------------------

    def synced(self) -> bool:
        """Whether a list has completed."""
        return self._synced.is_set()

    def wait_synced(self, timeout: float) -> bool:
        """Wait for the first complete list."""
        return self._synced.wait(timeout)

    def objects(self) -> list[Obj]:
        """Every stored object."""
        with self._lock:
            return list(self._objects.values())

    def get(self, key: str) -> Obj | None:
        """A stored object by UID."""
        with self._lock:
            return self._objects.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    # -- lifecycle --------------------------------------------------------------------------------

    def add_listener(self, listener: Listener) -> None:
        """``listener(event_type, obj, previous)`` from the watch thread, in order."""
        self._listeners.append(listener)

    def start(self) -> None:
        """List and watch in the background."""
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self._stop.set()
        response = self._response
        if response is not None:
            # Closing the response does not wake a thread blocked reading it; shutting the socket does.
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

    def _page(self, limit: int | None, token: str) -> Any:
        kwargs: dict[str, Any] = {"_preload_content": False, "_request_timeout": self._timeout}
        if self._selector:
            kwargs["field_selector"] = self._selector
        if limit is not None:
            kwargs["limit"] = limit
        if token:
            kwargs["_continue"] = token
        response = self._call(**kwargs)
        return json.loads(read_body(response, f"{self.name}: a list page"))

    def _list(self) -> tuple[list[Obj], str]:
        """The objects ``keep`` keeps of every page, and the last page's resourceVersion."""
        items, meta = list_pages(self._page, what=self.name, page_size=self._page_size, keep=self._usable)
        return items, str(meta.get("resourceVersion", ""))

    def _usable(self, obj: Obj) -> bool:
        """Whether a listed object is one (:func:`gpumanager.kube.shape.problem`; warned of when not) that
        ``keep`` keeps."""
        why = shape.problem(obj)
        if not why:
            _drop_managed_fields(obj)
        if why:
            log.warning(
                "%s: the list holds %s that is no API object (%s); skipped", self.name, shape.described(obj), why
            )
            return False
        return self._keep(obj)

    def _listed(self, since: float, keys: Set[str]) -> None:
        """A complete list, asked for at ``since`` (``time.monotonic()``), showed the objects ``keys`` and
        its events were delivered; called before :meth:`synced` turns true (a subclass draws what the list
        tells before anyone reads the cache as listed)."""

    def _relist(self) -> None:
        since = time.monotonic()
        items, rv = self._list()
        self.lists += 1
        fresh = {object_key(o): o for o in items}
        with self._lock:
            old = self._objects
            self._objects = fresh
            self._rv = rv
        for key, obj in fresh.items():
            prev = old.get(key)
            if prev is None:
                self._emit("ADDED", obj, None)
            elif _version(prev) != _version(obj):
                self._emit("MODIFIED", obj, prev)
        for key, obj in old.items():
            if key not in fresh:
                self._emit("DELETED", obj, obj)
        self._listed(since, fresh.keys())
        self._synced.set()
        log.info("%s: listed %d (resourceVersion %s)", self.name, len(fresh), rv)

    def _watch(self) -> None:
        kwargs: dict[str, Any] = {
            "watch": True,
            "resource_version": self._rv,
            "allow_watch_bookmarks": True,
            "timeout_seconds": self._watch_timeout,
            "_preload_content": False,
            "_request_timeout": (self._timeout, watch_read_timeout(self._watch_timeout)),
        }
        if self._selector:
            kwargs["field_selector"] = self._selector
        try:
            response = self._call(**kwargs)
        except Exception as exc:
            if resource_version_unusable(exc):  # watched again from it, it fails the same way for ever
                raise WatchExpiredError(f"resourceVersion {self._rv}: {failure(exc)}") from exc
            raise
        self._response = response
        started, events = time.monotonic(), 0
        try:
            for line in event_lines(response):
                if self._stop.is_set():
                    return
                self._apply(json.loads(line))
                events += 1
        finally:
            self._response = None
            response.release_conn()
        if not events and not self._stop.is_set() and time.monotonic() - started < _SHORT_WATCH_SECONDS:
            # As client-go: a watch ended at once with no event is an error, retried after the backoff
            # (an API server or a proxy ending every watch must not be watched again in a hot loop).
            raise RuntimeError(f"very short watch: ended within {_SHORT_WATCH_SECONDS:g} s with no event")

    def _apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            log.warning("%s: a watch event that is not an object (%s); skipped", self.name, shape.shown(event))
            return
        kind = event.get("type")
        obj = event.get("object") or {}
        if not isinstance(obj, dict):
            obj = {"message": shape.shown(obj)}
        if kind == "ERROR":
            if obj.get("code") == 410 or too_large_status(obj):
                raise WatchExpiredError(str(obj.get("message", "")))
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        if kind in ("ADDED", "MODIFIED", "DELETED") and shape.problem(obj):
            log.warning(
                "%s: a %s event of %s that is no API object (%s); skipped",
                self.name,
                kind,
                shape.described(obj),
                shape.problem(obj),
            )
            return
        rv = str(_version(obj) or "")
        if kind == "BOOKMARK":
            with self._lock:
                self._rv = rv or self._rv
            return
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        _drop_managed_fields(obj)
        key = object_key(obj)
        kept = kind != "DELETED" and self._keep(obj)
        with self._lock:
            prev = self._objects.get(key)
            if kept:
                self._objects[key] = obj
            else:
                self._objects.pop(key, None)
            self._rv = rv or self._rv
        if kept:
            self._emit("MODIFIED" if prev is not None else "ADDED", obj, prev)
        elif prev is not None:
            self._emit("DELETED", obj, prev)

    def _emit(self, kind: str, obj: Obj, prev: Obj | None) -> None:
        for listener in self._listeners:
            try:
                listener(kind, obj, prev)
            except Exception:
                log.exception("%s: listener failed on %s", self.name, kind)

    def _report(self, message: str) -> None:
        if message != self._last_error:
            if message:
                log.warning("%s: %s (retrying)", self.name, message)
            else:
                log.info("%s: API server reachable again", self.name)
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
                log.info("%s: watch expired (%s); listing again", self.name, exc)
                need_list = True
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._report(failure(exc))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
