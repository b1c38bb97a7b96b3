"""SharedCall: concurrent callers share one call, and never an answer older than their question."""

from __future__ import annotations

import threading
import time

import pytest

from gpumanager.kube.shared_call import SharedCall


def _until(condition: object, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_callers_that_arrive_during_a_call_share_the_next_one() -> None:
    release = threading.Event()
    rounds: list[int] = []

    def call() -> int:
        rounds.append(len(rounds) + 1)
        if len(rounds) == 1:
            release.wait(30)
        return len(rounds)

    shared: SharedCall[int] = SharedCall(call)
    answers: list[int] = []
    first = threading.Thread(target=lambda: answers.append(shared()))
    first.start()
    _until(lambda: shared.calls == 1, "the first call never started")
    others = [threading.Thread(target=lambda: answers.append(shared())) for _ in range(20)]
    for t in others:
        t.start()
    _until(lambda: shared.waiting == 21, "callers never arrived")
    release.set()
    for t in [first, *others]:
        t.join(30)
    # One call for the first caller; everyone who asked while it ran shares the second, whose answer is
    # newer than their question (the first call started before they asked).
    assert shared.calls == 2
    assert sorted(answers) == [1] + [2] * 20


def test_an_exception_reaches_every_caller_of_that_call_and_the_next_caller_tries_again() -> None:
    outcomes = iter([RuntimeError("kubelet away"), 7])

    def call() -> int:
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    shared: SharedCall[int] = SharedCall(call)
    with pytest.raises(RuntimeError, match="kubelet away"):
        shared()
    assert shared() == 7
    assert shared.calls == 2
