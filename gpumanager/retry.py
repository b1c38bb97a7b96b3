"""The one retry delay of the agent: exponential backoff with jitter, as patient as client-go.

Every loop that retries something outside the process (the pod list and watch, kubelet
registration, pod annotations, node labels) waits with :class:`Backoff`: 0.8 s, then
doubling up to a cap (30 s by default), each delay stretched by a random 0-100 % as
client-go's ``wait.Jitter(d, 1.0)`` does, so the agents of many nodes do not retry in
lock step after an outage. The exponential sequence comes from the ``backoff`` library.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Generator
from typing import Any

import backoff

#: client-go's reflector: 800 ms initial, doubling, capped at 30 s.
INITIAL = 0.8
CAP = 30.0


class Backoff:
    """Delays for consecutive failures; :meth:`reset` after a success starts again at ``initial``."""

    def __init__(
        self,
        initial: float = INITIAL,
        cap: float = CAP,
        *,
        jitter: float = 1.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.initial = initial
        self.cap = cap
        self._jitter = jitter
        self._rand = rand
        self._gen = self._sequence()
        self.failures = 0

    def _sequence(self) -> Generator[float, Any, None]:
        gen = backoff.expo(base=2, factor=self.initial, max_value=self.cap)
        next(gen)  # prime the generator (the library's protocol)
        return gen

    def next_delay(self) -> float:
        """The delay before the next attempt (grows with each call until :meth:`reset`)."""
        self.failures += 1
        base = float(next(self._gen))
        return base * (1.0 + self._jitter * self._rand())

    def reset(self) -> None:
        """A success: the next failure waits ``initial`` again."""
        self._gen = self._sequence()
        self.failures = 0

    def wait(self, stop: threading.Event) -> bool:
        """Sleep the next delay unless ``stop`` is set first; True when stopped."""
        return stop.wait(self.next_delay())
