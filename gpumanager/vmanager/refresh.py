"""Keeps every shared container's ``pids.config`` current (the library matches NVML's host PIDs)."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager.manager import VirtualManager

log = logging.getLogger(__name__)

#: How often shared containers' pids.config files are brought up to date.
PERIOD_SECONDS = 1.0


class _RefreshLoop(ABC):
    """A thread that calls :meth:`_refresh` every ``period`` seconds until stopped; a failure is logged.

    While :meth:`_refresh` finds nothing to keep current the thread sleeps until :meth:`wake`; while it
    does, a wake changes nothing (the next period's refresh comes anyway): a burst of PreStartContainer
    calls must not become a refresh of every container after each one.
    """

    thread_name = "pids-refresh"
    what = "pids.config refresh"

    def __init__(self, *, period: float = PERIOD_SECONDS) -> None:
        self._period = period
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run in the background."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the loop."""
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        """Something to keep current may have come: refresh now, then every period while it lasts."""
        self._wake.set()

    def alive(self) -> bool:
        """Whether the loop runs."""
        return self._thread is not None and self._thread.is_alive()

    @abstractmethod
    def _refresh(self) -> bool:
        """Bring the files up to date once; whether there is anything to keep current."""

    def _run(self) -> None:
        busy = True
        while True:
            if busy:
                self._stop.wait(self._period)
            else:
                # A wake that came during the last refresh is still set: none is lost.
                self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                busy = self._refresh()
            except Exception:
                log.exception("%s failed; trying again", self.what)
                busy = True


class PidsRefresher(_RefreshLoop):
    """A loop that rewrites pids.config files whose processes changed (device-plugin allocations).

    It runs every period while some container shares a GPU or a registration's directory is kept;
    without either it sleeps until the next container is prepared (PreStartContainer) or registers.
    """

    def __init__(
        self,
        vmanager: VirtualManager,
        allocations: Callable[[], Sequence[ContainerAllocation]],
        *,
        period: float = PERIOD_SECONDS,
    ) -> None:
        super().__init__(period=period)
        self._vmanager = vmanager
        self._allocations = allocations
        vmanager.add_prepare_listener(self.wake)

    def _refresh(self) -> bool:
        allocations = self._allocations()
        if any(a.shared for a in allocations):
            self._vmanager.refresh_pids(allocations)
            return True
        if not self._vmanager.has_registered_ids():
            return False
        # Nothing to keep current, but registrations' directories (whole GPUs' too) go once their
        # container has ended: a crash-looping container registers a new one at each start.
        self._vmanager.refresh_pids(allocations)
        return self._vmanager.has_registered_ids()


class ClaimPidsRefresher(_RefreshLoop):
    """pids.config of prepared claims (DRA mode), refreshed like the device-plugin side's."""

    thread_name = "dra-pids-refresh"
    what = "pids.config refresh of claims"

    def __init__(self, refresh: Callable[[], object], *, period: float = PERIOD_SECONDS) -> None:
        super().__init__(period=period)
        self._refresh_claims = refresh

    def _refresh(self) -> bool:
        self._refresh_claims()
        return True
