"""Log records written by a thread of their own: the caller never waits for the write."""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator

import pytest

from gpumanager import logwriter
from gpumanager.logwriter import BackgroundHandler


class Blocking(logging.Handler):
    """A target whose writes wait until ``gate`` is set (a log file waiting for its file system)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.written: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.gate.wait(30)
        self.written.append(self.format(record))


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    one = logging.getLogger(f"gpumanager.test.logwriter.{threading.get_ident()}")
    one.propagate = False
    one.setLevel(logging.DEBUG)
    yield one
    for h in list(one.handlers):
        one.removeHandler(h)
        h.close()


def test_a_stalled_write_does_not_hold_the_caller(logger: logging.Logger) -> None:
    target = Blocking()
    handler = BackgroundHandler([target])
    logger.addHandler(handler)
    caller = threading.Thread(target=lambda: [logger.info("allocated pod %s", f"p{i}") for i in range(3)])
    caller.start()
    caller.join(10)
    try:
        assert not caller.is_alive(), "the caller waited for the log write"
        assert target.written == []
    finally:
        target.gate.set()
    handler.flush()
    assert target.written == ["allocated pod p0", "allocated pod p1", "allocated pod p2"]


def test_records_keep_their_order_and_their_arguments_as_they_were(logger: logging.Logger) -> None:
    out = io.StringIO()
    stream = logging.StreamHandler(out)
    stream.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler := BackgroundHandler([stream]))
    gpus = [0]
    for i in range(500):
        logger.info("line %d GPUs %s", i, gpus)
        gpus.append(i + 1)  # changed after the call: the line shows the list as it was
    handler.flush()
    lines = out.getvalue().splitlines()
    assert len(lines) == 500
    assert lines[0] == f"INFO {logger.name}: line 0 GPUs [0]"
    assert lines[499] == f"INFO {logger.name}: line 499 GPUs {list(range(500))}"
    assert [int(line.split()[3]) for line in lines] == list(range(500))


def test_a_traceback_is_written_with_its_record(logger: logging.Logger) -> None:
    out = io.StringIO()
    stream = logging.StreamHandler(out)
    stream.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler := BackgroundHandler([stream]))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    handler.flush()
    text = out.getvalue()
    assert text.startswith("failed\nTraceback (most recent call last):")
    assert "RuntimeError: boom" in text


def test_a_target_level_is_kept(logger: logging.Logger) -> None:
    out = io.StringIO()
    stream = logging.StreamHandler(out)
    stream.setLevel(logging.WARNING)
    logger.addHandler(handler := BackgroundHandler([stream]))
    logger.info("quiet")
    logger.warning("loud")
    handler.flush()
    assert out.getvalue() == "loud\n"


def test_close_writes_what_is_queued_and_later_records_directly(logger: logging.Logger) -> None:
    target = Blocking()
    handler = BackgroundHandler([target])
    logger.addHandler(handler)
    logger.info("queued")
    threading.Timer(0.2, target.gate.set).start()
    handler.close()  # waits for the writer to reach the end of the queue
    assert target.written == ["queued"]
    logger.info("after")
    assert target.written == ["queued", "after"]


def test_a_slow_output_loses_no_line(logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    """More lines than may wait, to an output that is slow but takes them: callers wait for room."""
    monkeypatch.setattr(logwriter, "MAX_QUEUED", 5)

    class Slow(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.written: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            time.sleep(0.002)
            self.written.append(record.getMessage())

    target = Slow()
    logger.addHandler(handler := BackgroundHandler([target]))
    for i in range(60):
        logger.info("line %d", i)
    handler.flush()
    assert target.written == [f"line {i}" for i in range(60)]


def stalled_output(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, *, max_queued: int, lines: int
) -> tuple[Blocking, BackgroundHandler]:
    """``lines`` lines logged to an output that takes none (stalled after 0.05 s), ``max_queued`` of them waiting."""
    monkeypatch.setattr(logwriter, "MAX_QUEUED", max_queued)
    monkeypatch.setattr(logwriter, "STALL_SECONDS", 0.05)
    target = Blocking()
    handler = BackgroundHandler([target])
    logger.addHandler(handler)
    for i in range(lines):
        logger.info("line %d", i)
    return target, handler


def test_a_stalled_output_holds_a_bounded_number_of_lines_and_says_how_many_it_dropped(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sixth line waits for room until the output counts as stalled; the rest are dropped at once.
    target, handler = stalled_output(logger, monkeypatch, max_queued=5, lines=20)
    target.gate.set()
    handler.flush()
    logger.info("after")
    handler.flush()
    kept = [line for line in target.written if line.startswith("line")]
    assert kept == [f"line {i}" for i in range(len(kept))] and len(kept) in (5, 6)
    assert target.written[len(kept) :] == [
        f"{20 - len(kept)} log lines dropped: the log output took no line for 0.05 s while 5 waited",
        "after",
    ]


def test_lines_dropped_at_the_end_are_reported_at_close(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, handler = stalled_output(logger, monkeypatch, max_queued=2, lines=10)
    target.gate.set()
    handler.close()
    assert target.written[-1].endswith("log lines dropped: the log output took no line for 0.05 s while 2 waited")
    kept = len(target.written) - 1
    assert target.written[-1].startswith(f"{10 - kept} log lines dropped")


def test_a_warning_is_written_before_its_caller_goes_on(logger: logging.Logger) -> None:
    out = io.StringIO()
    logger.addHandler(BackgroundHandler([logging.StreamHandler(out)]))
    for i in range(100):
        logger.info("step %d", i)
    logger.warning("about to call the driver")
    # No flush: a crash in a native call right after the warning must find it written.
    assert out.getvalue().splitlines()[-1] == "about to call the driver"
    assert len(out.getvalue().splitlines()) == 101


def test_finish_returns_within_its_bound_when_the_output_takes_no_line(monkeypatch: pytest.MonkeyPatch) -> None:
    target = Blocking()
    handler = BackgroundHandler([target])
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [handler])
    logging.getLogger("gpumanager.test.finish").info("stuck")
    done = threading.Thread(target=logwriter.finish, args=(0.2,))
    done.start()
    done.join(10)
    try:
        assert not done.is_alive(), "finish() waited for an output that takes no line"
    finally:
        target.gate.set()
