"""The simulator's object store: one global resourceVersion, a bounded change history, watchers.

Like etcd behind the real server, every write bumps one cluster-wide counter and the object's
``metadata.resourceVersion`` becomes the counter's value; the history of changes lets a watch
resume from any resourceVersion still retained (older ones answer 410 ``Expired``) and lets a
list be served at an exact resourceVersion (``resourceVersionMatch=Exact``, ``continue``).

All state sits behind one lock; changes reach the watchers' queues while it is held, so every
watcher sees changes in resourceVersion order with no gaps.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from simnode.apiserver_errors import ApiError, already_exists, conflict, expired, not_found
from simnode.apiserver_objects import ResourceKind, meta, now_rfc3339
from simnode.apiserver_selectors import FieldSelector, LabelSelector, selectable_fields

log = logging.getLogger(__name__)

JSON = dict[str, Any]
Key = tuple[str, str]
"""``(namespace, name)``; the namespace is ``""`` for cluster-scoped objects."""

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


def key_of(obj: JSON) -> Key:
    """The store key of an object."""
    md = meta(obj)
    return str(md.get("namespace") or ""), str(md.get("name") or "")


@dataclass(frozen=True)
class Change:
    """One write: the object after it (for DELETED: at deletion) and before it."""

    rv: int
    type: str
    kind: ResourceKind
    key: Key
    obj: JSON
    prev: JSON | None


@dataclass(frozen=True)
class WatchEnd:
    """Queue marker: the stream ends, cleanly or by dropping the connection."""

    abrupt: bool


WatchItem = tuple[str, JSON] | WatchEnd


@dataclass(eq=False)
class Watcher:
    """One open watch: its filter and the queue of events its HTTP stream writes out."""

    kind: ResourceKind
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    name: str | None = None
    queue: queue.Queue[WatchItem] = field(default_factory=queue.Queue)
    closed: bool = False

    def matches(self, obj: JSON) -> bool:
        """Whether ``obj`` passes the namespace, name, label and field filters."""
        md = meta(obj)
        if self.namespace is not None and md.get("namespace") != self.namespace:
            return False
        if self.name is not None and md.get("name") != self.name:
            return False
        if not self.labels.matches(md.get("labels")):
            return False
        return self.fields.empty or self.fields.matches(selectable_fields(obj, self.kind.fields))

    def offer(self, change: Change) -> None:
        """Queue the event ``change`` means to this watcher, as the watch cache filters it.

        An object that starts matching the selectors arrives as ADDED, one that stops matching
        as DELETED (carrying its new state), as on the real server.
        """
        if self.closed or change.kind is not self.kind:
            return
        was = change.prev is not None and self.matches(change.prev)
        if change.type == "DELETED":
            if was:
                self.queue.put(("DELETED", change.obj))
            return
        now = self.matches(change.obj)
        if now and was:
            self.queue.put(("MODIFIED", change.obj))
        elif now:
            self.queue.put(("ADDED", change.obj))
        elif was:
            self.queue.put(("DELETED", change.obj))

    def close(self, abrupt: bool = False) -> None:
        """End the stream (its HTTP handler writes the end, or drops the connection)."""
        if not self.closed:
            self.closed = True
            self.queue.put(WatchEnd(abrupt))


def bookmark_object(kind: ResourceKind, rv: int, *, initial_events_end: bool = False) -> JSON:
    """The object of a BOOKMARK event: an empty object carrying only the resourceVersion."""
    md: JSON = {"resourceVersion": str(rv), "creationTimestamp": None}
    if initial_events_end:
        md["annotations"] = {INITIAL_EVENTS_END: "true"}
    return {"kind": kind.kind, "apiVersion": kind.group_version, "metadata": md}


@dataclass(frozen=True)
class ListResult:
    """One page of a list."""

    items: list[JSON]
    rv: int
    next_key: Key | None
    remaining: int


@dataclass(frozen=True)
class StoreBackup:
    """A copy of the store's objects at one resourceVersion (:meth:`Store.backup`)."""

    rv: int
    objects: dict[str, dict[Key, JSON]]


