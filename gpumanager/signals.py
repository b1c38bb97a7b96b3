"""The signals the agent obeys, received without a polling loop.

The main thread sleeps in a read of a pipe that the interpreter writes each signal's number into
(``signal.set_wakeup_fd``): it wakes when a signal comes, and when another thread asks it to
(:meth:`SignalPipe.wake`: the agent's start, which runs beside it, has ended).
"""

from __future__ import annotations

import os
import select
import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any

#: The signals that stop the agent; SIGHUP asks for a re-check.
STOP = (signal.SIGTERM, signal.SIGINT)
RECHECK = signal.SIGHUP
#: The byte :meth:`SignalPipe.wake` writes: no signal has number 0.
_WAKE = 0


def _received(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler: the number is in the pipe already; this one only keeps the
    default action (ending the process) from happening."""


class SignalPipe:
    """Receives ``signals`` (default: the stop signals and SIGHUP) in the main thread, in order."""

    def __init__(self, signals: Iterable[signal.Signals] = (*STOP, RECHECK)) -> None:
        self._signals = tuple(signals)
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # required by set_wakeup_fd: a full pipe drops, never blocks
        self._previous: dict[signal.Signals, Any] = {}
        self._previous_fd = -1
        self._pending: list[int] = []
        self._woken = False

    def install(self) -> SignalPipe:
        """Take over the signals (call from the main thread)."""
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, _received)
        return self

    def next(self) -> signal.Signals:
        """The next signal received; sleeps until one comes."""
        while not self._pending:
            self._read_some()
        return signal.Signals(self._pending.pop(0))

    def wait(self) -> signal.Signals | None:
        """The next signal received, or None once :meth:`wake` was called (signals first); sleeps until then."""
        while not self._pending and not self._woken:
            self._read_some()
        if self._pending:
            return signal.Signals(self._pending.pop(0))
        self._woken = False
        return None

    def wake(self) -> None:
        """End a :meth:`wait` in progress or the next one (from any thread)."""
        try:
            os.write(self._write, bytes([_WAKE]))
        except BlockingIOError:
            pass  # the pipe is full: the main thread wakes anyway

    def poll(self, timeout: float) -> signal.Signals | None:
        """The next signal received within ``timeout`` seconds, else None."""
        if not self._pending and select.select([self._read], [], [], max(0.0, timeout))[0]:
            self._read_some()
        return signal.Signals(self._pending.pop(0)) if self._pending else None

    def _read_some(self) -> None:
        data = os.read(self._read, 64)
        self._pending.extend(b for b in data if b in self._signals)
        self._woken = self._woken or _WAKE in data

    def close(self) -> None:
        """Give the signals back to their earlier handlers."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._read)
        os.close(self._write)
