"""gpu-manager's periodic allocation check, and releases as pods end.

Every ``--allocation-check-period`` (and as soon as the pod cache is first
complete, so pods that ended while the agent was down are freed at once): pods
that are gone are freed, pods whose admission or PreStart failed are freed (and
deleted when a controller owns them), directories of pods that are gone are
removed, and running pods whose annotations are missing or stale are annotated
again. Pod events free a pod's GPUs the moment it ends.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.allocator import Allocator, PodSource
from gpumanager.allocation.pods import Pod, PodSpecError

log = logging.getLogger(__name__)

Annotate = Callable[[str], None]
DeletePod = Callable[[Pod], None]
#: Whether the kubelet shows pod ``uid``'s containers stopped (its cgroup is gone).
Stopped = Callable[[str], bool]
#: How often pods removed while their containers ran are looked at until their containers are stopped.
STOPPING_POLL_SECONDS = 0.5
#: Removes the pod directories not in ``active`` (the first argument); with ``only``, looks at
#: those directories alone.
CollectDirs = Callable[..., object]


class AllocationCheck:
    """The periodic check and the pod-event listener, over the allocator."""

    def __init__(
        self,
        allocator: Allocator,
        pods: PodSource,
        *,
        period: float,
        annotate: Annotate,
        delete_failed: DeletePod,
        collect_dirs: CollectDirs,
        wait_synced: Callable[[float], bool],
        stopped: Stopped | None = None,
    ) -> None:
        self._allocator = allocator
        self._pods = pods
        self._period = period
        self._annotate = annotate
        self._delete_failed = delete_failed
        self._collect_dirs = collect_dirs
        self._wait_synced = wait_synced
        self._stopped = stopped
        self._stopping_thread: threading.Thread | None = None
        self._stopping_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._also: list[Callable[[], object]] = []  # run after each check, in this loop (:meth:`also`)
        # Per pod UID, its containers reported as waiting for devices the kubelet lost the record of.
        self._told_lost: dict[str, set[str]] = {}

    def also(self, task: Callable[[], object]) -> None:
        """Run ``task`` after each periodic check, in the check's thread (an error is logged; the next period
        runs it again). Added before :meth:`start`."""
        self._also.append(task)

    def start(self) -> None:
        """Run the loop in the background."""
        thread = threading.Thread(target=self._run, name="allocation-check", daemon=True)
        thread.start()
        self._thread = thread  # started() only once it runs: /healthz may look at any moment

    def stop(self) -> None:
        """End the loop (not waited for: it only ever waits on its own events)."""
        self._stop.set()
        self._wake.set()

    def alive(self) -> bool:
        """Whether the loop runs."""
        return self._thread is not None and self._thread.is_alive()

    def started(self) -> bool:
        """Whether the loop was started (it may have ended since)."""
        return self._thread is not None

    def wake(self) -> None:
        """Check now instead of at the end of the period."""
        self._wake.set()

    def on_pod_event(self, kind: str, pod: Pod) -> None:
        """Pod watch listener: a pod that is deleted or has ended gives its GPUs back at once."""
        if not (kind == "DELETED" or podinfo.is_terminated(pod)):
            self._tell_lost_records(pod)
            return
        if self._told_lost:
            self._told_lost.pop(podinfo.uid(pod), None)
        if kind == "DELETED" and self._allocator.keep_deleted_mirror(pod):
            return  # a static pod's mirror pod: the static pod runs on
        uid = podinfo.uid(pod)
        if kind == "DELETED" and self._held_while_stopping(pod, uid):
            return
        freed = self._allocator.release_pod(uid) + self._allocator.release_static_pod(pod)
        if not freed and not _asks_for_gpus(pod):
            return  # no directory was ever made for it
        if self._pods.synced():
            # Only the directories this pod's allocations used can have become unused, and its own
            # (made ahead of its start even when it never got a GPU): the others wait for the periodic
            # check (listing every pod's directory on each deletion cost milliseconds a pod when many
            # ended at once).
            only = {uid} | {a.answered[0] for a in freed}
            self._collect_dirs(self.active_pod_dirs(among=only), only=only)

    def _tell_lost_records(self, pod: Pod) -> None:
        """Log once per container that the kubelet cannot start it again: it has no record of its devices
        (its checkpoint was removed or damaged before it restarted) and fails each start before asking the
        agent, which keeps its GPUs held for it until the pod is deleted."""
        try:
            lost = podinfo.without_device_records(pod)
        except Exception:  # an odd pod object: nothing to tell
            return
        if not lost:
            return
        uid = podinfo.uid(pod)
        told = self._told_lost.setdefault(uid, set())
        for container, message in lost:
            if container in told:
                continue
            told.add(container)
            alloc = self._allocator.get(uid, container)
            held = f"its GPUs {list(alloc.minors)} stay held for it" if alloc is not None else "it holds no GPUs here"
            log.error(
                "pod %s container %s cannot start again: the kubelet has no record of its devices (its "
                "kubelet_internal_checkpoint was removed or damaged before it restarted) and fails each start "
                "before asking this agent (%s); %s until the pod is deleted: delete the pod to have it made again",
                podinfo.pod_key(pod),
                container,
                message[:300],
                held,
            )

    def _held_while_stopping(self, pod: Pod, uid: str) -> bool:
        """A pod removed while its status names a container not stopped (or none: the status lags the start)
        was deleted at once (grace 0), and the kubelet stops its containers only now: its GPUs stay held
        until its cgroup is gone. The graceful path never gets here: the kubelet removes the pod only after
        writing its containers' terminated statuses."""
        stopped = self._stopped
        if stopped is None or podinfo.is_terminated(pod) or stopped(uid):
            return False
        if not self._allocator.hold_while_stopping(pod):
            return False
        with self._stopping_lock:
            if self._stopping_thread is None or not self._stopping_thread.is_alive():
                thread = threading.Thread(target=self._watch_stopping, args=(stopped,), name="pod-stops", daemon=True)
                thread.start()
                self._stopping_thread = thread
        return True

    def _watch_stopping(self, stopped: Stopped) -> None:
        """Free the held pods as their containers are seen stopped; ends when none is held."""
        while not self._stop.is_set():
            try:
                freed = self._allocator.release_stopped(stopped)
                if freed and self._pods.synced():
                    only = {a.pod_uid for a in freed} | {a.answered[0] for a in freed}
                    self._collect_dirs(self.active_pod_dirs(among=only), only=only)
            except Exception:
                log.exception("freeing the GPUs of pods removed while their containers ran failed; trying again")
            with self._stopping_lock:
                if not self._allocator.stopping():
                    self._stopping_thread = None
                    return
            self._stop.wait(STOPPING_POLL_SECONDS)

    def collect_pod(self, uid: str) -> None:
        """Remove the directory of pod ``uid`` unless it may still run or an allocation uses it (a pod
        whose directory was made ahead of its start, and that went meanwhile)."""
        if self._pods.synced():
            self._collect_dirs(self.active_pod_dirs(among={uid}), only={uid})

    def active_pod_dirs(self, among: set[str] | None = None) -> set[str]:
        """Pod directories to keep: those of allocations, and of every pod that may still run.

        ``among``: only these pods are asked about (each looked up in the pod cache, instead of a pass
        over every pod it holds).
        """
        allocs = self._allocator.allocations()
        held = {a.pod_uid for a in allocs} | {a.answered[0] for a in allocs}
        if among is not None:
            return (held & among) | {u for u in among if self._may_run(self._pods.get(u))}
        return held | {podinfo.uid(p) for p in self._pods.pods() if self._may_run(p)}

    @staticmethod
    def _may_run(pod: Pod | None) -> bool:
        return pod is not None and not podinfo.is_terminated(pod)

    def check(self) -> None:
        """One check: free what is gone or failed, remove stale directories, re-annotate running pods."""
        gone = self._allocator.recycle()
        self._clean_failed_pods()
        if self._allocator.checkpoint_error or not self._allocator.checkpoint_looks_writable():
            # Written again when it failed (it may be writable again) or looks unwritable (the write
            # says why, and new allocations are refused until it works). A healthy one is only looked
            # at: writing the whole state and a new segment (1 MiB, flushed) every period wore the disk.
            self._allocator.probe_checkpoint()
        if self._pods.synced():
            self._collect_dirs(self.active_pod_dirs())
        for uid in sorted({a.pod_uid for a in self._allocator.allocations()}):
            pod = self._pods.get(uid)
            if pod is not None and podinfo.phase(pod) == "Running":
                self._annotate(uid)
        if gone:
            log.info("periodic check released %d pods that are gone", len(gone))

    def _clean_failed_pods(self) -> None:
        for pod in self._pods.pods():
            if podinfo.phase(pod) not in ("Failed", "Pending") or not podinfo.should_delete(pod):
                continue
            if not podinfo.is_gpu_pod(pod):
                continue
            self._allocator.release_pod(podinfo.uid(pod))
            if not podinfo.is_deleting(pod):  # else its deletion is under way: the kubelet finishes it
                self._delete_failed(pod)

    def _run(self) -> None:
        # First check as soon as the pod cache is complete: pods that ended while we were down are freed now.
        first = self._wait_synced(self._period)
        while not self._stop.is_set():
            if first:
                try:
                    self.check()
                except Exception:
                    log.exception("allocation check failed; trying again next period")
                for task in self._also:
                    try:
                        task()
                    except Exception:
                        name = getattr(task, "__name__", task)
                        log.exception("periodic check %s failed; trying again next period", name)
            first = True
            self._wake.wait(self._period)
            self._wake.clear()


def _asks_for_gpus(pod: Pod) -> bool:
    """Whether some container of the pod, an init container too, asks for vcuda-core."""
    if podinfo.is_gpu_pod(pod):
        return True
    try:
        return any(r.gpu_required for r in podinfo.init_gpu_requests(pod))
    except PodSpecError:
        return False
