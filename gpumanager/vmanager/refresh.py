"""Keeps every shared container's ``pids.config`` current (the library matches NVML's host PIDs)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager.manager import VirtualManager

log = logging.getLogger(__name__)

#: How often shared containers' pids.config files are brought up to date.
PERIOD_SECONDS = 1.0


class PidsRefresher:
    """A loop that rewrites pids.config files whose processes changed."""

    def __init__(
        self,
        vmanager: VirtualManager,
        allocations: Callable[[], Sequence[ContainerAllocation]],
        *,
        period: float = PERIOD_SECONDS,
    ) -> None:
        self._vmanager = vmanager
        self._allocations = allocations
        self._period = period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run in the background."""
        self._thread = threading.Thread(target=self._run, name="pids-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop."""
        self._stop.set()

    def alive(self) -> bool:
        """Whether the loop runs."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            allocations = self._allocations()
            if not any(a.shared for a in allocations):
                continue
            try:
                self._vmanager.refresh_pids(allocations)
            except Exception:
                log.exception("pids.config refresh failed; trying again")
