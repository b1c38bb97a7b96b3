"""Paths of the driver root: the host's ``/`` as mounted in the agent (``/usr/local/host`` in the image).

Paths inside the host's ``ld.so.cache`` and its symlinks are host paths; they are resolved here
as if the driver root were ``/``, so an absolute symlink such as ``/lib64 -> /usr/lib64`` stays
inside the root instead of pointing into the agent's own image.
"""

from __future__ import annotations

import logging
import os
import stat
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from gpumanager.volume.errors import VolumeError

log = logging.getLogger(__name__)

MAX_SYMLINKS = 40  # as the kernel's path walk
DEFAULT_SEARCH_PATH = (
    "/usr/local/nvidia/bin",
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
)


class ResolveError(VolumeError):
    """A host path cannot be resolved inside the driver root (missing file, dangling link, loop)."""


class DriverRoot:
    """The host file system seen through ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def agent_path(self, host_path: str) -> Path:
        """Where the host path ``host_path`` is seen by the agent."""
        return self.root / host_path.lstrip("/")

    def resolve(self, host_path: str) -> str:
        """Resolve every symlink of ``host_path`` inside the root; returns the host path of the final file.

        Raises ResolveError when a component is missing (a dangling link included) or links loop.
        """
        pending = deque(part for part in host_path.split("/") if part)
        resolved: list[str] = []
        followed = 0
        while pending:
            part = pending.popleft()
            if part == ".":
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            candidate = self.root.joinpath(*resolved, part)
            try:
                mode = os.lstat(candidate).st_mode
            except FileNotFoundError:
                raise ResolveError(f"{host_path}: {'/' + '/'.join([*resolved, part])} does not exist") from None
            except OSError as err:
                raise ResolveError(f"{host_path}: cannot stat {candidate}: {err.strerror or err}") from err
            if not stat.S_ISLNK(mode):
                resolved.append(part)
                continue
            followed += 1
            if followed > MAX_SYMLINKS:
                raise ResolveError(f"{host_path}: too many levels of symbolic links")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved.clear()
            pending.extendleft(reversed([p for p in target.split("/") if p]))
        return "/" + "/".join(resolved)

    def find_binary(self, name: str, search_path: Sequence[str] = DEFAULT_SEARCH_PATH) -> str | None:
        """The resolved host path of the first executable regular file ``name`` on ``search_path``."""
        for directory in search_path:
            try:
                found = self.resolve(f"{directory.rstrip('/')}/{name}")
            except ResolveError:
                continue
            agent = self.agent_path(found)
            try:
                st = os.stat(agent)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
                return found
        return None
