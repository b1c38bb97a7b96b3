"""Registering again after a kubelet restart, whatever the order in which the kubelet's sockets come and go.

A kubelet restart leaves the agent's Register facing, one after the other: the dead kubelet's socket (the
file stays when the process dies; a connection is refused), no socket, and the new kubelet's, made under
the inode number of the old one as often as not (and, on kernels with tick-grained timestamps, with the
same change time). The new kubelet's socket exists from its bind, a moment before it listens. The agent
must register with the new kubelet as soon as it takes a Register, not after the registration backoff
(made 10 minutes here, so a registration that waits for it never comes within the test), and never make
two registrations at once.

The kubelet stand-in here is a gRPC Registration server on a path outside the device-plugin directory,
reached through a front socket at ``kubelet.sock`` that the test binds, listens on, accepts on and
closes when it chooses: the syscalls of a Go kubelet's ``net.Listen`` and its death, one at a time.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.deviceplugin import manager as manager_module
from gpumanager.deviceplugin.manager import PluginManager
from gpumanager.deviceplugin.server import PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer
from gpumanager.retry import Backoff
from simnode.kubelet import KubeletSimulator

RESOURCE = "example.com/r"
DEVICES = pb.ListAndWatchResponse(devices=[pb.Device(ID="r-0", health="Healthy")]).SerializeToString()
LONG_BACKOFF = 600.0
WITHIN = 20.0  # far below the backoff: a registration that waited for it never comes in this time
#: The kubelet's dial-back of a plugin's socket retries this long (the kubelet: 10 s): a Register whose
#: dial-back found no socket of ours fails only after it, beyond WITHIN.
DIAL_BACK = 3 * WITHIN


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for s in (src, dst):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)


class _Kubelet(pb_grpc.RegistrationServicer):
    """A kubelet's Registration server behind a front socket at ``kubelet.sock`` driven step by step."""

    def __init__(self, directory: Path, hidden: Path, *, refuse: int = 0) -> None:
        self.path = directory / "kubelet.sock"
        self._hidden = hidden
        self._refuse = refuse
        self.calls: list[str] = []  # resources of the Register calls that reached it
        self.accepted: list[str] = []
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix://{hidden}")
        self._server.start()
        self._front: socket.socket | None = None
        self._via: Path | None = None
        self._conns: list[socket.socket] = []

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        with self._cond:
            self.calls.append(request.resource_name)
            refuse = self._refuse > 0
            self._refuse -= 1 if refuse else 0
            if not refuse:
                self.accepted.append(request.resource_name)
            self._cond.notify_all()
        if refuse:
            context.abort(grpc.StatusCode.UNKNOWN, "not ready")
        return pb.Empty()

    def bind(self, *, via: Path | None = None) -> None:
        """Make the socket file (not listening yet); ``via``: bound there, for :meth:`place` to rename."""
        self._front = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._via = via
        self._front.bind(str(via or self.path))

    def place(self) -> None:
        """Rename the socket bound ``via`` another name into place (it keeps its inode)."""
        assert self._via is not None
        os.rename(self._via, self.path)

    def listen(self, *, accept_after: float = 0.0) -> None:
        """Listen; connections wait in the backlog ``accept_after`` seconds before they are served."""
        assert self._front is not None
        self._front.listen(16)
        threading.Thread(target=self._accept, args=(self._front, accept_after), daemon=True).start()

    def _accept(self, front: socket.socket, after: float) -> None:
        time.sleep(after)
        with contextlib.suppress(OSError):
            while True:
                conn, _ = front.accept()
                back = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                back.connect(str(self._hidden))
                with self._lock:
                    self._conns += [conn, back]
                threading.Thread(target=_pump, args=(conn, back), daemon=True).start()
                threading.Thread(target=_pump, args=(back, conn), daemon=True).start()

    def kill(self) -> None:
        """The process dies: its listener and connections close, the socket file stays."""
        if self._front is not None:
            with contextlib.suppress(OSError):
                self._front.shutdown(socket.SHUT_RDWR)
            self._front.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def wait_accepted(self, count: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self.accepted) >= count, timeout)

    def close(self) -> None:
        self.kill()
        self._server.stop(None)


@pytest.fixture(autouse=True)
def _long_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "Backoff", lambda: Backoff(LONG_BACKOFF, LONG_BACKOFF, jitter=0.0))


def _manager(directory: Path) -> tuple[PluginManager, PluginServer]:
    servicer = ResourceServicer(RESOURCE, devices=lambda: DEVICES, options=pb.DevicePluginOptions())
    server = PluginServer(servicer, directory / "r.sock")
    plugins = PluginManager(
        [server], directory / "kubelet.sock", options_for=lambda _s: pb.DevicePluginOptions(), watch_period=600.0
    )
    return plugins, server


