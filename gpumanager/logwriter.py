"""Log records written by a thread of their own, off the threads that answer the kubelet.

A log line costs its caller the time stamp's formatting and a write to stderr or to the log
file; a write to a file can wait for the file system's journal for milliseconds, and a pipe for
its reader. The agent logs a line for every allocation, so that cost was the kubelet's.
:class:`BackgroundHandler` renders only the message in the caller (its arguments are read at
that moment, as with a direct handler) and hands the record to a writer thread, which formats
and writes it through the handlers it was given, in order.

- A warning or worse is written before its caller goes on (it waits for the writer, at most
  :data:`SYNC_WAIT_SECONDS`): what comes before a failure, a crash in a native library included,
  is on the output when it happens. So are uncaught exceptions, logged in order with the rest
  (:func:`install`).
- A slow output slows the callers once :data:`MAX_QUEUED` lines wait, as a direct handler would.
  An output that takes no line for :data:`STALL_SECONDS` (a stderr pipe nobody reads) holds only
  the writer: later lines are counted and dropped, and a warning says how many once it takes
  lines again, or at the exit.
- Nothing queued is lost at an orderly exit: ``logging.shutdown()`` (run at the interpreter's
  exit) closes this handler, which writes every queued line first; :func:`finish` does the same
  within a bound, for exits that must not wait for a stalled output. A process killed with
  SIGKILL loses the information lines of its last moment that were not yet written.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import types
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: Lines that may wait for the writer; beyond them a caller waits for room, as with a direct write.
MAX_QUEUED = 10_000
#: A write that has not returned for this long is a stalled output: lines are dropped, not waited for.
STALL_SECONDS = 1.0
#: Records at or above this level are written before their caller goes on.
SYNC_LEVEL = logging.WARNING
#: How long such a caller waits for the writer, at most.
SYNC_WAIT_SECONDS = 0.5
#: How long flush() and close() wait for the writer to catch up.
DRAIN_SECONDS = 2.0


class _Marker:
    """Put in the queue behind the records to wait for; set when the writer reaches it."""

    def __init__(self, *, last: bool = False) -> None:
        self.reached = threading.Event()
        self.last = last


def _dropped_record(count: int) -> logging.LogRecord:
    """The warning that says how many lines were dropped while the output was stalled."""
    return logging.LogRecord(
        __name__,
        logging.WARNING,
        __file__,
        0,
        f"{count} log lines dropped: the log output took no line for {STALL_SECONDS:g} s while {MAX_QUEUED} waited",
        None,
        None,
    )


class BackgroundHandler(logging.Handler):
    """Queues records for a writer thread that passes them to ``targets`` (with their own formatters)."""

    def __init__(self, targets: Sequence[logging.Handler]) -> None:
        super().__init__()
        self.targets = tuple(targets)
        # (record, whether it holds a place of the MAX_QUEUED), or a marker.
        self._queue: queue.SimpleQueue[tuple[logging.LogRecord, bool] | _Marker] = queue.SimpleQueue()
        self._room = threading.Semaphore(MAX_QUEUED)  # one per record queued and not yet written
        self._closed = False
        self._dropped = 0  # lines dropped while the output was stalled, not yet reported
        self._writing_since: float | None = None  # when the write in progress began
        self._writer = threading.Thread(target=self._write_loop, name="log-writer", daemon=True)
        self._writer.start()

    def stalled(self) -> bool:
        """Whether the output has taken no line for :data:`STALL_SECONDS`."""
        since = self._writing_since
        return since is not None and time.monotonic() - since > STALL_SECONDS

    def emit(self, record: logging.LogRecord) -> None:
        """Render the message now (its arguments may change later) and queue the record.

        Called with the handler's lock held, as :meth:`close` sets its flag: nothing is queued
        behind the last marker."""
        if self._closed or threading.current_thread() is self._writer:
            self._write(record)  # after the end, or from a target's own logging: as a direct handler
            return
        try:
            record.msg = record.getMessage()
            record.args = None
            if record.exc_info and not record.exc_text:
                # The traceback as text now: its frames are not kept alive in the queue.
                record.exc_text = logging.Formatter().formatException(record.exc_info)
        except Exception:
            self.handleError(record)
            return
        stalled = self.stalled()
        if not self._room.acquire(timeout=0 if stalled else STALL_SECONDS):
            self._dropped += 1
            return
        if self._dropped and self._room.acquire(timeout=0):
            self._queue.put((_dropped_record(self._dropped), True))
            self._dropped = 0
        self._queue.put((record, True))
        if record.levelno >= SYNC_LEVEL and not stalled:
            self._wait(SYNC_WAIT_SECONDS)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Marker):
                item.reached.set()
                if item.last:
                    return
                continue
            record, placed = item
            self._writing_since = time.monotonic()
            try:
                self._write(record)
            finally:
                self._writing_since = None
                if placed:
                    self._room.release()

    def _write(self, record: logging.LogRecord) -> None:
        for target in self.targets:
            try:
                if record.levelno >= target.level:
                    target.handle(record)
            except Exception:
                target.handleError(record)

    def _wait(self, seconds: float, *, last: bool = False) -> bool:
        """Whether the writer reached every record queued so far within ``seconds``."""
        marker = _Marker(last=last)
        self._queue.put(marker)
        return threading.current_thread() is self._writer or marker.reached.wait(seconds)

    def flush(self) -> None:
        """Return once every record queued so far is written (at most :data:`DRAIN_SECONDS`)."""
        if not self._closed and self._wait(DRAIN_SECONDS):
            for target in self.targets:
                target.flush()

    def close(self, timeout: float = DRAIN_SECONDS) -> None:
        """Write what is queued, stop the writer, close the targets (at most ``timeout``; a target
        stuck in a write is left as it is). Later records are written directly."""
        with self.lock:  # type: ignore[union-attr]  # made by Handler.__init__
            closing, self._closed = not self._closed, True
            if closing and self._dropped:
                self._queue.put((_dropped_record(self._dropped), False))
                self._dropped = 0
        if closing and self._wait(timeout, last=True):
            for target in self.targets:
                target.flush()
                target.close()
        super().close()


def finish(timeout: float) -> None:
    """Write what the root logger's background handlers hold, at most ``timeout`` seconds in all
    (before ``os._exit``, which runs no exit handler; ``logging.shutdown()`` would wait for ever for
    an output that takes no line)."""
    deadline = time.monotonic() + timeout
    for handler in logging.getLogger().handlers:
        if isinstance(handler, BackgroundHandler):
            handler.close(max(0.0, deadline - time.monotonic()))


def install() -> None:
    """Uncaught exceptions, in any thread, go to the log in order with the other lines (the
    interpreter would write them straight to stderr, ahead of lines still queued)."""

    def main_hook(kind: type[BaseException], value: BaseException, tb: types.TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, value, tb)
            return
        log.critical("uncaught exception", exc_info=(kind, value, tb))

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return  # as the default hook: a thread that calls sys.exit() just ends
        name = args.thread.name if args.thread is not None else "?"
        value = args.exc_value if args.exc_value is not None else args.exc_type()
        log.critical("uncaught exception in thread %s", name, exc_info=(args.exc_type, value, args.exc_traceback))

    sys.excepthook = main_hook
    threading.excepthook = thread_hook
