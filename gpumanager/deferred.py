"""Work that can wait until a call's answer has left: log lines, metrics, wake-ups of other threads.

The kubelet waits for every Allocate and PreStartContainer. What the answer does
not depend on (the "allocated ..." log line, a latency observation, waking the
checkpoint compactor or the annotation patcher) is handed to :func:`later`
inside a call and runs once the answer has been sent: gRPC's completion callback
hands it to one worker thread (``after-answer``), in order. Woken threads then no
longer compete for the interpreter with the answer on its way out, and work that
blocks (a full log pipe, a lock held across a slow disk) holds up neither gRPC's
polling thread, which starts every call of its server, nor the next answer.

Outside a call (tests, the DRA driver, start-up) :func:`later` runs the work at
once. Work that raises is logged and the rest still runs. :func:`drain` waits for
the work handed over so far (at stop, so the last log lines are written).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

Work = tuple[Callable[..., object], tuple[Any, ...]]
_local = threading.local()
_queue: queue.SimpleQueue[list[Work] | threading.Event] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


class _Context(Protocol):
    def add_callback(self, callback: Callable[[], None]) -> bool: ...


def later(fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)`` once the current call has been answered (at once outside a call)."""
    pending: list[Work] | None = getattr(_local, "pending", None)
    if pending is None:
        _run_one(fn, args)
    else:
        pending.append((fn, args))


def begin() -> list[Work] | None:
    """Collect this thread's :func:`later` work from now on; returns what was collected before (for
    :func:`end`: calls may nest when one handler calls another)."""
    outer: list[Work] | None = getattr(_local, "pending", None)
    _local.pending = []
    return outer


def end(outer: list[Work] | None, context: _Context | None) -> None:
    """Stop collecting; the work collected runs once ``context``'s call has ended (at once when it has
    ended already or there is no context). ``outer``: what :func:`begin` returned."""
    pending: list[Work] = getattr(_local, "pending", None) or []
    _local.pending = outer
    if not pending:
        return
    if outer is not None:  # a nested call: the outer call's answer is the one to wait for
        outer.extend(pending)
        return
    if context is not None:
        try:
            # Only True means the callback will be called; anything else (the call has ended, or a
            # context that is not gRPC's): the work runs now rather than never.
            if context.add_callback(lambda: _hand_over(pending)) is True:
                return
        except Exception:
            log.debug("call context refused a callback; deferred work runs now", exc_info=True)
    run(pending)


def drain(timeout: float) -> bool:
    """Wait (at most ``timeout`` seconds) until the work handed over so far has run; whether it has."""
    if _worker is None or not _worker.is_alive():
        return True
    done = threading.Event()
    _queue.put(done)
    return done.wait(timeout)


def _hand_over(pending: list[Work]) -> None:
    """gRPC's completion callback: never blocks, never runs the work itself."""
    global _worker
    if _worker is None or not _worker.is_alive():
        with _worker_lock:
            if _worker is None or not _worker.is_alive():
                _worker = threading.Thread(target=_work, name="after-answer", daemon=True)
                _worker.start()
    _queue.put(pending)


def _work() -> None:
    while True:
        item = _queue.get()
        if isinstance(item, threading.Event):
            item.set()
        else:
            run(item)


def run(pending: list[Work]) -> None:
    """Run collected work in order; one that raises is logged and the rest still run."""
    for fn, args in pending:
        _run_one(fn, args)


def _run_one(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("work deferred until after an answer failed: %r", fn)
