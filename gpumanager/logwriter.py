"""Log records written by a thread of their own, off the threads that answer the kubelet.

A log line costs its caller the time stamp's formatting and a write to stderr or to the log
file; a write to a file can wait for the file system's journal for milliseconds. The agent
logs a line for every allocation, so that cost was the kubelet's. :class:`BackgroundHandler`
renders only the message in the caller (its arguments are read at that moment, as with a
direct handler) and hands the record to a writer thread, which formats and writes it through
the handlers it was given, in order.

A log output that stops taking lines (a stalled stderr pipe) holds only the writer thread: at most
:data:`MAX_QUEUED` lines wait for it, later ones are counted and dropped, and once the output
takes lines again a warning says how many were dropped.

Nothing is lost at an orderly exit: ``logging.shutdown()`` (run at the interpreter's exit and
before every ``os._exit`` of the agent) flushes and closes this handler, which writes every
queued record first. A process killed with SIGKILL loses the records of its last moment that
were not yet written, as a process killed while writing would.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: Lines that may wait for a stalled output before new ones are dropped (and counted).
MAX_QUEUED = 10_000
#: How long flush() and close() wait for the writer to catch up (a stalled stderr must not hold an exit).
DRAIN_SECONDS = 2.0


class _Marker:
    """Put in the queue behind the records to wait for; set when the writer reaches it."""

    def __init__(self, *, last: bool = False) -> None:
        self.reached = threading.Event()
        self.last = last


def _dropped_record(after: logging.LogRecord, count: int) -> logging.LogRecord:
    """The warning written before ``after``: how many lines were dropped while the output was stalled."""
    return logging.LogRecord(
        __name__,
        logging.WARNING,
        __file__,
        0,
        f"{count} log lines dropped: the log output took no lines while {MAX_QUEUED} waited",
        None,
        None,
    )


class BackgroundHandler(logging.Handler):
    """Queues records for a writer thread that passes them to ``targets`` (with their own formatters)."""

    def __init__(self, targets: Sequence[logging.Handler]) -> None:
        super().__init__()
        self.targets = tuple(targets)
        self._queue: queue.SimpleQueue[logging.LogRecord | _Marker] = queue.SimpleQueue()
        self._closed = False
        self._dropped = 0  # lines dropped since the writer last caught up (under the handler's lock)
        self._writer = threading.Thread(target=self._write_loop, name="log-writer", daemon=True)
        self._writer.start()

    def emit(self, record: logging.LogRecord) -> None:
        """Render the message now (its arguments may change later) and queue the record (called with
        the handler's lock held, as :meth:`close` sets its flag: nothing is queued behind the last marker)."""
        if self._closed:
            self._write(record)
            return
        try:
            record.msg = record.getMessage()
            record.args = None
            if record.exc_info and not record.exc_text:
                # The traceback as text now: its frames are not kept alive in the queue.
                record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        except Exception:
            self.handleError(record)
            return
        if self._queue.qsize() >= MAX_QUEUED:
            self._dropped += 1
            return
        if self._dropped:
            dropped, self._dropped = self._dropped, 0
            self._queue.put(_dropped_record(record, dropped))
        self._queue.put(record)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Marker):
                item.reached.set()
                if item.last:
                    return
                continue
            self._write(item)

    def _write(self, record: logging.LogRecord) -> None:
        for target in self.targets:
            try:
                if record.levelno >= target.level:
                    target.handle(record)
            except Exception:
                target.handleError(record)

    def _drain(self, marker: _Marker) -> None:
        self._queue.put(marker)
        if threading.current_thread() is not self._writer:
            marker.reached.wait(DRAIN_SECONDS)

    def flush(self) -> None:
        """Return once every record queued so far is written (at most :data:`DRAIN_SECONDS`)."""
        if self._closed:
            return
        self._drain(_Marker())
        for target in self.targets:
            target.flush()

    def close(self) -> None:
        """Write what is queued, stop the writer, close the targets; later records are written directly."""
        with self.lock:  # type: ignore[union-attr]  # made by Handler.__init__
            closing, self._closed = not self._closed, True
            marker = _Marker(last=True)
            if closing:
                self._queue.put(marker)
        if closing:
            if threading.current_thread() is not self._writer:
                marker.reached.wait(DRAIN_SECONDS)
            for target in self.targets:
                target.flush()
                target.close()
        super().close()
