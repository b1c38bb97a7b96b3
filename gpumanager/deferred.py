"""Work that can wait until a call's answer has left: log lines, metrics, wake-ups of other threads.

The kubelet waits for every Allocate and PreStartContainer. What the answer does
not depend on (the "allocated ..." log line, a latency observation, waking the
checkpoint compactor or the annotation patcher) is handed to :func:`later`
inside a call and runs once the answer has been sent, in gRPC's own thread for
the call's completion. Woken threads then no longer compete for the
interpreter with the answer on its way out.

Outside a call (tests, the DRA driver, start-up) :func:`later` runs the work at
once. Work that raises is logged and the rest still runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

Work = tuple[Callable[..., object], tuple[Any, ...]]
_local = threading.local()


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
            if context.add_callback(lambda: run(pending)):
                return
        except Exception:  # a context that cannot take callbacks: run now rather than never
            log.debug("call context refused a callback; deferred work runs now", exc_info=True)
    run(pending)


def run(pending: list[Work]) -> None:
    """Run collected work in order; one that raises is logged and the rest still run."""
    for fn, args in pending:
        _run_one(fn, args)


def _run_one(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("work deferred until after an answer failed: %r", fn)
