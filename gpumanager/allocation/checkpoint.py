"""Crash-safe checkpoint files: write to a temp file, fsync, rename, fsync the directory.

A reader never sees a half-written file: either the old content or the new.
A file that cannot be parsed is moved aside (never deleted) so an operator can
look at it, and the caller rebuilds its state from other records.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from gpumanager.fileio import atomic_write, read_regular

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint file exists but cannot be used; the message names the file and the problem."""


class Conflicting(tuple[Any, ...]):
    """The values of a key given more than once, differently, in one JSON object of a checkpoint.

    Neither is known to be the right one: the value is no list, object, string or number, so every
    check of its field refuses it (naming the key and the values), and the entry holding it is rebuilt
    from other records. It is written back, should it ever be, as the list of the values.
    """

    key: str

    def __new__(cls, key: str, values: list[Any]) -> Conflicting:
        self = super().__new__(cls, values)
        self.key = key
        return self

    def __repr__(self) -> str:
        shown = ", ".join(repr(v) for v in self)
        return f"<{self.key!r} given {len(self)} different values: {shown}>"


class LongNumber:
    """A JSON integer with more digits than Python converts to an int (4300): no field accepts it, so the
    entry holding it is rebuilt from other records instead of the whole file being unreadable."""

    __slots__ = ("digits",)

    def __init__(self, digits: str) -> None:
        self.digits = digits

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LongNumber) and other.digits == self.digits

    def __hash__(self) -> int:
        return hash(self.digits)

    def __repr__(self) -> str:
        return f"<an integer of {len(self.digits.lstrip('-'))} digits, {self.digits[:12]}...>"


def parse_int(text: str) -> int | LongNumber:
    """A JSON integer: an int, or a :class:`LongNumber` when it has too many digits to convert."""
    try:
        return int(text)
    except ValueError:
        return LongNumber(text)


def _merge(key: str, old: Any, new: Any, repeated: list[str]) -> Any:
    """One value for a key given twice: objects are merged key by key, equal values kept, others conflict."""
    repeated.append(key)
    if isinstance(old, dict) and isinstance(new, dict):
        merged = dict(old)
        for k, v in new.items():
            merged[k] = _merge(k, merged[k], v, repeated) if k in merged else v
        return merged
    if isinstance(old, Conflicting):
        return old if new in old else Conflicting(key, [*old, new])
    return old if old == new else Conflicting(key, [old, new])


def _object(pairs: list[tuple[str, Any]], repeated: list[str]) -> dict[str, Any]:
    """A JSON object whose repeated keys are merged (:func:`_merge`) instead of the last one silently winning."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj[key] = _merge(key, obj[key], value, repeated) if key in obj else value
    return obj


#: The largest snapshot read (200 pods take about 60 KiB): a larger file is no checkpoint of one node, and
#: reading and parsing it whole could take the agent's memory.
SNAPSHOT_LIMIT = 256 << 20


def write_json(path: Path, data: Any) -> None:
    """Atomically and durably replace ``path`` with ``data`` as JSON (directory created 0755 if missing)."""
    atomic_write(path, json.dumps(data, sort_keys=True, separators=(",", ":")).encode(), durable=True)


def read_json(path: Path) -> Any | None:
    """The JSON object in ``path``; None when it does not exist; CheckpointError when unreadable or not an
    object. A key given more than once in one object is logged; its values are merged (:class:`Conflicting`)."""
    try:
        raw = read_regular(path, SNAPSHOT_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    repeated: list[str] = []
    try:
        data = json.loads(raw, object_pairs_hook=lambda pairs: _object(pairs, repeated), parse_int=parse_int)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path} is not valid JSON: {exc}") from exc
    except RecursionError:
        raise CheckpointError(f"checkpoint {path} nests its JSON too deeply to read") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint {path} holds a JSON {type(data).__name__}, not an object")
    if repeated:
        shown = ", ".join(repr(k) for k in dict.fromkeys(repeated))
        log.warning(
            "checkpoint %s gives key(s) %s more than once in one object: objects merged, equal values kept, an "
            "entry with different values for one field is rebuilt from other records",
            path,
            shown[:500],
        )
    return data


def quarantine(path: Path) -> Path | None:
    """Move a bad checkpoint aside as ``<name>.corrupt-<unix time>`` (``-<n>`` added when that name is
    taken: never over an earlier one); returns the new path.

    None when there was nothing to move or it cannot be moved (the reason is logged).
    """
    try:
        target = move_aside(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("cannot move unusable checkpoint %s aside: %s", path, exc)
        return None
    log.warning("moved unusable checkpoint %s to %s", path, target)
    return target


#: How many names ``<name>.corrupt-<time>-<n>`` are tried before giving up.
_ASIDE_TRIES = 1000


def move_aside(path: Path) -> Path:
    """Rename ``path`` to ``<name>.corrupt-<unix time>``, or ``...-<n>`` with the first ``n`` free: an
    earlier file set aside in the same second (or before the clock stepped back) is never replaced.
    Returns the new path; OSError (FileNotFoundError when ``path`` is gone) when it cannot be moved."""
    stem = f"{path.name}.corrupt-{int(time.time())}"
    for n in range(_ASIDE_TRIES):
        target = path.with_name(stem if n == 0 else f"{stem}-{n}")
        if _rename_no_replace(path, target):
            return target
    raise OSError(errno.EEXIST, f"{_ASIDE_TRIES} names {stem}[-n] are taken already")


def copy_aside(path: Path, data: bytes) -> Path:
    """Keep a copy of ``path`` (whose content is ``data``) as ``<name>.corrupt-<unix time>[-<n>]``, never
    over an earlier one, leaving ``path`` in place: a hard link, else a copy written and synced. Returns
    the copy's path; OSError when none can be made."""
    stem = f"{path.name}.corrupt-{int(time.time())}"
    for n in range(_ASIDE_TRIES):
        target = path.with_name(stem if n == 0 else f"{stem}-{n}")
        try:
            os.link(path, target, follow_symlinks=False)
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV):
                raise
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(target)
                raise
        return target
    raise OSError(errno.EEXIST, f"{_ASIDE_TRIES} names {stem}[-n] are taken already")


def _rename_no_replace(path: Path, target: Path) -> bool:
    """Rename ``path`` to ``target`` unless ``target`` exists (False then): a hard link, which fails
    on an existing name, then the old name removed. Where hard links cannot be made (a directory, a
    file system without them) a rename after a look, which is enough with one agent per node."""
    try:
        os.link(path, target, follow_symlinks=False)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.lexists(target):
            return False
        os.rename(path, target)
        return True
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(target)  # not moved: leave it where it was, once
        raise
    return True
