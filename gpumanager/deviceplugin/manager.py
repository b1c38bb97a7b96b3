"""Keeps both device-plugin servers registered with the kubelet, across kubelet restarts.

The kubelet wipes every socket in the device-plugin directory when it starts and
then re-creates ``kubelet.sock``. A watch loop wakes on inotify events of that
directory (and, as a safety net, every ``watch_period``) and compares the
identity of ``kubelet.sock`` and of our own sockets: when ours is gone or
replaced the servers serve again at once, and when the kubelet's is re-created,
or ours were restarted, both resources register again, in this process. Until
the kubelet answers, registration is retried with the agent's jittered backoff
and each change of state is logged once. Two things cut that wait short: a
``kubelet.sock`` made since the failed try (a new kubelet, even one whose socket
got the inode number and change time of the one before), and a socket that
refused the connection (a kubelet between its bind and its listen), which is
tried again within milliseconds a few times before the backoff applies. A
Register the kubelet leaves unanswered ends once its socket is made again or
removed (:func:`~gpumanager.deviceplugin.registration.register`), counted as
unreachable, and the new kubelet is asked at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.deviceplugin.dirwatch import DirectoryWatch
from gpumanager.deviceplugin.registration import REGISTER_DEADLINE, Endpoint, RegistrationError, register
from gpumanager.deviceplugin.server import PluginServer, socket_identity, socket_served
from gpumanager.retry import Backoff

log = logging.getLogger(__name__)


def _changed_at(path: Path) -> int | None:
    """The file's change time (ns), None when it does not exist: a file made again under the inode
    number of one removed has a later one."""
    try:
        return os.stat(path).st_ctime_ns
    except OSError:
        return None


#: How long our removed socket is watched for another process that listens at its path, when the
#: kubelet's own socket has not changed (no kubelet restart), before we serve there again.
TAKEOVER_GRACE_SECONDS = 0.2

#: A Register whose connection the kubelet's socket refused (nothing listens there yet) is tried again
#: after this, doubling, this many times before the registration backoff applies: a kubelet's socket
#: exists from its bind, a moment before its listen (longer on a busy node), and no file event tells
#: when it listens. A dead kubelet's socket costs these few refused connections (as does a Register
#: left unanswered by a kubelet whose socket was made again: the new one is asked at once regardless).
QUICK_RETRY_FIRST = 0.01
QUICK_RETRIES = 6

#: How long, after the first registration, the directory watch waits for the kubelet's first full
#: ListAndWatch of every resource before it is opened.
FIRST_LISTS_SECONDS = 1.0


@dataclass
class RegistrationStatus:
    """What the manager has achieved so far; read by /healthz and metrics."""

    registered: bool = False
    registrations: int = 0
    server_restarts: int = 0
    last_error: str = ""
    last_registered_at: float = 0.0
    history: list[float] = field(default_factory=list)


class PluginManager:
    """Runs the plugin servers and the registration/watch loop."""

    def __init__(
        self,
        servers: Sequence[PluginServer],
        kubelet_socket: Path,
        *,
        options_for: Callable[[PluginServer], pb.DevicePluginOptions],
        watch_period: float = 5.0,
        register_timeout: float = REGISTER_DEADLINE,
        dir_lock: DirectoryLock | None = None,
        also_follow: Sequence[DirectoryLock] = (),
    ) -> None:
        """``dir_lock``: the agent's lock on the directory of the sockets (see :mod:`.dirlock`), moved to
        that directory when it is made again; None when nothing locks it. ``also_follow``: the agent's
        locks on other directories it writes in (--virtual-manager-path), moved at each pass of the watch
        loop too, so that a directory made again there is locked within a period even while nothing is
        written in it (its writers follow the lock too before they write)."""
        self._servers = list(servers)
        self._dir_lock = dir_lock
        self._also_follow = tuple(also_follow)
        self._kubelet_socket = kubelet_socket
        self._options_for = options_for
        self._period = watch_period
        self._register_timeout = register_timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.status = RegistrationStatus()
        self.registered_event = threading.Event()
        self._watch: DirectoryWatch | None = None
        self._yielded = False  # another process serves at one of our socket paths
        self._kubelet_changed: int | None = None  # change time (ns) of the kubelet.sock registered with
        self._restarted: list[Callable[[], object]] = []  # on_kubelet_restart

    def on_kubelet_restart(self, listener: Callable[[], object]) -> None:
        """``listener()`` (from the watch thread) once registered again with a kubelet whose ``kubelet.sock``
        was re-created since the last registration (a kubelet restart): it has read its checkpoint by then.
        Not for the first registration of this process."""
        self._restarted.append(listener)

    def start(self) -> None:
        """Start serving and the watch loop; returns at once (registration proceeds in the background)."""
        for s in self._servers:
            s.start()
        self._thread = threading.Thread(target=self._run, name="kubelet-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Remove our sockets and stop the servers and the loop (a registration in flight is not waited for)."""
        with self._lock:
            self._stop.set()
            watch = self._watch
        if watch is not None:
            watch.wake()
        for s in self._servers:
            s.close()
        if self._thread is not None:
            self._thread.join(timeout=0.5)
        if watch is not None:
            watch.close()

    def _open_watch(self) -> None:
        directory = self._kubelet_socket.parent
        with self._lock:
            if self._stop.is_set():
                return
            # The loop looks at the kubelet's socket and ours: the rest of the directory (the kubelet's
            # checkpoint, rewritten at every allocation, other plugins' sockets) does not wake it.
            watched = {self._kubelet_socket.name, *(s.socket_path.name for s in self._servers)}
            try:
                self._watch = DirectoryWatch(directory, watched)
            except OSError as exc:
                log.warning("cannot watch %s (%s); checking it every %g s only", directory, exc, self._period)

    def wait_listed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the kubelet is registered with and has been sent the full
        device list of every resource on a ListAndWatch stream; whether it has (False also on stop).

        Work that competes for the interpreter (loading modules, a subprocess) waits for this: started
        as soon as Register returned, it held up the kubelet's dial-back, GetDevicePluginOptions and the
        first lists by tens of milliseconds."""
        deadline = time.monotonic() + timeout
        events = [self.registered_event, *(s.servicer.first_list_sent for s in self._servers)]
        for event in events:
            while not event.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                event.wait(min(left, 0.05))  # looks at the stop between waits
        return True

    def alive(self) -> bool:
        """Whether the watch loop is running."""
        return self._thread is not None and self._thread.is_alive()

    # -- the loop -----------------------------------------------------------------------------------

    def _restart_servers(self) -> None:
        # Under the lock: a stop meanwhile waits for it, then closes what it served (never the reverse,
        # which would leave a server and its socket behind the stopped agent).
        with self._lock:
            if self._stop.is_set():
                return
            if self._dir_lock is not None:
                # The directory made (as the servers would) and locked before anything listens there: a
                # second agent started meanwhile waits for this one; one that locked it first keeps it.
                with contextlib.suppress(OSError):
                    self._dir_lock.path.mkdir(mode=0o750, parents=True, exist_ok=True)
                if not self._dir_lock.follow():
                    return
            for s in self._servers:
                if not s.socket_intact():
                    s.restart()
            self.status.server_restarts += 1

    def _serve_intact(self) -> None:
        if not all(s.socket_intact() for s in self._servers):
            self._restart_servers()

    def _tell_restarted(self) -> None:
        for listener in list(self._restarted):
            try:
                listener()
            except Exception:
                log.exception("handling the kubelet's restart failed; continuing")

    def _register_all(self) -> tuple[int, int]:
        """Register every resource; return the identity of the ``kubelet.sock`` that answered."""
        # A stopped server's listener removes its socket path as it goes, possibly after a new
        # server took the path; and a kubelet restarting since this pass looked wipes our sockets
        # before it makes the kubelet.sock dialled. Checked once that socket is held, just before
        # the dial: a socket of ours gone then, and not served again, has the kubelet's dial-back
        # retry for up to 10 s while this loop waits for the Register.
        endpoints = [Endpoint(s.socket_path.name, s.servicer.resource, self._options_for(s)) for s in self._servers]
        return register(self._kubelet_socket, endpoints, timeout=self._register_timeout, before_dial=self._serve_intact)

    def _yield_to_other(self, taken: Sequence[PluginServer]) -> None:
        """Another process serves at our socket path (a second agent on the node): the kubelet talks to it
        now. Taking the path back would start a fight in which each removes the other's socket and
        registers again; we wait until that socket is gone instead."""
        message = (
            f"another process serves {', '.join(str(s.socket_path) for s in taken)} (a second gpu-manager on "
            "this node?); not taking it back while it is served"
        )
        if not self._yielded:
            log.warning("%s", message)
        self._yielded = True
        self.status.registered = False
        self.status.last_error = message
        self.registered_event.clear()

    def _own_directory(self) -> bool:
        """Whether this agent holds the lock of the directory at the sockets' path (moved there when that
        directory was made again): when another agent locked it first, the kubelet talks to that one, and
        this one neither serves nor registers there until it lets go (said once, by the lock)."""
        lock = self._dir_lock
        if lock is None or lock.follow():
            return True
        self.status.registered = False
        self.status.last_error = f"another gpu-manager holds the lock of {lock.path}"
        self.registered_event.clear()
        with self._lock:
            for s in self._servers:
                # Served there a moment before it was swapped for the one locked: not ours to serve in.
                if s.socket_intact():
                    with contextlib.suppress(OSError):
                        s.socket_path.unlink()
        return False

    def _set_error(self, message: str) -> None:
        if message != self.status.last_error:
            log.warning("not registered with the kubelet: %s (retrying)", message)
        self.status.last_error = message

    def _wait(self, timeout: float, *, every: bool = False) -> None:
        if self._watch is not None:
            self._watch.wait(timeout, every=every)
        else:
            self._stop.wait(timeout)

    def _await_takeover(self, broken: list[PluginServer], kubelet_id: tuple[int, int] | None) -> None:
        """Wait up to :data:`TAKEOVER_GRACE_SECONDS` for another process to listen at a removed socket's
        path; returns at once when the kubelet's socket is not the one we registered with (a restart):
        another file, or one made again under the same inode number (its change time tells it apart)."""
        deadline = time.monotonic() + TAKEOVER_GRACE_SECONDS
        while not self._stop.is_set():
            if kubelet_id is None or socket_identity(self._kubelet_socket) != kubelet_id:
                return
            if _changed_at(self._kubelet_socket) != self._kubelet_changed:
                return
            if any(socket_served(s.socket_path) for s in broken):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            # Looked at every 20 ms, not on the directory watch: the watch's events are the loop's, and a
            # kubelet.sock made again under the same inode number looks unchanged (the grace then runs out).
            self._stop.wait(min(left, 0.02))

    def _run(self) -> None:
        need_register = True
        watch_opened = False
        next_try = 0.0
        quick = 0  # quick retries made since the last registration or the last new kubelet.sock
        backoff = Backoff()
        kubelet_id = socket_identity(self._kubelet_socket)
        self._kubelet_changed = _changed_at(self._kubelet_socket)
        restarted = False  # kubelet.sock re-created since the last registration (on_kubelet_restart)
        while not self._stop.is_set():
            try:
                for other in self._also_follow:
                    other.make_and_follow(0o755)
                if not self._own_directory():
                    need_register = True
                    # Woken by the directory's changes (the other agent's exit: its sockets, whatever their names).
                    self._wait(self._period, every=True)
                    continue
                broken = [s for s in self._servers if not s.socket_intact()]
                # Served by someone else: another plugin at our path. A kubelet restart empties the
                # directory, kubelet.sock included, and the kubelet waits on us to serve again: at once.
                # Our socket removed while the kubelet's stays the one we registered with is no kubelet
                # restart but another plugin about to listen at the path (it removes the file a moment
                # before): watched for that moment, unless the kubelet's socket changes meanwhile.
                if broken and not any(socket_served(s.socket_path) for s in broken):
                    self._await_takeover(broken, kubelet_id)
                taken = [s for s in broken if socket_served(s.socket_path)]
                if taken:
                    self._yield_to_other(taken)
                    need_register = True
                elif broken:
                    if self._yielded:
                        log.info("the other device plugin's socket is gone; serving ours again")
                        self._yielded = False
                    else:
                        log.info("our device-plugin socket was removed (kubelet restart?); serving again")
                    self._restart_servers()
                    need_register, next_try = True, 0.0
                current = socket_identity(self._kubelet_socket)
                changed_at = _changed_at(self._kubelet_socket)
                created = self._watch is not None and self._watch.take_created(self._kubelet_socket.name)
                renewed = current != kubelet_id
                if not renewed and need_register and current is not None:
                    # A try failed (or is due): a kubelet.sock made since the look before it is a new
                    # kubelet to try at once, not after the backoff, though it may have the old one's
                    # inode number (the file system reuses it), and even its change time (a delete and a
                    # create within one tick of the kernel's clock): the directory watch saw it made.
                    renewed = changed_at != self._kubelet_changed or created
                if renewed:
                    if current is not None:
                        log.info("%s was (re)created; registering again", self._kubelet_socket)
                        need_register, next_try, quick = True, 0.0, 0
                        restarted = restarted or self.status.registrations > 0
                    else:
                        log.info("%s disappeared; waiting for the kubelet", self._kubelet_socket)
                        self.status.registered = False
                        self.registered_event.clear()
                    kubelet_id = current
                    self._kubelet_changed = changed_at
                now = time.monotonic()
                holds = self._dir_lock is None or self._dir_lock.held
                if need_register and not self._yielded and holds and now >= next_try:
                    try:
                        # The kubelet.sock that answered: it may have appeared since it was looked for
                        # above, even after the last look before the dial (a kubelet starting while we
                        # served again). The next pass then knows it as the one registered with, not as
                        # a kubelet to register with once more, which would drop the endpoint the
                        # kubelet has just dialled, and the calls on it.
                        # Its change time from before the dial: at worst older than the file dialled,
                        # which only ends a takeover grace early.
                        changed = _changed_at(self._kubelet_socket)
                        dialled = self._register_all()
                    except RegistrationError as exc:
                        self.status.registered = False
                        self.registered_event.clear()
                        self._set_error(str(exc))
                        # From the end of the attempt: a kubelet that took long to refuse is not asked
                        # again at once. A socket nothing listens at yet is looked at again within
                        # moments, a few times (see QUICK_RETRY_FIRST).
                        if exc.unreachable and quick < QUICK_RETRIES:
                            delay = QUICK_RETRY_FIRST * 2**quick
                            quick += 1
                        else:
                            delay = backoff.next_delay()
                        next_try = time.monotonic() + delay
                    else:
                        need_register, quick = False, 0
                        backoff.reset()
                        kubelet_id = dialled
                        self._kubelet_changed = changed
                        if self.status.last_error:
                            log.info("registered with the kubelet after: %s", self.status.last_error)
                        else:
                            log.info(
                                "registered %s with the kubelet",
                                ", ".join(s.servicer.resource for s in self._servers),
                            )
                        self.status.registered = True
                        self.status.registrations += 1
                        self.status.last_error = ""
                        self.status.last_registered_at = time.monotonic()
                        self.status.history.append(self.status.last_registered_at)
                        del self.status.history[:-100]
                        self.registered_event.set()
                        if restarted:
                            restarted = False
                            self._tell_restarted()
            except Exception:
                # Never exit to recover: log and keep watching.
                log.exception("device-plugin watch loop error; continuing")
                self._stop.wait(1.0)
            if self._stop.is_set():
                return
            if not watch_opened:
                watch_opened = True
                # Only after the first registration and the kubelet's first lists: opening it costs
                # 10 ms (inotify_simple finds the C library with ldconfig, a subprocess). A change
                # meanwhile is not missed: this pass runs again at once and compares the sockets with
                # those it saw. Not registered (no kubelet yet): opened at once, to see it come.
                if self.registered_event.is_set():
                    self.wait_listed(FIRST_LISTS_SECONDS)
                self._open_watch()
                continue
            timeout = self._period
            if need_register and not self._yielded:
                timeout = min(timeout, max(0.0, next_try - time.monotonic()))
            self._wait(timeout)