def _wait(predicate: Callable[[], bool], what: str, timeout: float = WITHIN) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _fake_one_file(monkeypatch: pytest.MonkeyPatch, kubelet_socket: Path, change_time: bool) -> None:
    """Every kubelet.sock gets the inode number of the one before (and, with ``change_time``, its change
    time too: timestamps of the kernel's tick, a delete and a create within one tick)."""
    real_identity = manager_module.socket_identity
    real_register = manager_module.register

    def identity(path: Path) -> tuple[int, int] | None:
        found = real_identity(path)
        return (0, 1) if found is not None and path == kubelet_socket else found

    def register(*args: Any, **kwargs: Any) -> tuple[int, int]:
        real_register(*args, **kwargs)
        return (0, 1)

    monkeypatch.setattr(manager_module, "socket_identity", identity)
    monkeypatch.setattr(manager_module, "register", register)
    if change_time:
        real_changed = manager_module._changed_at

        def changed(path: Path) -> int | None:
            found = real_changed(path)
            return 1 if found is not None and path == kubelet_socket else found

        monkeypatch.setattr(manager_module, "_changed_at", changed)


@pytest.mark.parametrize(
    ("same", "renamed"),
    [
        ("nothing", False),
        ("inode", False),
        ("inode-and-change-time", False),
        ("inode", True),
        ("inode-and-change-time", True),
    ],
    ids=[
        "another-inode",
        "same-inode",
        "same-inode-and-change-time",
        "same-inode-renamed-into-place",
        "same-inode-and-change-time-renamed-into-place",
    ],
)
def test_a_register_refused_by_the_dead_kubelet_is_made_again_as_soon_as_the_new_one_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same: str, renamed: bool
) -> None:
    """The kubelet dies (its socket stays); the new one removes our socket first: we serve again and
    register with the dead socket, which refuses. Then the new kubelet removes that socket and makes its
    own, possibly under the same inode number and change time. That is a new kubelet to register with.
    Made in place, the loop may also see the moment with no socket (and pass without the fix it checks);
    renamed into place (one event, no such moment), the new socket is seen only as what it is."""
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    if renamed:
        # Listening before it is renamed into place, the new kubelet takes the first Register that reaches
        # it: the quick retries at a refusing socket, off here, are not what brings it.
        monkeypatch.setattr(manager_module, "QUICK_RETRIES", 0, raising=False)
    if same != "nothing":
        _fake_one_file(monkeypatch, directory / "kubelet.sock", same == "inode-and-change-time")
    old = _Kubelet(directory, tmp_path / "old.sock")
    old.bind()
    old.listen()
    plugins, ours = _manager(directory)
    new: _Kubelet | None = None
    plugins.start()
    try:
        assert old.wait_accepted(1, WITHIN)
        _wait(lambda: plugins.status.registered, "the first registration")
        old.kill()
        ours.socket_path.unlink()  # the new kubelet's clean-up
        _wait(lambda: "cannot reach" in plugins.status.last_error, "a Register refused by the dead socket")
        new = _Kubelet(directory, tmp_path / "new.sock")
        if not renamed:
            old.path.unlink()  # renamed: replaced in one step, no moment without a kubelet.sock
        if renamed:
            new.bind(via=directory / ".kubelet.sock.tmp")
            new.listen()
            new.place()
        else:
            new.bind()
            new.listen()
        assert new.wait_accepted(1, WITHIN), "registered with the new kubelet only after the backoff"
        _wait(lambda: plugins.status.registered, "the registration to be taken as done")
    finally:
        plugins.stop()
        old.close()
        if new is not None:
            new.close()


def test_a_kubelet_socket_that_listens_a_moment_after_its_bind_is_registered_with_when_it_listens(
    tmp_path: Path,
) -> None:
    """A kubelet's socket file appears at its bind, a moment before it listens (longer on a loaded node):
    a Register in between is refused. That is no kubelet refusing: it is tried again within moments."""
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    plugins, _ours = _manager(directory)
    kubelet = _Kubelet(directory, tmp_path / "k.sock")
    plugins.start()
    try:
        time.sleep(0.2)  # the loop waits for the kubelet on its directory watch
        kubelet.bind()
        _wait(lambda: "cannot reach" in plugins.status.last_error, "a Register refused before the listen")
        kubelet.listen()
        assert kubelet.wait_accepted(1, WITHIN), "registered only after the backoff"
    finally:
        plugins.stop()
        kubelet.close()


