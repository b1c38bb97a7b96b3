"""Waiting for changes in the device-plugin directory (inotify), so a kubelet restart is seen at once."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from collections.abc import Iterable
from pathlib import Path

from inotify_simple import INotify, flags

log = logging.getLogger(__name__)

#: After changes of other entries only, how long until the directory is looked at once more
#: (:meth:`DirectoryWatch.wait`).
RECHECK_SECONDS = 0.1

_EVENTS = flags.CREATE | flags.DELETE | flags.MOVED_TO | flags.MOVED_FROM | flags.DELETE_SELF | flags.MOVE_SELF


class DirectoryWatch:
    """inotify on one directory; :meth:`wait` returns on a change, a timeout, or :meth:`wake`.

    ``names``: the entries whose changes count (and changes to the directory itself); a change to any
    other entry is read and dropped, and :meth:`wait` goes on waiting. The kubelet rewrites its
    ``kubelet_internal_checkpoint`` in the device-plugin directory (a temporary file and a rename) on
    every allocation: the caller's loop, woken for each, would compete with the calls being answered.
    None: every entry counts.

    Without inotify (or when the directory cannot be watched) :meth:`wait` simply sleeps: the
    caller's own periodic check still sees every change, later.
    """

    def __init__(self, directory: Path, names: Iterable[str] | None = None) -> None:
        self._dir = directory
        self._names = None if names is None else frozenset(names)
        self._wake_r, self._wake_w = os.pipe()
        self._inotify: INotify | None = None
        self._watching = False
        self._wd: int | None = None
        # (device, inode) of the directory watched: one removed while a process holds it open (the
        # agent's lock on it) lives on without an entry, and its watch gets no DELETE_SELF.
        self._identity: tuple[int, int] | None = None
        self._tracked: set[str] = set()  # names take_created was asked about
        self._created: set[str] = set()  # of those, the ones made or moved in since the last take_created
        try:
            self._inotify = INotify(nonblocking=True)
        except OSError as exc:
            log.warning("inotify unavailable (%s); checking %s periodically only", exc, directory)
        self._arm()

    def _arm(self) -> None:
        if self._inotify is None:
            return
        try:
            st = os.stat(self._dir)  # before the watch is added: a directory swapped meanwhile differs
            identity: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            identity = None
        if self._watching:
            if identity == self._identity:
                return
            # Removed (or replaced) while held open somewhere: the watch is on a directory without an
            # entry, which no one makes files in any more.
            log.info("%s was removed or replaced; watching it again", self._dir)
            self._watching = False
            if self._wd is not None:
                with contextlib.suppress(OSError):
                    self._inotify.rm_watch(self._wd)
                self._wd = None
        if identity is None:
            return
        try:
            self._wd = self._inotify.add_watch(str(self._dir), _EVENTS)
            self._watching = True
            self._identity = identity
        except OSError as exc:
            log.debug("cannot watch %s yet: %s", self._dir, exc)

    def wait(self, timeout: float, *, every: bool = False) -> bool:
        """Block until something that counts changes in the directory (True), or ``timeout`` /
        :meth:`wake` (False). ``every``: any entry's change counts this time (another process's sockets,
        whose names this watch does not know)."""
        self._arm()
        # The inotify descriptor even while nothing is watched: events of a watch just dropped are still read.
        fds = [self._wake_r] + ([self._inotify.fileno()] if self._inotify is not None else [])
        deadline = time.monotonic() + max(0.0, timeout)
        recheck: float | None = None  # when to look again whether the directory is still the one watched
        while True:
            until = deadline if recheck is None else min(deadline, recheck)
            try:
                ready, _, _ = select.select(fds, [], [], max(0.0, until - time.monotonic()))
            except (OSError, ValueError):
                return False
            changed = dropped = False
            if self._inotify is not None and self._inotify.fileno() in ready:
                for event in self._inotify.read(timeout=0):
                    name = event.name
                    if (
                        not every
                        and self._names is not None
                        and name
                        and name not in self._names
                        and name not in self._tracked
                    ):
                        dropped = True  # another entry's change (the queue overflowing has no name: it counts)
                        continue
                    changed = True
                    if event.mask & (flags.CREATE | flags.MOVED_TO) and event.name in self._tracked:
                        self._created.add(event.name)
                    if event.mask & (flags.DELETE_SELF | flags.MOVE_SELF | flags.IGNORED) and event.wd == self._wd:
                        self._watching = False  # the directory itself went away: watch it again when it is back
            if not changed and self._watching and (dropped or (recheck is not None and not ready)):
                # Removed (or made again) while held open (the agent's lock), the directory gets no DELETE_SELF,
                # and the last changes seen may all be of other entries: its own removal comes just after them
                # (``rm -r``), so it is looked at now and once more a moment later. Counts as a change: the
                # caller's next wait watches the new one.
                if self._replaced():
                    changed = True
                else:
                    recheck = time.monotonic() + RECHECK_SECONDS if dropped else None
            woken = self._wake_r in ready
            if woken:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 64)
            if changed or woken or (ready and not dropped) or time.monotonic() >= deadline:
                return changed

    def _replaced(self) -> bool:
        """Whether the directory at the path is no longer the one watched (gone, or made again)."""
        try:
            st = os.stat(self._dir)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity

    def take_created(self, name: str) -> bool:
        """Whether an entry ``name`` was made (or moved) in the directory since the last call, as read by
        :meth:`wait`: a file made again under the inode number and the change time of the one removed (a
        delete and a create within one clock tick) is still seen as new here. Names are followed from their
        first call on (and count as changes from then on, whatever ``names`` the watch was made with)."""
        self._tracked.add(name)
        if name in self._created:
            self._created.discard(name)
            return True
        return False

    def wake(self) -> None:
        """Make a pending :meth:`wait` return now."""
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Release the inotify instance and the pipe."""
        if self._inotify is not None:
            with contextlib.suppress(OSError):
                self._inotify.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
