"""Pod annotation patches, off the critical path: a queue and one worker that retries.

Patches are strategic-merge patches of ``metadata.annotations``. A pod that is
gone (404) is dropped; refusals are retried with the agent's jittered backoff
(:mod:`gpumanager.retry`) up to ``max_attempts``, while failures that say nothing
of the pod (a 5xx, a 429, a 401 while the token is renewed, a connection error
or a timeout) are retried until the API server answers: an outage longer than the
attempts' backoff (a control-plane upgrade) no longer loses the annotations.
Several patches queued for one pod are merged, later values winning.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gpumanager.kube.apierror import failure
from gpumanager.kube.rest import STRATEGIC_MERGE_PATCH, ApiClient, ApiException, KubeRest
from gpumanager.retry import Backoff

log = logging.getLogger(__name__)

#: Statuses under 500 that say nothing of the patch: too many requests, and a token expired (renewed
#: from its file within a minute).
_TRANSIENT = frozenset({401, 429})


@dataclass
class _Pending:
    namespace: str
    name: str
    annotations: dict[str, str]
    attempts: int = 0
    """Failed attempts that count toward giving up (refusals of the patch itself)."""
    failure: str = ""
    """The last failure, warned of once (each new one is warned of again)."""
    not_before: float = 0.0
    done: list[threading.Event] = field(default_factory=list)
    backoff: Backoff = field(default_factory=Backoff)


class AnnotationPatcher:
    """Applies annotation patches in the background. Thread-safe."""

    def __init__(self, api: ApiClient, *, max_attempts: int = 10, request_timeout: float = 10.0) -> None:
        self._rest = KubeRest(api)
        self._max = max_attempts
        self._timeout = request_timeout
        self._cond = threading.Condition()
        self._queue: OrderedDict[str, _Pending] = OrderedDict()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.applied = 0
        self.failed = 0

    def submit(self, namespace: str, name: str, uid: str, annotations: dict[str, str]) -> threading.Event:
        """Queue a patch; the returned event is set when it is applied or given up."""
        event = threading.Event()
        with self._cond:
            pending = self._queue.get(uid)
            if pending is None:
                pending = self._queue[uid] = _Pending(namespace, name, {})
            pending.annotations.update(annotations)
            pending.done.append(event)
            self._cond.notify()
        return event

    def start(self) -> None:
        """Start the worker."""
        self._thread = threading.Thread(target=self._run, name="annotation-patcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Stop the worker (pending patches are dropped; a patch in flight is not waited for long)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def alive(self) -> bool:
        """Whether the worker runs."""
        return self._thread is not None and self._thread.is_alive()

    def _next(self) -> tuple[str, _Pending] | None:
        with self._cond:
            while not self._stop:
                now = time.monotonic()
                ready = [(uid, p) for uid, p in self._queue.items() if p.not_before <= now]
                if ready:
                    uid, pending = ready[0]
                    del self._queue[uid]
                    return uid, pending
                wait = min((p.not_before for p in self._queue.values()), default=now + 60) - now
                self._cond.wait(timeout=max(0.01, wait))
        return None

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            uid, pending = item
            outcome = self._apply(uid, pending)
            if outcome is True:
                for event in pending.done:
                    event.set()
                continue
            if outcome is False:
                pending.attempts += 1
            if pending.attempts >= self._max:
                self.failed += 1
                log.error(
                    "giving up annotating pod %s/%s after %d refusals (the last: %s)",
                    pending.namespace,
                    pending.name,
                    pending.attempts,
                    pending.failure,
                )
                for event in pending.done:
                    event.set()
                continue
            pending.not_before = time.monotonic() + pending.backoff.next_delay()
            with self._cond:
                newer = self._queue.get(uid)
                if newer is not None:  # merge: values queued later win
                    pending.annotations.update(newer.annotations)
                    pending.done.extend(newer.done)
                self._queue[uid] = pending

    def _failed(self, p: _Pending, message: str) -> None:
        """Warn of a failed attempt once per kind of failure (a long outage would warn every 30 s a pod)."""
        if message != p.failure:
            log.warning("annotating pod %s/%s: %s (will retry)", p.namespace, p.name, message)
            p.failure = message
        else:
            log.debug("annotating pod %s/%s: %s (will retry)", p.namespace, p.name, message)

    def _apply(self, uid: str, p: _Pending) -> bool | None:
        """True: applied (or not needed); False: refused (counts toward giving up); None: the API server
        did not answer for the pod (an outage, an overload, a token being renewed): retried until it does."""
        # The UID makes the patch apply to this pod only, never to a namesake created since (a
        # StatefulSet's pod created again): the API server refuses a patch that would change it.
        body = {"metadata": {"uid": uid, "annotations": p.annotations} if uid else {"annotations": p.annotations}}
        try:
            self._rest.patch_pod(p.namespace, p.name, body, content_type=STRATEGIC_MERGE_PATCH, timeout=self._timeout)
        except ApiException as exc:
            if exc.status == 404:
                log.info("pod %s/%s is gone; annotations not needed", p.namespace, p.name)
                return True
            if uid and exc.status in (409, 422):
                log.info(
                    "pod %s/%s is no longer pod %s (%s %s); annotations not needed",
                    p.namespace,
                    p.name,
                    uid,
                    exc.status,
                    exc.reason,
                )
                return True
            self._failed(p, failure(exc))
            return None if exc.status in _TRANSIENT or exc.status >= 500 else False
        except Exception as exc:
            self._failed(p, failure(exc))
            return None
        self.applied += 1
        log.info("annotated pod %s/%s: %s", p.namespace, p.name, p.annotations)
        return True
