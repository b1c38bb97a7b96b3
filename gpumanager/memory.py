"""The agent's use of the C allocator.

glibc's malloc gives threads that contend for it arenas of their own, up to eight per core, and
memory freed in one arena is reused only by the threads that land there. The agent's gRPC pools
run dozens of short calls at once (fifty pods admitted together), so after such a burst each
arena holds its own free pages: on the 8 x H100 benchmark the agent kept about 7 MiB more after a
burst than with two arenas, at no measurable cost in speed. The agent therefore caps the arenas at
start, unless the operator set ``MALLOC_ARENA_MAX`` (glibc reads it itself; that setting wins).

Nor does glibc give back what a burst freed in the middle of its heaps: after fifty concurrent
admissions the agent at rest kept about 2 MiB more than it used. :class:`QuietTrim` gives it back
(``malloc_trim``) once the agent has been quiet for a moment after work.

Python's cyclic collector, in a full collection, walks every object it tracks: the ~56,000 that
the start leaves (modules, classes, functions, the loaded state) live for good, yet each full
collection walked them again, tens of milliseconds under load in the middle of some call.
:func:`settle_after_start` takes them out of its walk (``gc.freeze``).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

#: Arenas the agent allows (the main arena and one more).
ARENAS = 2
_M_ARENA_MAX = -8  # mallopt parameter number, from glibc's malloc.h


def limit_malloc_arenas(environ: Mapping[str, str] = os.environ, arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas at ``arenas``; whether it was done (not glibc, or the operator's
    ``MALLOC_ARENA_MAX`` is set: nothing is changed)."""
    if "MALLOC_ARENA_MAX" in environ:
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no arenas to cap)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(_M_ARENA_MAX, arenas) != 1:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
        return False
    return True


def settle_after_start() -> None:
    """Collect what the start left behind, then keep every object alive now out of the collector's
    walk: a full collection then goes through only what came after."""
    gc.collect()
    gc.freeze()


#: Seconds without new work before freed memory is given back.
QUIET_SECONDS = 1.0


def trim() -> bool:
    """Give the free pages of glibc's heaps back to the system; whether any were (False too where
    the C library is not glibc)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim.restype = ctypes.c_int
    return bool(malloc_trim(0))


class QuietTrim:
    """Trims the heaps once, ``quiet`` seconds after the last :meth:`poke` (work was done).

    Its thread sleeps until poked: an agent at rest is not woken by it.
    """

    def __init__(self, *, quiet: float = QUIET_SECONDS, trim: Callable[[], bool] = trim) -> None:
        self._quiet = quiet
        self._trim = trim
        self._poked = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Run in the background."""
        self._thread = threading.Thread(target=self._run, name="memory-trim", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Work was done: trim once it has been quiet for a while."""
        self._poked.set()

    def stop(self) -> None:
        """End the thread (not waited for)."""
        self._stop.set()
        self._poked.set()

    def _run(self) -> None:
        while True:
            self._poked.wait()
            while self._poked.is_set():  # until a whole quiet period passes without a poke
                self._poked.clear()
                if self._stop.wait(self._quiet):
                    return
            try:
                self._trim()
            except Exception:
                log.exception("giving freed memory back failed")
