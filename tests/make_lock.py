"""``make`` in vcuda/ from the tests, one at a time across test processes.

The tests' fixtures build what they need (the sanitizer builds, the test-hook builds, the benchmark programs) when
they start, in each pytest-xdist worker.  Two makes of the same out-of-date target at once each compile and link it,
and a test of the worker whose make ended first could load a library the other was writing (an ASan scenario then
failed to start).  Every make here holds an exclusive lock on vcuda/build/.make.lock: the second finds the targets
built and does nothing.
"""

from __future__ import annotations

import fcntl
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LOCK = Path(__file__).resolve().parent.parent / "vcuda" / "build" / ".make.lock"


def run_make(command: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(command, **kwargs)`` (a make command line) with the build lock held."""
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            return subprocess.run(list(command), **kwargs)
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)
