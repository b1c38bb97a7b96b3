"""Checks of flag values made at start, before anything is served.

The files and directories flags name (``--extra-config``'s device list, the directories the
agent writes): a problem is a :class:`~gpumanager.config.ConfigError` naming the flag and its
value (the process exits 2). Flags kept only for compatibility are noted in the log.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

from gpumanager.config import Config, ConfigError

log = logging.getLogger(__name__)

# Flags kept only so existing manifests work.
_COMPAT_ONLY = ("container_runtime_endpoint", "runtime_request_timeout", "cgroup_driver")


def log_compat_flags(config: Config) -> None:
    """Note each compatibility-only flag set to other than its default (it changes nothing)."""
    defaults = Config()
    compat = [f for f in _COMPAT_ONLY if getattr(config, f) != getattr(defaults, f)]
    if compat:
        log.info(
            "%s: kept for compatibility; no container runtime connection is needed and both cgroup "
            "drivers are recognised",
            ", ".join("--" + f.replace("_", "-") for f in compat),
        )


def load_extra_devices(path: str) -> tuple[str, ...]:
    """Device paths of ``extra-config.json``'s ``default`` entry; ConfigError names the file and problem."""
    if not path:
        return ()
    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"--extra-config={path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, or not UTF-8/16/32 text
        raise ConfigError(f"--extra-config={path}: not a JSON document: {exc}") from None
    except RecursionError:
        raise ConfigError(f"--extra-config={path}: not a JSON document: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--extra-config={path}: must be a JSON object")
    default = data.get("default") or {}
    devices = default.get("devices") or [] if isinstance(default, dict) else None
    if not isinstance(devices, list) or not all(isinstance(d, str) and d.startswith("/") for d in devices):
        raise ConfigError(f"--extra-config={path}: default.devices must be a list of absolute paths")
    return tuple(devices)


def check_directory(flag: str, value: str) -> None:
    """Create ``value`` if missing; ConfigError (exit 2) when it cannot be a directory we may write.

    For ``--checkpoint-path`` the state of the disk is not an error of the flag: a path that is
    a file, a read-only or full disk, an I/O error are reported on /readyz with the path and
    errno while the agent serves what it can (new allocations are refused with the reason).
    """
    path = Path(value)
    tolerated = (errno.ENOTDIR, errno.EEXIST, errno.EROFS, errno.ENOSPC, errno.EIO, errno.EDQUOT)
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as exc:
        if flag == "--checkpoint-path" and exc.errno in tolerated:
            return
        if isinstance(exc, FileExistsError):
            raise ConfigError(f"{flag}={value}: exists and is not a directory") from None
        raise ConfigError(f"{flag}={value}: cannot create the directory: {exc.strerror} ({exc.errno})") from None
    if not path.is_dir():
        if flag == "--checkpoint-path":
            return
        raise ConfigError(f"{flag}={value}: exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK) and not _read_only_fs(path):
        raise ConfigError(f"{flag}={value}: the directory is not writable")


def _read_only_fs(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
