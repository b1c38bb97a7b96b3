"""The kubelet's part of a pod's deletion, for the single-node harnesses.

A real API server deletes a pod bound to a node gracefully: the DELETE only sets
``metadata.deletionTimestamp``. The node's kubelet, watching its pods, then stops the containers
(here they exit at once), stops counting the pod as active (its device IDs are free for the next
pod), writes the pod's last status (the containers terminated, a terminal phase: ``Succeeded`` when
they had run, ``Failed`` when none had started, as kubelets do since 1.27) and deletes it for good with
a DELETE of grace 0. The status write and the final DELETE reach the API server ``lag`` seconds after
the containers stopped (the kubelet notices their exit at its next relist, and its status manager
writes after that); 0 writes them at once.

A pod removed from the API server at once (a forced deletion) has its containers stopped too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

JSON = dict[str, Any]
TERMINAL_PHASES = ("Succeeded", "Failed")
RETRY_SECONDS = 1.0
MAX_TRIES = 30


class PodApi(Protocol):
    """What the kubelet's part needs of the API server (its simulator, in process or not)."""

    def pod_events(self) -> queue.Queue[tuple[str, JSON]]: ...

    def close_pod_events(self, events: queue.Queue[tuple[str, JSON]]) -> None: ...

    def get_pod(self, namespace: str, name: str) -> JSON | None: ...

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> Any: ...

    def finish_deletion(self, namespace: str, name: str, uid: str | None = None) -> Any: ...


def terminated_statuses(statuses: Sequence[Mapping[str, Any]]) -> list[JSON]:
    """Container statuses after a stop: running containers terminated (exit 0), the others as they were."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = []
    for cs in statuses:
        state = cs.get("state") or {}
        if "running" in state:
            started = (state.get("running") or {}).get("startedAt", now)
            ended = {"exitCode": 0, "reason": "Completed", "startedAt": started, "finishedAt": now}
            out.append({**cs, "ready": False, "state": {"terminated": ended}})
        else:
            out.append(dict(cs))
    return out


class PodTerminator:
    """Plays the kubelet's part of the deletion of the pods bound to ``node`` (see the module docstring).

    ``stop_pod(uid)``: stop the pod's containers and free its devices (called once per pod, from the
    event thread or from :meth:`handle`). ``known_statuses(uid)``: the container statuses the kubelet
    knows for the pod (running ones, even if their status update has not reached the API server
    yet), empty when none started.
    """

    def __init__(
        self,
        api: PodApi,
        node: str,
        *,
        stop_pod: Callable[[str], None],
        known_statuses: Callable[[str], Sequence[Mapping[str, Any]]],
        lag: float,
    ) -> None:
        self._api = api
        self._node = node
        self._stop_pod = stop_pod
        self._known_statuses = known_statuses
        self.lag = lag
        self._lock = threading.Lock()
        self._stopped: set[str] = set()
        self._timers: list[threading.Timer] = []
        self._events: queue.Queue[tuple[str, JSON]] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        """Follow the API server's pod changes in a background thread."""
        self._events = events = self._api.pod_events()
        self._thread = threading.Thread(
            target=self._run, args=(events,), name=f"kubelet-{self._node}-pods", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop following and drop the writes not made yet."""
        events, self._events = self._events, None
        if events is not None:
            self._api.close_pod_events(events)
            events.put(("STOP", {}))
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()

    def stopped(self, uid: str) -> bool:
        """Whether the pod's containers were stopped (it is being deleted, or is gone)."""
        with self._lock:
            return uid in self._stopped

    def pending(self) -> int:
        """Status writes and final DELETEs not made yet."""
        with self._lock:
            return sum(1 for t in self._timers if t.is_alive())

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every pending write was made; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _run(self, events: queue.Queue[tuple[str, JSON]]) -> None:
        while True:
            kind, pod = events.get()
            if kind == "STOP":
                return
            try:
                self.handle(kind, pod)
            except Exception:
                log.exception("node %s: handling a change of pod %s failed", self._node, pod.get("metadata"))

    def handle(self, kind: str, pod: Mapping[str, Any]) -> None:
        """React to one change of a pod: a deletion requested (or done at once) stops its containers."""
        if (pod.get("spec") or {}).get("nodeName") != self._node:
            return
        md = pod.get("metadata") or {}
        uid = str(md.get("uid", ""))
        if kind != "DELETED" and not md.get("deletionTimestamp"):
            return
        with self._lock:
            if uid in self._stopped:
                return
            self._stopped.add(uid)
        self._stop_pod(uid)
        if kind == "DELETED":
            return
        namespace, name = str(md.get("namespace", "default")), str(md.get("name", ""))
        self._later(namespace, name, uid, 0)

    def _later(self, namespace: str, name: str, uid: str, tries: int) -> None:
        if self.lag <= 0 and not tries:
            self._finish(namespace, name, uid, tries)
            return
        timer = threading.Timer(
            max(self.lag, RETRY_SECONDS if tries else 0), self._finish, (namespace, name, uid, tries)
        )
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers = [t for t in self._timers if t.is_alive()] + [timer]
        timer.start()

    def _finish(self, namespace: str, name: str, uid: str, tries: int) -> None:
        """The last status, then the DELETE with grace 0 (of that very pod); retried while the API
        server fails, as the kubelet's status manager does."""
        try:
            current = self._api.get_pod(namespace, name)
            if current is None or (current.get("metadata") or {}).get("uid") != uid:
                return
            status = current.get("status") or {}
            if status.get("phase") not in TERMINAL_PHASES:
                known = list(self._known_statuses(uid))
                statuses = terminated_statuses(known or status.get("containerStatuses") or [])
                phase = "Succeeded" if known else "Failed"
                self._api.set_pod_phase(namespace, name, phase, containerStatuses=statuses)
            self._api.finish_deletion(namespace, name, uid)
        except Exception as exc:
            if tries >= MAX_TRIES:
                log.warning("node %s: deletion of pod %s/%s not finished: %s", self._node, namespace, name, exc)
                return
            log.info("node %s: deletion of pod %s/%s failed, retrying: %s", self._node, namespace, name, exc)
            self._later(namespace, name, uid, tries + 1)
