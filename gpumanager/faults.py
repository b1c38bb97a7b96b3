"""Crash and stall points for fault tests.

When the environment variable ``GPU_MANAGER_CRASH_AT`` names a point, the agent
kills itself with SIGKILL when it reaches it, so tests can check that nothing is
lost or doubled by a crash at that exact moment. ``GPU_MANAGER_STALL_AT=<point>:<seconds>[,<point>:<seconds>...]``
makes the agent wait at those points instead (logged), so a test can land a signal
or a request inside a window that is otherwise milliseconds wide. Both are unset in
production. ``GPU_MANAGER_CRASH_AT`` is read once, when this module is loaded (the agent's
environment is set before it starts): a crash point on the Allocate path then costs one
comparison of a module global.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)

ENV = "GPU_MANAGER_CRASH_AT"
STALL_ENV = "GPU_MANAGER_STALL_AT"


#: The crash point named by the environment when this module was loaded (None: none armed).
_CRASH_AT: str | None = os.environ.get(ENV)


def crash_point(name: str) -> None:
    """SIGKILL this process if ``GPU_MANAGER_CRASH_AT`` equals ``name``."""
    if name == _CRASH_AT:
        os.kill(os.getpid(), signal.SIGKILL)


def stall_point(name: str) -> None:
    """Sleep here if ``GPU_MANAGER_STALL_AT`` lists ``name:<seconds>``."""
    value = os.environ.get(STALL_ENV)
    if not value:
        return
    for item in value.split(","):
        point, _, seconds = item.partition(":")
        if point != name:
            continue
        try:
            pause = float(seconds)
        except ValueError:
            log.warning("%s=%s: each pause must be <point>:<seconds>; not stalling", STALL_ENV, value)
            return
        log.warning("stalling %g s at %s (%s)", pause, name, STALL_ENV)
        time.sleep(pause)
        return
