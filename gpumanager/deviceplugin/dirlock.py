"""The agent's lock (flock) on the directory it serves its sockets in, kept on the directory at that path.

The command line locks the directories the agent serves or writes in (--device-plugin-path and
--virtual-manager-path; --dra-plugin-path in DRA mode) before the agent serves, so that a second agent waits
instead of replacing the first one's sockets and files. A directory removed and made again (a kubelet reinstalled,
an operator's rm -rf) is another directory: a lock on the removed one guards nothing. :meth:`follow` moves
the lock to the directory at the path now, or says (once) that another process locked it first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

#: Where the kernel lists the file locks held (the pids as this process's PID namespace sees them).
PROC_LOCKS = Path("/proc/locks")


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def lock_holders(st: os.stat_result, locks_file: Path = PROC_LOCKS) -> list[int]:
    """The pids that hold a flock on the file ``st`` describes, as /proc/locks lists them (empty when
    unknown: no /proc, or holders in a PID namespace this process does not see, which it lists as 0)."""
    try:
        text = locks_file.read_text(errors="replace")
    except OSError:
        return []
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a waiter's line has "->" after the number.
        if "->" in fields[:2] or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        pid, file = fields[4], fields[5]
        if file == wanted and pid.isdigit() and int(pid) > 0:
            pids.append(int(pid))
    return pids


class DirectoryLock:
    """An exclusive flock on the directory at ``path``, moved to a directory made again there.

    ``held``: the descriptors the process locked at its start (those of other directories are left
    alone); the one of ``path``'s directory is taken over, and closed once the lock has moved. Without
    one (a file system without locks, the directory locked as another one, an agent not started from the
    command line) the directory at ``path`` now counts as held.
    """

    def __init__(self, path: Path, what: str, held: Iterable[int] = ()) -> None:
        self.path = path
        self._what = what  # "--device-plugin-path=DIR", as the log names it
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self._refused: tuple[int, int] | None = None  # the directory another process holds (logged)
        try:
            now = _identity(os.stat(path))
        except OSError:
            return
        self._identity = now
        for fd in held:
            with contextlib.suppress(OSError):
                if _identity(os.fstat(fd)) == now:
                    self._fd = fd
                    break

    @property
    def held(self) -> bool:
        """Whether the directory at the path is the one this process holds (as of the last :meth:`follow`)."""
        return self._refused is None

    def follow(self) -> bool:
        """Whether this process holds the directory at the path (True also when none is there, or when it
        cannot be locked at all); a directory made again there is locked now, the old lock let go. When
        another process holds it, that is logged once (the directory and the holder) and False returned
        until it lets go: the caller leaves that directory to it."""
        try:
            st = os.stat(self.path)
        except OSError:
            return True  # nothing there: whoever makes it (the servers, before they listen) locks it first
        now = _identity(st)
        if now == self._identity:
            return True
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("cannot open %s to lock it (%s); serving there unlocked", self._what, exc.strerror)
            self._moved(None, now)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if self._refused != now:
                self._refused = now
                holders = [p for p in lock_holders(st) if p != os.getpid()]
                who = ", ".join(f"pid {p}" for p in holders) if holders else "pid unknown"
                log.error(
                    "another gpu-manager (%s) holds the lock of %s, made again since this agent locked it; "
                    "not serving or registering there while it holds it (the kubelet talks to that agent; "
                    "stop one of the two)",
                    who,
                    self._what,
                )
            return False
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                log.warning("cannot lock %s (%s); serving there unlocked", self._what, exc.strerror)
            self._moved(None, now)
            return True
        if self._refused is not None:
            log.info("took the lock of %s: the other gpu-manager has let it go", self._what)
        elif self._identity is not None:
            log.info("%s was made again; its lock moved to the new directory", self._what)
        self._moved(fd, now)
        return True

    def _moved(self, fd: int | None, identity: tuple[int, int]) -> None:
        old, self._fd, self._identity, self._refused = self._fd, fd, identity, None
        if old is not None:
            with contextlib.suppress(OSError):
                os.close(old)

    def make_and_follow(self, mode: int = 0o750) -> bool:
        """:meth:`follow`, the directory made first when it is missing (as the servers make it before they
        listen there): a directory made by this agent is locked before anything is served or written in it."""
        with contextlib.suppress(OSError):
            self.path.mkdir(mode=mode, parents=True, exist_ok=True)
        return self.follow()

    def close(self) -> None:
        """Let the lock go (the process's exit does too)."""
        self._moved(None, (0, 0))
