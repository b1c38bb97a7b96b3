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


def _failing_once_then(value: int) -> SharedCall[int]:
    """A shared call whose first call raises, and whose next answers ``value``."""
    outcomes: list[Exception | int] = [RuntimeError("kubelet away"), value]

    def call() -> int:
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return SharedCall(call)


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
    shared = _failing_once_then(7)
    with pytest.raises(RuntimeError, match="kubelet away"):
        shared()
    assert shared() == 7
    assert shared.calls == 2


def test_a_caller_with_since_takes_the_newest_answer_made_since_then_when_it_holds_what_it_wants() -> None:
    made: list[float] = []

    def call() -> int:
        made.append(time.monotonic())
        return len(made)

    shared: SharedCall[int] = SharedCall(call)
    before_first = time.monotonic()
    assert shared() == 1
    # Made after ``since`` and accepted: no new call.
    assert shared(since=before_first, accept=lambda answer: answer == 1) == 1
    assert shared.calls == 1
    # Not accepted: a call that starts after this caller asked.
    assert shared(since=before_first, accept=lambda answer: False) == 2
    # Made before ``since``: passed over unseen, whatever accept would say.
    seen: list[int] = []
    after_second = time.monotonic()
    assert shared(since=after_second, accept=lambda answer: seen.append(answer) or True) == 3
    assert seen == [] and shared.calls == 3
    # Without accept, ``since`` changes nothing.
    assert shared(since=before_first) == 4


def test_a_caller_with_since_waits_for_the_running_call_that_started_after_it_and_shares_it() -> None:
    release = threading.Event()

    def call() -> str:
        release.wait(30)
        return "answer"

    shared: SharedCall[str] = SharedCall(call)
    since = time.monotonic()
    leader = threading.Thread(target=shared)
    leader.start()
    _until(lambda: shared.calls == 1, "the first call never started")
    answers: list[str] = []
    follower = threading.Thread(target=lambda: answers.append(shared(since=since, accept=lambda a: a == "answer")))
    follower.start()
    _until(lambda: shared.waiting == 2, "the follower never waited")
    release.set()
    for t in (leader, follower):
        t.join(30)
    assert answers == ["answer"]
    assert shared.calls == 1, "the follower took the running call's answer instead of asking again"


def test_a_caller_with_since_passes_over_a_failed_answer() -> None:
    shared = _failing_once_then(7)
    since = time.monotonic()
    with pytest.raises(RuntimeError):
        shared()
    assert shared(since=since, accept=lambda answer: True) == 7
    assert shared.calls == 2
