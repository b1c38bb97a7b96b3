"""Crash-safe checkpoint files: write to a temp file, fsync, rename, fsync the directory.

A reader never sees a half-written file: either the old content or the new.
A file that cannot be parsed is moved aside (never deleted) so an operator can
look at it, and the caller rebuilds its state from other records.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from gpumanager.fileio import atomic_write

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used; the message names the file and the problem."""


def write_json(path: Path, data: Any) -> None:
    """Atomically and durably replace ``path`` with ``data`` as JSON (directory created 0755 if missing)."""
    atomic_write(path, json.dumps(data, sort_keys=True, separators=(",", ":")).encode(), durable=True)


def read_json(path: Path) -> Any | None:
    """The JSON content of ``path``; None when it does not exist; CheckpointError when unreadable."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise CheckpointError(f"checkpoint {path} nests its JSON too deeply to read") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path} holds a JSON {type(data).__name__}, not an object")
    return data


def quarantine(path: Path) -> Path | None:
    """Move a bad checkpoint aside as ``<name>.corrupt-<unix time>``; returns the new path.

    None when there was nothing to move or it cannot be moved (the reason is logged).
    """
    target = path.with_name(f"{path.name}.corrupt-{int(time.time())}")
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("cannot move unusable checkpoint %s aside: %s", path, exc)
        return None
    log.warning("moved unusable checkpoint %s to %s", path, target)
    return target