def test_a_kubelet_that_listens_but_serves_a_moment_later_is_registered_with_by_the_first_register(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    plugins, _ours = _manager(directory)
    kubelet = _Kubelet(directory, tmp_path / "k.sock")
    kubelet.bind()
    kubelet.listen(accept_after=0.5)
    plugins.start()
    try:
        assert kubelet.wait_accepted(1, WITHIN)
        _wait(lambda: plugins.status.registered, "the registration to be taken as done")
        assert kubelet.calls == [RESOURCE], "a Register waiting in the backlog was given up and made again"
        assert plugins.status.last_error == ""
    finally:
        plugins.stop()
        kubelet.close()


def test_a_kubelet_that_refuses_is_asked_again_only_after_the_backoff(tmp_path: Path) -> None:
    """A kubelet that answers with an error is no kubelet starting up: no quick retries at it."""
    directory = tmp_path / "device-plugins"
    directory.mkdir()
    plugins, _ours = _manager(directory)
    kubelet = _Kubelet(directory, tmp_path / "k.sock", refuse=1)
    kubelet.bind()
    kubelet.listen()
    plugins.start()
    try:
        _wait(lambda: "refused registration" in plugins.status.last_error, "the refusal")
        time.sleep(1.0)
        assert kubelet.calls == [RESOURCE], "asked again before the backoff"
    finally:
        plugins.stop()
        kubelet.close()


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


@contextlib.contextmanager
def _cpu_load(processes: int) -> Iterator[None]:
    stop = multiprocessing.get_context("spawn").Event()
    burners = [multiprocessing.get_context("spawn").Process(target=_burn, args=(stop,)) for _ in range(processes)]
    for p in burners:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in burners:
            p.join(10)


@pytest.mark.parametrize("load", [0, 3], ids=["idle", "cpu-load"])
def test_kubelet_restarts_in_quick_succession_are_each_registered_with_without_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, load: int
) -> None:
    """The kubelet restarts twice within a few milliseconds, ten times over, with the machine idle and with
    its CPUs busy: after each pair the agent is registered with the last kubelet, and never waited for
    the backoff; its registrations never overlap."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=DIAL_BACK, fill="sorted")
    kubelet.start()
    in_flight = [0]
    most = [0]
    lock = threading.Lock()
    real_register = manager_module.register

    def register(*args: Any, **kwargs: Any) -> Any:
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            return real_register(*args, **kwargs)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr(manager_module, "register", register)
    plugins, _ours = _manager(kubelet.plugin_dir)
    plugins.start()
    try:
        kubelet.wait_for_registration(RESOURCE, timeout=WITHIN, with_devices=True)
        with _cpu_load(load):
            for gap in (0.0, 0.002, 0.005, 0.01, 0.02, 0.0, 0.05, 0.001, 0.1, 0.0):
                kubelet.restart()
                time.sleep(gap)
                # The registration with the last kubelet: one the kubelet before it was still making
                # (dialling us back when its successor wiped the directory) may be recorded after.
                created = kubelet.restart()
                kubelet.wait_for_registration(RESOURCE, since=created, timeout=WITHIN, with_devices=True)
                _wait(lambda: plugins.status.registered, "the registration to be taken as done")
                time.sleep(0.05)
        assert most[0] == 1, "two registrations at once"
    finally:
        plugins.stop()
        kubelet.stop()


def test_a_kubelet_restart_between_our_look_at_our_socket_and_the_dial_serves_it_again_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our socket is removed; we serve it again and register, and the kubelet restarts in between (once
    we found our socket intact, before we dial kubelet.sock): the new kubelet's clean-up removed the socket
    served again. The Register reaches the new kubelet, which dials our socket back: it must be there (the
    kubelet retries its dial for 10 s, made longer here, and the loop waits on the Register meanwhile)."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=DIAL_BACK, fill="sorted")
    kubelet.start()
    armed = threading.Event()
    real_register = manager_module.register

    def register(*args: Any, **kwargs: Any) -> Any:
        if armed.is_set():
            armed.clear()
            kubelet.restart()
        return real_register(*args, **kwargs)

    monkeypatch.setattr(manager_module, "register", register)
    plugins, ours = _manager(kubelet.plugin_dir)
    plugins.start()
    try:
        kubelet.wait_for_registration(RESOURCE, timeout=WITHIN, with_devices=True)
        time.sleep(0.3)  # the loop waits on its directory watch
        before = kubelet.registration_count(RESOURCE)
        armed.set()
        ours.socket_path.unlink()
        kubelet.wait_for_registration(RESOURCE, after=before, timeout=WITHIN, with_devices=True)
        assert not armed.is_set()
    finally:
        plugins.stop()
        kubelet.stop()
