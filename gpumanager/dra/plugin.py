"""The kubelet-facing sockets of DRA mode, kept served across kubelet restarts.

``<plugin-registry-path>/<driver>-reg.sock`` serves ``pluginregistration.Registration``
(the kubelet's plugin watcher finds it, calls ``GetInfo`` and reports the outcome
with ``NotifyRegistrationStatus``); ``<dra-plugin-path>/dra.sock`` serves the DRA
plugin services (v1 and v1beta1) and ``DRAResourceHealth``. Both listen before the
registration socket appears, so the kubelet never dials a socket that is not served.

A watch loop checks every ``watch_period`` that both socket files are still ours
(same device and inode): when either was removed or replaced (a kubelet restart
that cleaned its directories, an operator), both are served again, in this process,
and the kubelet's plugin watcher registers us again.

The kubelet registers the driver (we cannot ask it to): when it has not done so
``registration_wait`` seconds after the sockets were served, ``on_overdue`` is called
once (the agent logs it and reports it until the kubelet registers the driver); the
sockets stay served meanwhile, and the wait starts again whenever they are served again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpumanager.deviceplugin.dirlock import DirectoryLock
from gpumanager.deviceplugin.server import check_bindable, socket_identity

log = logging.getLogger(__name__)

Register = Callable[[grpc.Server], None]


@dataclass
class RegistrationState:
    """What the kubelet last told us (read by /readyz and metrics)."""

    registered: bool = False
    notifications: int = 0
    #: Registrations the kubelet confirmed (gpu_manager_kubelet_registrations_total in DRA mode).
    registrations: int = 0
    last_error: str = ""
    server_restarts: int = 0
    info_calls: int = 0
    history: list[float] = field(default_factory=list)


def _identity(path: Path) -> tuple[int, int] | None:
    """:func:`socket_identity`, None also where the path cannot be looked at (its directory replaced by a
    file): no socket of ours is there."""
    try:
        return socket_identity(path)
    except OSError:
        return None


class _Socket:
    def __init__(self, path: Path, register: Sequence[Register], executor: futures.ThreadPoolExecutor) -> None:
        self.path = path
        self._register = register
        self._executor = executor
        self._server: grpc.Server | None = None
        self.identity: tuple[int, int] | None = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        check_bindable(self.path)
        server = grpc.server(self._executor)
        for register in self._register:
            register(server)
        server.add_insecure_port(f"unix://{self.path}")
        server.start()
        self._server = server
        self.identity = socket_identity(self.path)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait(2.0)
            self._server = None
        if self.identity is not None and _identity(self.path) == self.identity:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        self.identity = None

    def intact(self) -> bool:
        return self.identity is not None and _identity(self.path) == self.identity


class DRAPluginSockets:
    """Serves the registration socket and dra.sock; re-serves them when they disappear."""

    def __init__(
        self,
        *,
        registration_socket: Path,
        service_socket: Path,
        register_registration: Register,
        register_services: Sequence[Register],
        watch_period: float = 0.1,
        max_workers: int = 16,
        registration_wait: float = 0.0,
        on_overdue: Callable[[], None] | None = None,
        on_pass: Callable[[], None] | None = None,
        dir_lock: DirectoryLock | None = None,
    ) -> None:
        """``dir_lock``: the agent's lock on the service socket's directory (--dra-plugin-path), moved to
        that directory when it is made again, before the sockets are served there; while another agent
        holds it, neither socket is served (the kubelet talks to that agent)."""
        self._dir_lock = dir_lock
        self.registration_socket = registration_socket
        self.service_socket = service_socket
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="dra")
        self._service = _Socket(service_socket, register_services, self._executor)
        self._registration = _Socket(registration_socket, [register_registration], self._executor)
        self._period = watch_period
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.state = RegistrationState()
        self.registered_event = threading.Event()
        self._registration_wait = registration_wait  # 0: never overdue
        self._on_overdue = on_overdue
        self._served_at = 0.0  # monotonic time the sockets were last served
        self._overdue_told = False  # on_overdue was called since they were served
        self._on_pass = on_pass  # called after each pass of the watch
        #: Why the sockets could not be served again at the last pass ('' while they are served).
        self.unserved = ""

    # -- registration status (called by the Registration servicer) -----------------------------

    def on_status(self, registered: bool, error: str) -> None:
        """NotifyRegistrationStatus from the kubelet."""
        self.state.notifications += 1
        self.state.registered = registered
        if registered:
            self.state.registrations += 1
            self.state.last_error = ""
            self.state.history.append(time.monotonic())
            del self.state.history[:-100]
            self.registered_event.set()
            log.info("registered with the kubelet as a DRA driver")
        else:
            self.state.last_error = error or "the kubelet refused the registration without a reason"
            self.registered_event.clear()
            log.error("the kubelet refused our DRA registration: %s", self.state.last_error)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve dra.sock, then the registration socket; start the watch loop."""
        self._serve()
        self._thread = threading.Thread(target=self._run, name="dra-socket-watch", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._service.start()
        self._registration.start()
        self._served_at = time.monotonic()
        self._overdue_told = False
        log.info("serving DRA on %s (registration %s)", self.service_socket, self.registration_socket)

    def stop(self) -> None:
        """Stop serving and remove our sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._registration.stop()
        self._service.stop()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def alive(self) -> bool:
        """Whether the watch loop runs."""
        return self._thread is not None and self._thread.is_alive()

    def overdue(self) -> bool:
        """Whether the kubelet has not registered the driver ``registration_wait`` seconds after the sockets
        were served (False while that wait runs, and when there is none)."""
        return (
            self._registration_wait > 0
            and self._served_at > 0
            and not self.registered_event.is_set()
            and time.monotonic() - self._served_at >= self._registration_wait
        )

    def _next_look(self) -> float:
        """Seconds to the next pass: the watch period, or less when the registration wait ends sooner."""
        if self._overdue_told or self._registration_wait <= 0 or self.registered_event.is_set():
            return self._period
        left = self._served_at + self._registration_wait - time.monotonic()
        return min(self._period, max(left, 0.0))

    def _run(self) -> None:
        while not self._stop.wait(self._next_look()):
            self._pass()
            if self._on_pass is not None:
                try:
                    self._on_pass()
                except Exception:
                    log.exception("DRA socket watch: the check after its pass failed; continuing")

    def _pass(self) -> None:
        """One pass of the watch: serve the sockets again where they were removed; tell an overdue registration."""
        unserved = self.unserved  # said once
        try:
            if not self._own_directory():
                return
            if not (self._service.intact() and self._registration.intact()):
                if not unserved:
                    log.info("a DRA socket was removed (kubelet restart?); serving both again")
                self.state.registered = False
                self.registered_event.clear()
                self._registration.stop()
                self._service.stop()
                try:
                    self._serve()
                except (OSError, RuntimeError) as exc:  # its directory cannot be made, the bind refused
                    why = (
                        f"cannot serve the DRA sockets again ({self.service_socket}, {self.registration_socket}): "
                        f"{exc}; the kubelet cannot call the driver until they can be served (tried again "
                        "every pass)"
                    )
                    if why != unserved:
                        log.error("%s", why)
                    self.unserved = why
                    return
                if unserved:
                    log.info("DRA sockets served again after: %s", unserved)
                self.unserved = ""
                self.state.server_restarts += 1
            if not self._overdue_told and self.overdue():
                self._overdue_told = True
                if self._on_overdue is not None:
                    self._on_overdue()
        except Exception:
            log.exception("DRA socket watch failed; continuing")
            self._stop.wait(1.0)

    def _own_directory(self) -> bool:
        """Whether this agent holds the lock of the directory at the service socket's path (made, when
        missing, and locked before anything is served there). While another agent holds it, this one's
        sockets are closed (that agent serves the driver) and :attr:`unserved` says why; the lock says it
        once in the log."""
        lock = self._dir_lock
        if lock is None or lock.make_and_follow(0o750):
            return True
        if self._service.identity is not None or self._registration.identity is not None:
            self.state.registered = False
            self.registered_event.clear()
            self._registration.stop()
            self._service.stop()
        self.unserved = f"another gpu-manager holds the lock of --dra-plugin-path={lock.path}"
        return False


def socket_paths(registry: str, plugin_path: str, driver: str) -> tuple[Path, Path]:
    """(registration socket, service socket)."""
    from gpumanager.dra import constants as c

    return Path(registry) / f"{driver}-reg.sock", Path(plugin_path) / c.DRA_SOCKET
