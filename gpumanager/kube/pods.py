"""A cache of this node's pods: list, then watch from the list's resourceVersion.

The list is asked for in pages (``limit``/``continue``, :mod:`gpumanager.kube.pager`), each with the
request timeout, and replaces the cache only once every page is in.

Pods are kept as the plain JSON objects the API server sends (no model
conversion), less ``metadata.managedFields`` (the server's field-ownership record, often the
largest part of a pod, which the agent never reads), and with their keys and short strings
interned: each pod decoded from its own watch event would otherwise hold its own copy of every
key and of the values pods share (image, namespace, node, resource names), about half of what a
cached pod costs. The watch resumes from the last resourceVersion it saw; a "too old
resource version" answer (410, as an ERROR event or the watch's own status) or a "too large
resource version" one (504: the server's resourceVersion went back, its etcd restored from a
backup) starts over with a fresh list. Failures and such answers wait the agent's jittered
backoff (:mod:`gpumanager.retry`, 0.8 s doubling to 30 s) and each change of state is logged once.

:meth:`PodCache.refresh` (a list for a pod the cache has not seen yet, asked
inside a kubelet call) has a short total deadline: one list at a time runs in
the background and callers wait for it at most ``refresh_deadline`` seconds,
so a hanging API server costs a caller that long and never more.

Every change the cache takes in counts one generation; :meth:`PodCache.changes`
names the pods changed since a generation a reader saw, so a reader keeping its
own view (the allocator's index of pods waiting for GPUs) need not walk every pod
of the node each time.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from gpumanager.allocation.model import RECENT_LIST_SECONDS
from gpumanager.kube import shape
from gpumanager.kube.apierror import failure, resource_version_unusable, too_large_status
from gpumanager.kube.pager import LIST_PAGE_SIZE
from gpumanager.kube.reflector import event_lines, watch_read_timeout
from gpumanager.kube.rest import ApiClient, KubeRest
from gpumanager.retry import Backoff

log = logging.getLogger(__name__)

Pod = Mapping[str, Any]
PodListener = Callable[[str, Pod], None]

#: Strings up to this long are interned in cached pods (longer ones are seldom shared).
_INTERNED_CHARS = 128

#: Changes remembered for :meth:`PodCache.changes`; a reader further behind is told to look at every pod.
CHANGES_KEPT = 4096
#: A watch that lived this long counts as a success: the next failure backs off from the start.
_HEALTHY_WATCH_SECONDS = 30.0
#: A watch that ends sooner with no event is an error (client-go's "very short watch"): retried after a backoff.
_SHORT_WATCH_SECONDS = 1.0


class ShortWatchError(Exception):
    """The API server ended a watch at once with no event."""


class PodListError(RuntimeError):
    """A list of the node's pods the API server refused: one line with its status and the message of its
    Status (a 403's names the service account, the verb and the resource), the client's exception as
    the cause. Its text reaches the kubelet in an Allocate refusal, which shows it in the pod's events."""


class WatchExpiredError(Exception):
    """The watch's resourceVersion cannot be watched from (410 Gone, or 504 too large): a new list is needed."""


def unusable(obj: object) -> str:
    """Why an object the API server sent as a pod cannot be one ("" when it can): see
    :func:`gpumanager.kube.shape.problem` (a UID is required)."""
    return shape.problem(obj, uid=True)


def _described(obj: object) -> str:
    return shape.described(obj, "pod")


def _name_of(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def compact(pod: Mapping[str, Any]) -> dict[str, Any]:
    """``pod`` as the cache keeps it: without ``metadata.managedFields``, its keys and short strings
    interned (shared with every other pod that has them). Equal to ``pod`` otherwise."""
    kept: dict[str, Any] = _interned(pod if isinstance(pod, dict) else dict(pod))
    meta = kept.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return kept


def _interned(value: Any) -> Any:
    if isinstance(value, dict):
        return {sys.intern(k) if type(k) is str else k: _interned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interned(v) for v in value]
    if type(value) is str and len(value) <= _INTERNED_CHARS:
        return sys.intern(value)
    return value


def _named(pods: list[Pod], namespace: str, name: str) -> Pod | None:
    """The first of ``pods`` of that namespace and name."""
    for p in pods:
        meta = p.get("metadata") or {}
        if meta.get("namespace") == namespace and meta.get("name") == name:
            return p
    return None


class _Flight:
    """One list of :meth:`PodCache.refresh` on its way: when it was sent, and its answer."""

    def __init__(self, sent: float, generation: int) -> None:
        self.sent = sent
        self.generation = generation  # the cache's when the list was sent
        self.done = threading.Event()
        self.items: list[Pod] | None = None
        self.error: BaseException | None = None


class PodCache:
    """List+watch of the pods whose ``spec.nodeName`` is this node. Thread-safe."""

    def __init__(
        self,
        api: ApiClient,
        node_name: str,
        *,
        request_timeout: float = 10.0,
        watch_timeout: int = 300,
        refresh_deadline: float = 3.0,
        page_size: int = LIST_PAGE_SIZE,
    ) -> None:
        self._rest = KubeRest(api)
        self._node = node_name
        self._selector = f"spec.nodeName={node_name}"
        self._timeout = request_timeout
        self._watch_timeout = watch_timeout
        self._page_size = page_size
        self._lock = threading.Lock()
        self._pods: dict[str, Pod] = {}
        # (namespace, name) -> UIDs of the cached pods of that name, in the order of self._pods (two
        # while a StatefulSet's pod is replaced): find() is asked on each PreStartContainer.
        self._by_name: dict[tuple[str, str], list[str]] = {}
        self._rv = ""
        self._generation = 0
        # UID -> generation of the pod's latest change, oldest first (at most CHANGES_KEPT).
        self._changed: OrderedDict[str, int] = OrderedDict()
        # A reader at a generation below this cannot be told what changed (a relist, the oldest changes dropped).
        self._floor = 0
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: Any = None
        self._listeners: list[PodListener] = []
        self._last_error = ""
        self._refresh_deadline = refresh_deadline
        self._refresh_lock = threading.Lock()
        self._refresh_flight: _Flight | None = None
        self._refresh_last: _Flight | None = None  # the last list answered
        self.backoff = Backoff()
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

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        """(the generation now, the UIDs of pods added, changed or deleted after generation ``since``).

        The set is None when the cache cannot tell (a reader's first call with ``since`` -1, a list
        since, or more changes than it remembers): any pod may have changed. A pod read after this
        call is at least as new as the generation returned.
        """
        with self._lock:
            if since < self._floor:
                return self._generation, None
            changed = []
            for uid, generation in reversed(self._changed.items()):
                if generation <= since:
                    break
                changed.append(uid)
            return self._generation, frozenset(changed)

    def _changed_locked(self, uid: str) -> None:
        self._generation += 1
        self._changed.pop(uid, None)
        self._changed[uid] = self._generation
        if len(self._changed) > CHANGES_KEPT:
            _, self._floor = self._changed.popitem(last=False)

    def find(self, namespace: str, name: str) -> Pod | None:
        """A cached pod by namespace and name (the one cached first, if two have the name)."""
        with self._lock:
            uids = self._by_name.get((namespace, name))
            return self._pods[uids[0]] if uids else None

    def refresh(self) -> list[Pod]:
        """The node's pods listed from the API server now; the cache is not changed.

        The list answered was sent after this call began: a caller that finds a list already on its
        way waits for it and then for the next (a list sent before it may lack pods the caller has just
        seen, and callers free the GPUs of pods a list lacks). One list at a time is in flight; callers
        arriving meanwhile share the next. Waits at most ``refresh_deadline`` seconds in all and raises
        TimeoutError saying the API server did not answer, or the list's own error.
        """
        arrived = time.monotonic()
        deadline = arrived + self._refresh_deadline
        while True:
            with self._refresh_lock:
                flight = self._refresh_flight
                last = self._refresh_last
                if last is not None and last.sent >= arrived:
                    flight = last  # answered already, sent after this caller asked
                elif flight is None:
                    with self._lock:
                        generation = self._generation
                    flight = self._refresh_flight = _Flight(time.monotonic(), generation)
                    threading.Thread(target=self._refresh_once, args=(flight,), name="pod-refresh", daemon=True).start()
            if not flight.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the API server did not answer a pod list within {self._refresh_deadline:g} s")
            if flight.sent >= arrived:
                break
        if flight.error is not None:
            if getattr(flight.error, "status", None) is not None:  # the client's multi-line ApiException
                raise PodListError(
                    f"cannot list the pods of node {self._node}: {failure(flight.error)}"
                ) from flight.error
            raise flight.error
        assert flight.items is not None
        return flight.items

    def _refresh_once(self, flight: _Flight) -> None:
        try:
            flight.items, _ = self._list()
        except Exception as exc:
            flight.error = exc
        with self._refresh_lock:
            self._refresh_flight = None
            self._refresh_last = flight
        flight.done.set()

    def recent(self, within: float, since: float) -> list[Pod] | None:
        """The pods of the last :meth:`refresh`'s list when it was sent at ``since`` (``time.monotonic()``) or
        later, less than ``within`` seconds ago, and the cache has taken in no change since it was sent; else
        None.

        For the calls of one admission behind a lagging watch: ``since`` is when the first of them reached
        the agent (the kubelet's GetPreferredAllocation), so the list shows the node's pods as they were once
        the kubelet had chosen the pod it admits; an older list may show as waiting a pod that has since
        failed its admission or been replaced by another of its name."""
        last = self._refresh_last
        if last is None or last.items is None or last.sent < since or time.monotonic() - last.sent >= within:
            return None
        with self._lock:
            if self._generation != last.generation:
                return None
        return last.items

    def lookup(self, namespace: str, name: str, since: float | None = None) -> Pod | None:
        """A pod by namespace and name: from the cache, else (with ``since``) from a list sent since then
        and less than :data:`RECENT_LIST_SECONDS` ago (:meth:`recent`), else from a fresh list (bounded as
        :meth:`refresh`)."""
        pod = self.find(namespace, name)
        if pod is not None:
            return pod
        recent = self.recent(RECENT_LIST_SECONDS, since) if since is not None else None
        pod = _named(recent, namespace, name) if recent is not None else None
        if pod is not None:
            return pod
        try:
            return _named(self.refresh(), namespace, name)
        except Exception as exc:
            log.warning("cannot look up pod %s/%s: %s", namespace, name, failure(exc))
            return None

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

    def stop(self, timeout: float = 1.0) -> None:
        """Stop watching: the watch connection is shut down, so a reader blocked on it returns at once."""
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()
            except Exception as exc:
                log.debug("shutting down the watch connection: %s", exc)
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def alive(self) -> bool:
        """Whether the list/watch loop runs."""
        return self._thread is not None and self._thread.is_alive()

    # -- the loop ---------------------------------------------------------------------------------

    def _list(self) -> tuple[list[Pod], str]:
        data = self._rest.list_pods(field_selector=self._selector, timeout=self._timeout, page_size=self._page_size)
        items: list[Pod] = []
        for p in data.get("items") or []:
            why = unusable(p)
            if why:
                log.warning(
                    "the pod list of node %s holds %s that is no pod (%s); skipped", self._node, _described(p), why
                )
                continue
            items.append(dict(p))
        return items, str((data.get("metadata") or {}).get("resourceVersion", ""))

    def _relist(self) -> None:
        items, rv = self._list()
        self.lists += 1
        fresh: dict[str, Pod] = {str((p.get("metadata") or {}).get("uid", "")): compact(p) for p in items}
        by_name: dict[tuple[str, str], list[str]] = {}
        for uid, pod in fresh.items():
            by_name.setdefault(_name_of(pod), []).append(uid)
        with self._lock:
            old = self._pods
            self._pods = fresh
            self._by_name = by_name
            self._rv = rv
            self._generation += 1
            self._floor = self._generation
            self._changed.clear()
        for uid, pod in fresh.items():
            self._emit("MODIFIED" if uid in old else "ADDED", pod)
        for uid, pod in old.items():
            if uid not in fresh:
                self._emit("DELETED", pod)
        self._synced.set()
        log.info("listed %d pods on node %s (resourceVersion %s)", len(fresh), self._node, rv)

    def _watch(self) -> None:
        try:
            response: Any = self._rest.watch_pods(
                field_selector=self._selector,
                resource_version=self._rv,
                timeout_seconds=self._watch_timeout,
                timeout=(self._timeout, watch_read_timeout(self._watch_timeout)),
            )
        except Exception as exc:
            if resource_version_unusable(exc):  # watched again from it, it fails the same way for ever
                raise WatchExpiredError(f"resourceVersion {self._rv}: {failure(exc)}") from exc
            raise
        self._response = response
        if self._stop.is_set():
            response.shutdown()
        started = time.monotonic()
        events = 0
        try:
            for line in event_lines(response):
                if self._stop.is_set():
                    return
                self._apply(json.loads(line))
                events += 1
                self.backoff.reset()
        finally:
            self._response = None
            response.release_conn()
        lasted = time.monotonic() - started
        if lasted >= _HEALTHY_WATCH_SECONDS:
            self.backoff.reset()
        elif lasted < _SHORT_WATCH_SECONDS and not events and not self._stop.is_set():
            # As client-go's reflector: an API server (or a proxy) ending every watch at once must not
            # be watched again in a hot loop.
            raise ShortWatchError(f"very short watch: ended within {_SHORT_WATCH_SECONDS:g} s with no event")

    def _apply(self, event: Any) -> None:
        if not isinstance(event, dict):
            log.warning(
                "pod watch of node %s: an event that is not an object (%s); skipped", self._node, shape.shown(event)
            )
            return
        kind = event.get("type")
        obj = event.get("object") or {}
        if not isinstance(obj, dict):
            obj = {"message": shape.shown(obj)}
        if kind in ("ADDED", "MODIFIED", "DELETED") and unusable(obj):
            log.warning(
                "pod watch of node %s: %s event of %s that is no pod (%s); skipped",
                self._node,
                kind,
                _described(obj),
                unusable(obj),
            )
            return
        if kind == "ERROR":
            if obj.get("code") == 410 or too_large_status(obj):
                raise WatchExpiredError(str(obj.get("message", "")))
            raise RuntimeError(f"watch error: {obj.get('message', obj)}")
        meta = obj.get("metadata")
        rv = str(meta.get("resourceVersion", "")) if isinstance(meta, dict) else ""
        if kind == "BOOKMARK":
            with self._lock:
                self._rv = rv or self._rv
            return
        uid = str(meta.get("uid", "")) if isinstance(meta, dict) else ""
        with self._lock:
            if kind == "DELETED":
                gone = self._pods.pop(uid, None)
                if gone is not None:
                    self._unindex_locked(uid, gone)
            elif kind in ("ADDED", "MODIFIED"):
                obj = compact(obj)
                before = self._pods.get(uid)
                self._pods[uid] = obj
                if before is None:
                    self._by_name.setdefault(_name_of(obj), []).append(uid)
                elif _name_of(before) != _name_of(obj):  # names do not change; a server that says so is believed
                    self._unindex_locked(uid, before)
                    self._by_name.setdefault(_name_of(obj), []).append(uid)
            else:
                return
            self._changed_locked(uid)
            self._rv = rv or self._rv
        self._emit(str(kind), obj)

    def _unindex_locked(self, uid: str, pod: Pod) -> None:
        key = _name_of(pod)
        uids = self._by_name.get(key)
        if uids is not None and uid in uids:
            uids.remove(uid)
            if not uids:
                del self._by_name[key]

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
        need_list = True
        while not self._stop.is_set():
            try:
                if need_list:
                    self._relist()
                    need_list = False
                self._report("")
                self._watch()
                self.watch_restarts += 1
            except WatchExpiredError as exc:
                log.info("pod watch expired (%s); listing again after a backoff", exc)
                need_list = True
                if self.backoff.wait(self._stop):
                    return
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._report(failure(exc))
                # The watch resumes from the last resourceVersion; the server answers 410 if it
                # no longer has that history, and then we list again.
                if self.backoff.wait(self._stop):
                    return
