"""Crash points for fault tests.

When the environment variable ``GPU_MANAGER_CRASH_AT`` names a point, the agent
kills itself with SIGKILL when it reaches it, so tests can check that nothing is
lost or doubled by a crash at that exact moment. Unset in production: a single
dictionary lookup per point.
"""

from __future__ import annotations

import os
import signal

ENV = "GPU_MANAGER_CRASH_AT"


def crash_point(name: str) -> None:
    """SIGKILL this process if ``GPU_MANAGER_CRASH_AT`` equals ``name``."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
