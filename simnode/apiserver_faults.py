"""Fault injection and the request log of the API-server simulator."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from simnode.apiserver_errors import ApiError, for_code

log = logging.getLogger(__name__)

DownMode = Literal["503", "refuse", "hang"]


@dataclass(frozen=True)
class RequestRecord:
    """One request the simulator answered (or refused to), for assertions in tests."""

    method: str
    path: str
    query: Mapping[str, str]
    status: int
    """HTTP status sent; 0 when the connection was dropped without an answer."""
    content_type: str | None = None
    body: Any = None
    """The decoded JSON body (None when there was none or it was not JSON)."""
    time: float = field(default_factory=time.monotonic)


@dataclass
class _FailRule:
    method: str | None
    path: re.Pattern[str]
    status: int
    remaining: int
    message: str | None
    retry_after: int | None


@dataclass
class _DelayRule:
    method: str | None
    path: re.Pattern[str]
    seconds: float
    remaining: int | None


def _method_matches(rule: str | None, method: str) -> bool:
    return rule is None or rule == "*" or rule.upper() == method.upper()


class Faults:
    """Injected failures: the whole server down, the next matching requests failing, delays."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.down: DownMode | None = None
        self.watches_held = False
        """Watch streams keep their events back while set (a watch lagging behind the writes)."""
        self._fail: list[_FailRule] = []
        self._delay: list[_DelayRule] = []

    def fail_next(
        self,
        method: str | None,
        path_regex: str,
        status: int,
        count: int,
        message: str | None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next ``count`` requests matching ``method`` and ``path_regex`` with ``status``."""
        with self._lock:
            self._fail.append(_FailRule(method, re.compile(path_regex), status, count, message, retry_after))

    def delay(self, method: str | None, path_regex: str, seconds: float, count: int | None) -> None:
        """Hold matching requests ``seconds`` before answering (``seconds <= 0`` removes the rule)."""
        with self._lock:
            self._delay = [d for d in self._delay if not (d.path.pattern == path_regex and d.method == method)]
            if seconds > 0:
                self._delay.append(_DelayRule(method, re.compile(path_regex), seconds, count))

    def hold_while_hanging(self, stopping: threading.Event) -> bool:
        """Hold a request while the server hangs (``down == "hang"``); True when it should be answered."""
        while self.down == "hang":
            if stopping.wait(0.05):
                return False
        return True

    def hold_watch_event(self, stopping: threading.Event) -> bool:
        """Hold a watch event while :attr:`watches_held`; True when it should be sent."""
        while self.watches_held:
            if stopping.wait(0.01):
                return False
        return True

    def clear(self) -> None:
        """Forget every failure and delay rule (the down state stays)."""
        with self._lock:
            self._fail.clear()
            self._delay.clear()

    def take_failure(self, method: str, path: str) -> ApiError | None:
        """The injected error for this request, if a rule matches (consuming one of its uses)."""
        with self._lock:
            for rule in self._fail:
                if rule.remaining > 0 and _method_matches(rule.method, method) and rule.path.search(path):
                    rule.remaining -= 1
                    if rule.remaining <= 0:
                        self._fail.remove(rule)
                    return for_code(rule.status, rule.message, rule.retry_after)
        return None

    def delay_for(self, method: str, path: str) -> float:
        """Seconds to hold this request (0 when no rule matches)."""
        with self._lock:
            for rule in self._delay:
                if _method_matches(rule.method, method) and rule.path.search(path):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                        if rule.remaining <= 0:
                            self._delay.remove(rule)
                    return rule.seconds
        return 0.0


class RequestLog:
    """A bounded, thread-safe log of :class:`RequestRecord`."""

    def __init__(self, limit: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._records: deque[RequestRecord] = deque(maxlen=limit)

    def add(self, record: RequestRecord) -> None:
        """Append one record."""
        with self._lock:
            self._records.append(record)

    def snapshot(self) -> list[RequestRecord]:
        """Every record, oldest first."""
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        """Drop every record."""
        with self._lock:
            self._records.clear()
