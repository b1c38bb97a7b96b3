"""NVML reads of a scrape, /usage and /graph, bounded in time.

An NVML call can block for good (a GPU fallen off the bus, a driver stuck in a reset). A
scrape that waits for it never answers, and every later one joins it: Prometheus sees the
target down and the HTTP threads are used up. Here the reads run in a thread of their own
and are waited for at most :data:`DEADLINE` seconds; past it the caller gets nothing (the
figures NVML gives are left out, as for a lost GPU) while the read goes on in its thread.
Until that read returns, NVML is not asked again: later calls get nothing at once, so a
hung NVML holds one thread, not one per scrape. Reads of one GPU each (:meth:`NVMLReads.per_gpu`)
leave out only the GPU whose read hangs: the others are read again at the next call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
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
        self._stuck_gpus: dict[int, threading.Thread] = {}  # of per_gpu: each GPU whose read hangs

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

    def per_gpu(self, indexes: Sequence[int], read: Callable[[int], T]) -> dict[int, T]:
        """``read(index)`` of each GPU, one after the other in a thread, waited for at most :data:`DEADLINE`
        seconds in all. A GPU whose read did not return in time is left out, and not read again until that
        read returns (the GPUs after it are left out this time only): one hung GPU costs its own figures,
        not the node's. An error of ``read`` is raised."""
        with self._lock:
            for index, thread in list(self._stuck_gpus.items()):
                if not thread.is_alive():
                    del self._stuck_gpus[index]
                    log.info("NVML answers again for GPU %d", index)
            todo = [i for i in indexes if i not in self._stuck_gpus]
        if not todo:
            return {}
        results: dict[int, T] = {}
        error: list[BaseException] = []
        current: list[int] = []
        abandoned = threading.Event()

        def work() -> None:
            try:
                for index in todo:
                    if abandoned.is_set():
                        return
                    current[:] = [index]
                    value = read(index)
                    with self._lock:
                        results[index] = value
                current.clear()
            except BaseException as exc:  # handed to the caller
                error.append(exc)

        thread = threading.Thread(target=work, name="nvml-read", daemon=True)
        thread.start()
        thread.join(DEADLINE)
        with self._lock:
            if thread.is_alive():
                abandoned.set()
                if current:
                    self._stuck_gpus[current[0]] = thread
                    log.warning(
                        "NVML has not answered for GPU %d in %.0f s: its figures are left out until it does",
                        current[0],
                        DEADLINE,
                    )
            got = dict(results)
        if error:
            raise error[0]
        return got


#: The agent's: a hung NVML holds at most one thread, whoever asked.
NVML = NVMLReads()
