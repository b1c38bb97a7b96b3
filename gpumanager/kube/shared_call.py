"""One call at a time, its answer shared by every caller that waited for it.

When many threads need the same fresh answer at once (fifty PreStartContainer
calls each asking the kubelet which pod holds their device IDs), one call is
made and the others wait for it. A caller uses only an answer to a call that
started after it asked, so it never sees data older than its own question: a
caller that arrives while a call is running waits for that one to end and then
for the next, which it shares with everyone else who arrived meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedCall(Generic[T]):
    """Calls ``fn`` for one caller at a time; concurrent callers share the next call's answer (or exception)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._cond = threading.Condition()
        self._started = 0  # calls started so far
        self._finished = 0  # the newest call that finished
        self._running = False
        self._value: T | None = None
        self._error: BaseException | None = None
        #: Callers waiting for an answer now (for tests and metrics).
        self.waiting = 0
        #: Calls made so far.
        self.calls = 0

    def __call__(self) -> T:
        """The answer of a call that started after this one was made."""
        with self._cond:
            need = self._started + 1  # the first call that starts from now on
            self.waiting += 1
            try:
                while self._finished < need:
                    if not self._running:
                        return self._lead()
                    self._cond.wait()
                return self._answer()
            finally:
                self.waiting -= 1

    def _lead(self) -> T:
        """Make the call (lock held on entry and on return, released while calling)."""
        self._running = True
        self._started += 1
        self.calls += 1
        mine = self._started
        value: T | None = None
        error: BaseException | None = None
        self._cond.release()
        try:
            value = self._fn()
        except BaseException as exc:  # handed to every waiter, then raised here too
            error = exc
        finally:
            self._cond.acquire()
        self._value, self._error = value, error
        self._finished = mine
        self._running = False
        self._cond.notify_all()
        return self._answer()

    def _answer(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
