"""The pids.config refresh loop: periodic while it has work, asleep until woken while it has none."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpumanager.vmanager.refresh import _RefreshLoop


class Counting(_RefreshLoop):
    """A loop whose refresh only counts; ``busy`` is what each refresh reports."""

    def __init__(self, *, busy: bool, period: float) -> None:
        super().__init__(period=period)
        self.busy = busy
        self.calls = 0
        self.called = threading.Condition()

    def _refresh(self) -> bool:
        with self.called:
            self.calls += 1
            self.called.notify_all()
        return self.busy

    def wait_calls(self, count: int) -> None:
        with self.called:
            assert self.called.wait_for(lambda: self.calls >= count, timeout=10), f"{count} refreshes"


@pytest.fixture
def loops() -> Iterator[list[Counting]]:
    started: list[Counting] = []
    yield started
    for loop in started:
        loop.stop()
        assert loop._thread is not None
        loop._thread.join(5)
        assert not loop.alive(), "stop() ends the loop, asleep or not"


def test_wakes_while_busy_wait_for_the_next_period(loops: list[Counting]) -> None:
    loop = Counting(busy=True, period=3600)
    loops.append(loop)
    loop.start()
    for _ in range(20):  # a burst of PreStartContainer calls
        loop.wake()
    time.sleep(0.3)  # a refresh per wake would have run by now
    assert loop.calls == 0


def test_an_idle_loop_refreshes_at_once_when_woken(loops: list[Counting]) -> None:
    loop = Counting(busy=False, period=0.01)
    loops.append(loop)
    loop.start()
    loop.wait_calls(1)  # the first period: nothing to keep current, so it sleeps
    time.sleep(0.3)
    assert loop.calls == 1
    loop.wake()
    loop.wait_calls(2)
