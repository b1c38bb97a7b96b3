"""One call at a time, its answer shared by every caller that waited for it.

When many threads need the same fresh answer at once (fifty PreStartContainer
calls each asking the kubelet which pod holds their device IDs), one call is
made and the others wait for it. A caller uses only an answer to a call that
started after it asked, so it never sees data older than its own question: a
caller that arrives while a call is running waits for that one to end and then
for the next, which it shares with everyone else who arrived meanwhile.

A caller that knows its data appeared after some moment (``since``) may also
take the answer of a call that started at or after it, the newest finished one
or the one running, when that answer holds what it looks for (``accept``);
otherwise it waits for a call that started after it asked, as above.
"""

from __future__ import annotations

import threading
import time
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
        self._value_since = 0.0  # when the call whose answer is kept started (time.monotonic())
        self._running_since = 0.0  # when the running call started
        #: Callers waiting for an answer now (for tests and metrics).
        self.waiting = 0
        #: Calls made so far.
        self.calls = 0

    def __call__(self, *, since: float | None = None, accept: Callable[[T], bool] | None = None) -> T:
        """The answer of a call that started after this one was made.

        With ``since`` (a ``time.monotonic()`` moment) and ``accept``: first the answer of the running
        call, if it started at or after ``since`` (waiting for it), or else of the newest finished call
        that did; taken when ``accept`` (called without the lock) says it holds what the caller looks
        for. An answer that started before ``since``, failed, or is not accepted is passed over.
        """
        with self._cond:
            entry = self._started
            need = entry + 1  # the first call that starts from now on
            self.waiting += 1
            try:
                if since is not None and accept is not None:
                    if self._running and self._running_since >= since:
                        while self._finished < entry:  # the running call is number ``entry``
                            self._cond.wait()
                    if self._finished and self._error is None and self._value_since >= since:
                        value = self._value
                        self._cond.release()
                        try:
                            taken = accept(value)  # type: ignore[arg-type]
                        finally:
                            self._cond.acquire()
                        if taken:
                            return value  # type: ignore[return-value]
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
        began = self._running_since = time.monotonic()
        value: T | None = None
        error: BaseException | None = None
        self._cond.release()
        try:
            value = self._fn()
        except BaseException as exc:  # handed to every waiter, then raised here too
            error = exc
        finally:
            self._cond.acquire()
        self._value, self._error, self._value_since = value, error, began
        self._finished = mine
        self._running = False
        self._cond.notify_all()
        return self._answer()

    def _answer(self) -> T:
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
