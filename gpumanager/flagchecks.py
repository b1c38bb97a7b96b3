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
        denied = _not_root() if exc.errno in (errno.EACCES, errno.EPERM) else ""
        raise ConfigError(
            f"{flag}={value}: cannot create the directory: {exc.strerror} ({exc.errno}){denied}"
        ) from None
    if not path.is_dir():
        if flag == "--checkpoint-path":
            return
        raise ConfigError(f"{flag}={value}: exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK) and not _read_only_fs(path):
        raise ConfigError(f"{flag}={value}: the directory is not writable{_not_root()}")


def _not_root() -> str:
    """For a refused write: who the agent runs as, where that is not root ('' for root)."""
    uid = os.geteuid()
    return f" by uid {uid} (the agent runs as root on a node)" if uid != 0 else ""


def _read_only_fs(path: Path) -> bool:
    """Whether ``path`` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


#: The NVML library's soname, as the host's ld.so.cache lists it.
NVML_SONAME = "libnvidia-ml.so.1"


def nvml_library(config: Config) -> str:
    """The NVML library to load: ``--nvml-lib``, or, while that file is missing because it lies in the
    driver mirror (``--volume-config``'s volumes) that the agent builds only after NVML has started (a
    node it has never run on), the host's ``libnvidia-ml.so.1`` found as the mirror finds it: in
    ``--driver-root``'s ld.so.cache. A missing file anywhere else is loaded as given (and refused)."""
    path = config.nvml_lib
    if not path or not config.volume_config or os.path.lexists(path):
        return path
    # Only on this path: the mirror's readers are not loaded at every start.
    from gpumanager.volume.config import load_volume_config
    from gpumanager.volume.errors import VolumeError
    from gpumanager.volume.ldcache import host_lib_dirs, read_ldcache
    from gpumanager.volume.rootfs import DriverRoot

    try:
        volumes = [v.path for v in load_volume_config(Path(config.volume_config)).volumes]
    except VolumeError:
        return path
    if not any(Path(path).is_relative_to(v) for v in volumes):
        return path
    root = DriverRoot(Path(config.driver_root))
    try:
        cache = read_ldcache(root.agent_path(root.resolve("/etc/ld.so.cache")))
        lib_dirs = host_lib_dirs()
    except VolumeError as exc:
        log.warning("--nvml-lib=%s does not exist yet and the host's NVML cannot be looked up: %s", path, exc)
        return path
    for entry in cache.entries:
        if entry.key != NVML_SONAME or not entry.is_elf or entry.glibc_hwcaps or entry.bits != 64:
            continue
        if entry.arch not in lib_dirs:
            continue
        try:
            found = root.agent_path(root.resolve(entry.value))
        except VolumeError:
            continue
        if found.is_file():
            log.warning(
                "--nvml-lib=%s does not exist yet (the driver mirror is built after NVML starts); loading "
                "the host's %s (%s in --driver-root=%s) this time",
                path,
                found,
                entry.value,
                config.driver_root,
            )
            return str(found)
    return path
