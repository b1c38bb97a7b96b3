"""Keeps the ``tencent.com/gpu-inventory`` annotation of this node current, from its own thread.

:meth:`InventoryPublisher.changed` only raises a flag, so the health listener that calls it
(and with it the device plugin) never waits for the API server. The thread publishes at start,
after changes (at most once per ``min_interval``), and again every ``resync_period`` (a node
object that was re-created gets its annotation back). Failures are retried with a doubling
delay (1 s to 30 s); each change of state is logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.kube.apierror import failure, unknown_node
from gpumanager.kube.gpu_inventory import ANNOTATION, encode
from gpumanager.kube.rest import MERGE_PATCH, ApiClient, KubeRest

log = logging.getLogger(__name__)

_RETRY_START = 1.0
_RETRY_MAX = 30.0


class InventoryPublisher:
    """Publishes the node's GPUs and their health as one Node annotation. Thread-safe."""

    def __init__(
        self,
        api: ApiClient,
        node: str,
        gpus: Sequence[GPUInfo],
        topology: NodeTopology,
        health: Callable[[], Mapping[int, bool]],
        *,
        share_mode: bool,
        min_interval: float = 1.0,
        resync_period: float = 300.0,
        request_timeout: float = 10.0,
    ) -> None:
        self._rest = KubeRest(api)
        self._node = node
        self._gpus = list(gpus)
        self._topology = topology
        self._health = health
        self._share_mode = share_mode
        self._min_interval = min_interval
        self._resync = resync_period
        self._timeout = request_timeout
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_value = ""
        self._last_error = ""
        self.published = 0
        self.failures = 0

    def value(self) -> str:
        """The annotation value for the current health of the GPUs."""
        return encode(self._gpus, self._topology, self._health(), share_mode=self._share_mode)

    def changed(self) -> None:
        """Ask for a publication soon (returns at once)."""
        self._wake.set()

    def start(self) -> None:
        """Start the publishing thread (it publishes at once)."""
        self._wake.set()
        self._thread = threading.Thread(target=self._run, name="gpu-inventory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (a publication in flight ends with its request timeout)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=self._timeout + 1)

    def _publish(self, value: str) -> None:
        body = {"metadata": {"annotations": {ANNOTATION: value}}}
        self._rest.patch_node(self._node, body, content_type=MERGE_PATCH, timeout=self._timeout)

    def _problem(self, exc: Exception) -> str:
        """What a failed publication says: for a node the API server does not know, which settings name it."""
        if getattr(exc, "status", None) == 404:
            return f"{failure(exc)}: {unknown_node(self._node)}"
        return failure(exc)

    def _report(self, problem: str) -> None:
        if problem == self._last_error:
            return
        if problem:
            log.warning("cannot publish %s on node %s: %s (retrying)", ANNOTATION, self._node, problem)
        elif self._last_error:
            log.info("published %s on node %s again", ANNOTATION, self._node)
        self._last_error = problem

    def _run(self) -> None:
        retry = _RETRY_START
        last_publish = -1e18
        while not self._stop.is_set():
            timeout = max(0.0, last_publish + self._resync - time.monotonic())
            woken = self._wake.wait(timeout)
            if self._stop.is_set():
                return
            # Coalesce bursts of changes: at most one publication per min_interval.
            pause = last_publish + self._min_interval - time.monotonic()
            if pause > 0 and self._stop.wait(pause):
                return
            self._wake.clear()
            value = self.value()
            if woken and value == self._last_value:
                continue
            try:
                self._publish(value)
            except Exception as exc:  # any failure (API answer, connection, timeout): keep the thread alive
                self.failures += 1
                self._report(self._problem(exc))
                self._wake.set()  # still to do
                if self._stop.wait(retry):
                    return
                retry = min(retry * 2, _RETRY_MAX)
                continue
            retry = _RETRY_START
            last_publish = time.monotonic()
            if value != self._last_value:
                unhealthy = [g.index for g in self._gpus if not self._health().get(g.index, True)]
                log.info(
                    "published %s on node %s: %d GPUs, unhealthy: %s",
                    ANNOTATION,
                    self._node,
                    len(self._gpus),
                    unhealthy or "none",
                )
            self._last_value = value
            self.published += 1
            self._report("")
