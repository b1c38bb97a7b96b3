"""The version and the git commit the agent was built from.

A wheel carries the commit in ``gpumanager/COMMIT``, written at build time by
``setup.py`` (from the checkout's git, else from the sdist, else from
``$GPU_MANAGER_COMMIT``). In a development checkout (an editable install) the
file is absent and the commit is asked of git once.
"""

from __future__ import annotations

import functools
from pathlib import Path

from gpumanager import __version__

UNKNOWN = "unknown"
_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def commit() -> str:
    """The full commit hash, or ``unknown`` when the build had no way to know it."""
    try:
        recorded = (_PACKAGE / "COMMIT").read_text().strip()
    except OSError:
        recorded = ""
    if recorded:
        return recorded
    if (_PACKAGE.parent / ".git").exists():
        import subprocess  # only in a development checkout, and not at every start

        try:
            out = subprocess.run(
                ["git", "-C", str(_PACKAGE.parent), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            )
            return out.stdout.strip() or UNKNOWN
        except (OSError, subprocess.SubprocessError):
            return UNKNOWN
    return UNKNOWN


def version() -> str:
    """The package version."""
    return __version__
