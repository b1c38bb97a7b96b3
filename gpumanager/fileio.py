"""Replacing files atomically: a reader sees the old content or the new, never a mix."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = False) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it over ``path``.

    ``durable`` also fsyncs the file and the directory, so the new content survives a power
    loss (for state that must outlive the machine, like checkpoints). The parent directory is
    created (0755) if missing.
    """
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