class Store:
    """Objects of every served kind, the resourceVersion counter, the change history, watchers."""

    def __init__(self, history: int = 1000) -> None:
        if history < 1:
            raise ValueError(f"history must be at least 1, got {history}")
        self.lock = threading.RLock()
        self._rv = 0
        self._objects: dict[str, dict[Key, JSON]] = {}
        self._history: deque[Change] = deque()
        self._history_limit = history
        self._compacted = 0
        self._watchers: list[Watcher] = []
        self._listeners: dict[int, Callable[[Change], None]] = {}

    # ------------------------------------------------------------------ reading

    @property
    def rv(self) -> int:
        """The current (latest) resourceVersion."""
        with self.lock:
            return self._rv

    @property
    def compacted(self) -> int:
        """The oldest resourceVersion a watch can still start from."""
        with self.lock:
            return self._compacted

    def _table(self, kind: ResourceKind) -> dict[Key, JSON]:
        return self._objects.setdefault(kind.resource, {})

    def get(self, kind: ResourceKind, key: Key) -> JSON | None:
        """A copy of the stored object, or None."""
        with self.lock:
            obj = self._table(kind).get(key)
            return copy.deepcopy(obj) if obj is not None else None

    def get_or_404(self, kind: ResourceKind, key: Key) -> JSON:
        """A copy of the stored object; 404 NotFound when absent."""
        obj = self.get(kind, key)
        if obj is None:
            raise not_found(kind.resource, key[1])
        return obj

    def _snapshot(self, kind: ResourceKind, at: int | None) -> dict[Key, JSON]:
        table = dict(self._table(kind))
        if at is None or at >= self._rv:
            return table
        if at < self._compacted:
            raise expired(f"too old resource version: {at} ({self._compacted + 1})")
        for change in reversed(self._history):
            if change.rv <= at:
                break
            if change.kind is not kind:
                continue
            if change.type == "ADDED":
                table.pop(change.key, None)
            elif change.prev is not None:
                table[change.key] = change.prev
        return table

    def list(
        self,
        kind: ResourceKind,
        *,
        namespace: str | None = None,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
        at: int | None = None,
        after: Key | None = None,
        limit: int | None = None,
    ) -> ListResult:
        """Matching objects in key order (namespace, name), at resourceVersion ``at`` (None: latest).

        ``after`` continues a paged list; ``limit`` cuts the page and reports how many more match.
        """
        labels = labels or LabelSelector()
        fields = fields or FieldSelector()
        with self.lock:
            table = self._snapshot(kind, at)
            list_rv = self._rv if at is None else at
            matched: list[JSON] = []
            for key in sorted(table):
                if after is not None and key <= after:
                    continue
                obj = table[key]
                md = meta(obj)
                if namespace is not None and md.get("namespace") != namespace:
                    continue
                if not labels.matches(md.get("labels")):
                    continue
                if not fields.empty and not fields.matches(selectable_fields(obj, kind.fields)):
                    continue
                matched.append(obj)
            page = matched if limit is None or limit <= 0 else matched[:limit]
            rest = len(matched) - len(page)
            next_key = key_of(page[-1]) if rest > 0 and page else None
            return ListResult([copy.deepcopy(o) for o in page], list_rv, next_key, rest)

    # ------------------------------------------------------------------ writing

    def _record(self, change: Change) -> None:
        self._history.append(change)
        while len(self._history) > self._history_limit:
            dropped = self._history.popleft()
            self._compacted = max(self._compacted, dropped.rv)
        for watcher in self._watchers:
            watcher.offer(change)
        for listener in self._listeners.values():
            listener(change)

    def _stamp(self, kind: ResourceKind, obj: JSON, rv: int) -> None:
        obj["kind"] = kind.kind
        obj["apiVersion"] = kind.group_version
        meta(obj)["resourceVersion"] = str(rv)

    def create(self, kind: ResourceKind, obj: JSON, *, dry_run: bool = False) -> JSON:
        """Store a new object (ADDED); 409 AlreadyExists when the key is taken."""
        with self.lock:
            key = key_of(obj)
            table = self._table(kind)
            if key in table:
                raise already_exists(kind.resource, key[1])
            new = copy.deepcopy(obj)
            if dry_run:
                self._stamp(kind, new, self._rv)
                meta(new).pop("resourceVersion", None)
                return new
            self._rv += 1
            self._stamp(kind, new, self._rv)
            table[key] = new
            self._record(Change(self._rv, "ADDED", kind, key, new, None))
            return copy.deepcopy(new)

    def update(
        self,
        kind: ResourceKind,
        key: Key,
        mutate: Callable[[JSON], JSON],
        *,
        dry_run: bool = False,
        always_write: bool = False,
    ) -> JSON:
        """Replace an object with ``mutate(copy_of_current)`` (MODIFIED).

        The result's ``metadata.resourceVersion``, when set, must equal the stored one (409
        Conflict otherwise). An update that changes nothing writes nothing (no new
        resourceVersion, no event) unless ``always_write``. An object being deleted whose last
        finalizer goes away is deleted (DELETED).
        """
        with self.lock:
            table = self._table(kind)
            current = table.get(key)
            if current is None:
                raise not_found(kind.resource, key[1])
            new = mutate(copy.deepcopy(current))
            wanted = meta(new).get("resourceVersion")
            current_rv = str(meta(current).get("resourceVersion"))
            if wanted not in (None, "") and str(wanted) != current_rv:
                raise conflict(kind.resource, key[1])
            if key_of(new) != key:
                raise ApiError(500, f"Internal error occurred: update changed the key of {kind.resource} {key}")
            self._stamp(kind, new, int(current_rv))
            if new == current and not always_write:
                return copy.deepcopy(current)
            if dry_run:
                return new
            if _should_delete_during_update(current, new):
                return self._remove(kind, key, new)
            self._rv += 1
            self._stamp(kind, new, self._rv)
            table[key] = new
            self._record(Change(self._rv, "MODIFIED", kind, key, new, current))
            return copy.deepcopy(new)

    def _remove(self, kind: ResourceKind, key: Key, last: JSON) -> JSON:
        table = self._table(kind)
        prev = table.pop(key)
        self._rv += 1
        final = copy.deepcopy(last)
        self._stamp(kind, final, self._rv)
        self._record(Change(self._rv, "DELETED", kind, key, final, prev))
        return copy.deepcopy(final)

    def delete(
        self,
        kind: ResourceKind,
        key: Key,
        *,
        grace_seconds: int = 0,
        preconditions: JSON | None = None,
        dry_run: bool = False,
    ) -> tuple[JSON, bool]:
        """Delete an object; returns ``(object, deleted_now)``.

        With ``grace_seconds > 0``, or with finalizers present, the object only gets
        ``metadata.deletionTimestamp``/``deletionGracePeriodSeconds`` (MODIFIED) and stays until
        deleted again with grace 0 and no finalizers; a later deletion may only shorten the grace.
        ``preconditions`` (``uid``, ``resourceVersion``) that do not hold answer 409 Conflict.
        """
        with self.lock:
            table = self._table(kind)
            current = table.get(key)
            if current is None:
                raise not_found(kind.resource, key[1])
            md = meta(current)
            for field_name, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                want = (preconditions or {}).get(field_name)
                if want not in (None, "") and str(want) != str(md.get(field_name)):
                    raise conflict(
                        kind.resource,
                        key[1],
                        f"Precondition failed: {label} in precondition: {want}, "
                        f"{label} in object meta: {md.get(field_name)}",
                    )
            finalizers = md.get("finalizers") or []
            if grace_seconds <= 0 and not finalizers:
                if dry_run:
                    return copy.deepcopy(current), True
                return self._remove(kind, key, current), True
            existing_grace = md.get("deletionGracePeriodSeconds")
            if md.get("deletionTimestamp") and existing_grace is not None and existing_grace <= grace_seconds:
                return copy.deepcopy(current), False
            new = copy.deepcopy(current)
            new_md = meta(new)
            grace = max(grace_seconds, 0)
            new_md["deletionTimestamp"] = now_rfc3339(grace)
            new_md["deletionGracePeriodSeconds"] = grace
            if dry_run:
                return new, False
            self._rv += 1
            self._stamp(kind, new, self._rv)
            table[key] = new
            self._record(Change(self._rv, "MODIFIED", kind, key, new, current))
            return copy.deepcopy(new), False

    def remove_now(self, kind: ResourceKind, key: Key) -> JSON | None:
        """Delete at once, ignoring grace and finalizers (DELETED); None when absent."""
        with self.lock:
            current = self._table(kind).get(key)
            if current is None:
                return None
            return self._remove(kind, key, current)

    def compact(self, before_rv: int | None = None) -> int:
        """Forget changes older than ``before_rv`` (default: all); returns the new compaction point.

        Afterwards a watch can start only from a resourceVersion ``>= before_rv - 1``.
        """
        with self.lock:
            target = self._rv + 1 if before_rv is None else before_rv
            while self._history and self._history[0].rv < target:
                self._history.popleft()
            self._compacted = max(self._compacted, min(target, self._rv + 1) - 1)
            return self._compacted

    def backup(self) -> StoreBackup:
        """What an etcd snapshot holds: every object and the resourceVersion now."""
        with self.lock:
            return StoreBackup(self._rv, copy.deepcopy(self._objects))

    def restore(self, backup: StoreBackup) -> None:
        """The server's state as ``backup`` held it, as after an etcd restored from a snapshot: the
        objects and the resourceVersion go back (a client's later resourceVersion is one the server has
        not reached), the history is gone and every watch is dropped (the API server restarted)."""
        with self.lock:
            self._objects = copy.deepcopy(backup.objects)
            self._rv = backup.rv
            self._history.clear()
            self._compacted = backup.rv
        self.close_watches(abrupt=True)

    # ------------------------------------------------------------------ watching

    def watch(
        self,
        kind: ResourceKind,
        *,
        namespace: str | None = None,
        name: str | None = None,
        labels: LabelSelector | None = None,
        fields: FieldSelector | None = None,
        since: int | None = None,
        initial_events: bool = False,
        initial_bookmark: bool = False,
    ) -> Watcher:
        """Open a watch.

        ``since``: deliver every change after this resourceVersion (410 Expired when it is no
        longer retained). ``initial_events``: first an ADDED for every matching object, then the
        changes; ``initial_bookmark`` closes the initial events with a BOOKMARK annotated
        ``k8s.io/initial-events-end``.
        """
        watcher = Watcher(kind, namespace, labels or LabelSelector(), fields or FieldSelector(), name)
        with self.lock:
            if initial_events:
                table = self._table(kind)
                for key in sorted(table):
                    if watcher.matches(table[key]):
                        watcher.queue.put(("ADDED", table[key]))
                if initial_bookmark:
                    watcher.queue.put(("BOOKMARK", bookmark_object(kind, self._rv, initial_events_end=True)))
            elif since is not None:
                if since < self._compacted:
                    raise expired(f"too old resource version: {since} ({self._compacted + 1})")
                for change in self._history:
                    if change.rv > since:
                        watcher.offer(change)
            self._watchers.append(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        """Forget a watcher (its stream ended)."""
        with self.lock:
            watcher.closed = True
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def bookmark(self, watcher: Watcher) -> JSON | None:
        """A BOOKMARK object at the current resourceVersion, when the watcher has nothing queued.

        Taken under the lock, so every change up to that resourceVersion has already been
        written to the stream.
        """
        with self.lock:
            if not watcher.queue.empty():
                return None
            return bookmark_object(watcher.kind, self._rv)

    def close_watches(self, abrupt: bool = False) -> int:
        """End every open watch; returns how many there were."""
        with self.lock:
            watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.close(abrupt)
        return len(watchers)

    def add_listener(self, key: int, listener: Callable[[Change], None]) -> None:
        """Call ``listener(change)`` for every later change, under the lock (it must only queue it)."""
        with self.lock:
            self._listeners[key] = listener

    def remove_listener(self, key: int) -> None:
        """Forget a listener."""
        with self.lock:
            self._listeners.pop(key, None)

    def watcher_count(self) -> int:
        """Open watches."""
        with self.lock:
            return len(self._watchers)

    def iter_objects(self, kind: ResourceKind) -> Iterator[JSON]:
        """Copies of every stored object of ``kind`` in key order."""
        with self.lock:
            items = [copy.deepcopy(self._table(kind)[k]) for k in sorted(self._table(kind))]
        yield from items


def _should_delete_during_update(old: JSON, new: JSON) -> bool:
    new_md, old_md = meta(new), meta(old)
    if new_md.get("finalizers") or not old_md.get("finalizers"):
        return False
    if not new_md.get("deletionTimestamp"):
        return False
    grace = new_md.get("deletionGracePeriodSeconds")
    return grace is None or grace == 0
