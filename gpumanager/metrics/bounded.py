"""NVML reads of a scrape, /usage and /graph, bounded in time.

An NVML call can block for good (a GPU fallen off the bus, a driver stuck in a reset). A
scrape that waits for it never answers, and every later one joins it: Prometheus sees the
target down and the HTTP threads are used up. Here the reads run in a thread of their own
and are waited for at most :data:`DEADLINE` seconds; past it the caller gets nothing (the
figures NVML gives are left out, as for a lost GPU) while the read goes on in its thread.
Until that read returns, NVML is not asked again: later calls get nothing at once, so a
hung NVML holds one thread, not one per scrape.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a scrape waits for NVML (Prometheus' default scrape timeout is 10 s).
DEADLINE = 4.0


class NVMLReads:
    """Runs NVML reads in a thread, waiting for each at most :data:`DEADLINE` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stuck: threading.Thread | None = None

    def run(self, read: Callable[[], T]) -> T | None:
        """``read()``, or None when it did not return in time or an earlier read still has not."""
        with self._lock:
            if self._stuck is not None:
                if self._stuck.is_alive():
                    return None
                self._stuck = None
                log.info("NVML answers again")
        result: list[T] = []
        error: list[BaseException] = []

        def work() -> None:
            try:
                result.append(read())
            except BaseException as exc:  # handed to the caller
                error.append(exc)

        thread = threading.Thread(target=work, name="nvml-read", daemon=True)
        thread.start()
        thread.join(DEADLINE)
        if thread.is_alive():
            with self._lock:
                if self._stuck is None:
                    log.warning("NVML has not answered for %.0f s: its figures are left out until it does", DEADLINE)
                self._stuck = thread
            return None
        if error:
            raise error[0]
        return result[0]


#: The agent's: a hung NVML holds at most one thread, whoever asked.
NVML = NVMLReads()
