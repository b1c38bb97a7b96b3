"""Whether a thread sleeps: the kernel's count of its voluntary context switches.

A thread blocked without a timeout makes no voluntary context switch; a loop that polls makes one
per period. Load on the machine does not add to the count (``/proc/<pid>/task/<tid>/status``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

#: Long enough for a loop with a half-second period to wake three times.
IDLE_SECONDS = 1.5
#: What a thread that sleeps may still show (a wake-up in flight when counting starts).
ASLEEP = 1


def voluntary_switches(thread: threading.Thread | int, pid: int | str = "self") -> int:
    """Voluntary context switches of ``thread`` (or the thread of that ID in process ``pid``) so far."""
    tid = thread if isinstance(thread, int) else thread.native_id
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise RuntimeError("voluntary_ctxt_switches missing")


def idle_switches(thread: threading.Thread, seconds: float = IDLE_SECONDS) -> int:
    """Voluntary context switches of ``thread`` while left alone for ``seconds``."""
    time.sleep(0.2)  # what started it settles
    before = voluntary_switches(thread)
    time.sleep(seconds)
    return voluntary_switches(thread) - before


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 15.0) -> None:
    """Wait for ``predicate`` to hold."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.02)


def named_thread(name: str) -> threading.Thread:
    """The running thread called ``name``."""
    found = [t for t in threading.enumerate() if t.name == name]
    assert len(found) == 1, [t.name for t in threading.enumerate()]
    return found[0]
