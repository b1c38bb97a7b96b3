"""A GPU pod's directories and vcuda.sock, made ready when the pod is bound to the node.

The kubelet admits a pod (Allocate) and starts its containers (PreStartContainer) a moment after
the pod reaches the node, and the agent's pod watch usually sees it first. Creating a directory, a
file or a unix socket is the slowest part of PreStartContainer on some filesystems (a new inode
took 0.3-0.9 ms of kernel time in an ext4 ``/tmp``, 0.02 ms elsewhere on the same disk);
so the pod's directory, one directory per GPU container and the pod's vcuda.sock are made here, in
the background, as soon as the watch shows a pending GPU pod. PreStartContainer then finds them and
only writes the container's vcuda.config. Nothing depends on this having happened: PreStart makes
whatever is missing, and the allocation check removes the directories of pods that ended or were
deleted (see :meth:`gpumanager.allocation.check.AllocationCheck.on_pod_event`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod

log = logging.getLogger(__name__)

#: Pods remembered as prepared ahead (their UIDs), so that each watch event of a pending pod does
#: not queue it again; forgotten when the pod is deleted, or all at once past this many.
REMEMBERED_PODS = 4096

PrepareAhead = Callable[[str, Iterable[str]], None]


def _gpu_container_names(pod: Pod) -> list[str]:
    requests = [*podinfo.init_gpu_requests(pod), *podinfo.gpu_requests(pod)]
    return [r.name for r in requests if r.gpu_required]


class AheadOfStart:
    """Pod watch listener and one worker thread that prepare pending GPU pods ahead of the kubelet."""

    def __init__(self, prepare: PrepareAhead, *, gone: Callable[[str], None] | None = None) -> None:
        """``prepare(uid, containers)`` makes a pod's directories and socket; ``gone(uid)`` removes them
        again when the pod went while they were being made."""
        self._prepare = prepare
        self._gone = gone
        self._queue: queue.SimpleQueue[tuple[str, str, tuple[str, ...]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._seen: set[str] = set()  # queued or prepared
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.prepared = 0  # pods prepared so far (for tests and logs)

    def on_pod_event(self, kind: str, pod: Pod) -> None:
        """Queue a pending GPU pod once (from the watch thread: nothing slow here)."""
        try:
            uid = podinfo.uid(pod)
        except (KeyError, TypeError, ValueError):
            return
        if kind == "DELETED" or podinfo.is_terminated(pod) or podinfo.is_deleting(pod):
            with self._lock:
                self._seen.discard(uid)
            return
        if not uid or podinfo.phase(pod) != "Pending":
            return
        with self._lock:
            if uid in self._seen:
                return
        try:
            names = _gpu_container_names(pod)
        except podinfo.PodSpecError:
            return  # Allocate names the fault when the kubelet admits the pod
        if not names:
            return
        with self._lock:
            if len(self._seen) >= REMEMBERED_PODS:
                self._seen.clear()
            self._seen.add(uid)
        self._queue.put((uid, podinfo.pod_key(pod), tuple(names)))

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="ahead-of-start", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the worker after the pod in hand (queued ones are left to PreStartContainer)."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._stopping.is_set():
                return
            uid, key, containers = item
            with self._lock:
                if uid not in self._seen:  # deleted meanwhile
                    continue
            try:
                self._prepare(uid, containers)
                self.prepared += 1
            except (OSError, ValueError) as exc:
                # PreStartContainer tries again, and reports what still fails to the kubelet.
                log.warning("cannot prepare the directory of pod %s (%s) ahead of its start: %s", key, uid, exc)
            except Exception:
                log.exception("preparing pod %s (%s) ahead of its start failed", key, uid)
            with self._lock:
                went = uid not in self._seen
            if went and self._gone is not None:  # deleted while its directory was being made
                try:
                    self._gone(uid)
                except Exception:
                    log.exception("removing the directory of pod %s (%s), deleted meanwhile, failed", key, uid)
