"""Files a periodic refresh cannot write (a full disk, a read-only file system): each reported once.

The refresh tries such a file again at every period; a warning each second (or a traceback ending the
pass, so that no other file is brought up to date) would drown the log. A file is reported when it
first fails and again when the reason changes, and forgotten once a write works.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger(__name__)

#: Files remembered at most (a bound, not a limit anyone should meet).
MAX_REMEMBERED = 4096


class UnwritableFiles:
    """The files whose last write failed, with the reason reported for each."""

    def __init__(self) -> None:
        self._reasons: dict[Path, str] = {}

    def failed(self, path: Path, exc: OSError, owner: str) -> None:
        """A write of ``path`` (the file of ``owner``: "pod X container Y", "claim ns/name ...") failed:
        report it unless this reason already was."""
        reason = exc.strerror or str(exc)
        if self._reasons.get(path) == reason:
            return
        if len(self._reasons) >= MAX_REMEMBERED:
            self._reasons.clear()
        self._reasons[path] = reason
        log.warning("cannot write %s of %s: %s (trying again each refresh)", path, owner, reason)

    def written(self, path: Path) -> None:
        """A write of ``path`` worked: a later failure is reported again."""
        self._reasons.pop(path, None)

    def forget_under(self, directory: Path) -> None:
        """Forget the files below ``directory`` (removed with its pod or claim)."""
        prefix = str(directory) + os.sep
        for path in [p for p in self._reasons if str(p).startswith(prefix)]:
            del self._reasons[path]

    def forget_all_but(self, paths: Collection[Path]) -> None:
        """Forget every file but ``paths`` (those still refreshed)."""
        for path in [p for p in self._reasons if p not in paths]:
            del self._reasons[path]

    def __contains__(self, path: object) -> bool:
        return path in self._reasons
