"""register(): which kubelet.sock a registration reached, and how it says why it failed."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.deviceplugin import registration
from gpumanager.deviceplugin.registration import Endpoint, RegistrationError, register

ENDPOINTS = [Endpoint("r.sock", "example.com/r", pb.DevicePluginOptions())]


class _Kubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc]
    """A Registration server that only counts the calls it answers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{path}")
        self.server.start()
        st = os.stat(path)
        self.identity = (st.st_dev, st.st_ino)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.calls += 1
        return pb.Empty()


@pytest.fixture
def kubelets(tmp_path: Path) -> Iterator[tuple[_Kubelet, _Kubelet]]:
    pair = (_Kubelet(tmp_path / "k1.sock"), _Kubelet(tmp_path / "k2.sock"))
    yield pair
    for k in pair:
        k.server.stop(None)


def _point(link: Path, target: Path) -> None:
    """Make ``link`` name ``target`` at once, as a kubelet re-creating its socket does."""
    tmp = link.with_name(link.name + ".new")
    os.symlink(target, tmp)
    os.replace(tmp, link)


class _LateCloses:
    """Stands in for ``registration.threading``: the channels a registration closes in the background
    stay open until the test ends, as a slow close leaves them."""

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def Thread(self, *, target: Any, name: str, daemon: bool) -> _LateCloses:
        self.pending.append(target)
        return self

    def start(self) -> None:
        pass


def test_each_registration_reaches_the_kubelet_whose_socket_it_returns(
    tmp_path: Path, kubelets: tuple[_Kubelet, _Kubelet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kubelet.sock is re-created between two registrations while the old kubelet still listens, and the
    first registration's channel is not closed yet. The second must reach the new kubelet: grpc's shared
    connections once carried it to the old one (same handle number, so the same target) while the new
    one's identity was returned, and the agent never registered with the new kubelet."""
    closes = _LateCloses()
    monkeypatch.setattr(registration, "threading", closes)
    sock = tmp_path / "kubelet.sock"
    try:
        for i in range(4):
            first, second = kubelets if i % 2 == 0 else kubelets[::-1]
            _point(sock, first.path)
            assert register(sock, ENDPOINTS, timeout=2) == first.identity
            _point(sock, second.path)
            before = (first.calls, second.calls)
            assert register(sock, ENDPOINTS, timeout=2) == second.identity
            assert (first.calls, second.calls) == (before[0], before[1] + 1), f"round {i}: the old kubelet answered"
    finally:
        for close in closes.pending:
            close()


def test_without_procfs_the_socket_path_is_dialled(
    tmp_path: Path, kubelets: tuple[_Kubelet, _Kubelet], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_exists = os.path.exists
    monkeypatch.setattr(
        registration.os.path, "exists", lambda p: False if str(p).startswith("/proc/") else real_exists(p)
    )
    sock = tmp_path / "kubelet.sock"
    _point(sock, kubelets[0].path)
    assert register(sock, ENDPOINTS, timeout=2) == kubelets[0].identity
    assert kubelets[0].calls == 1


def test_a_socket_nobody_listens_on_is_named_by_its_path(tmp_path: Path) -> None:
    sock = tmp_path / "kubelet.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock))  # left by a kubelet that is gone: connections are refused
    stale.close()
    with pytest.raises(RegistrationError) as caught:
        register(sock, ENDPOINTS, timeout=2)
    message = str(caught.value)
    assert f"cannot reach the kubelet at {sock}" in message
    assert "/proc/self/fd" not in message, "the handle's number changes from one try to the next: same outage, new text"


@pytest.mark.parametrize("kind", ["file", "directory", "fifo"])
def test_a_kubelet_socket_that_is_not_a_socket_is_named(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "kubelet.sock"
    if kind == "file":
        path.write_text("")
    elif kind == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    with pytest.raises(RegistrationError, match=f"kubelet socket {path} is not a socket"):
        register(path, ENDPOINTS, timeout=2)


def test_missing_and_unreadable_paths_are_registration_errors(tmp_path: Path) -> None:
    with pytest.raises(RegistrationError, match="does not exist"):
        register(tmp_path / "kubelet.sock", ENDPOINTS, timeout=2)
    with pytest.raises(RegistrationError, match="null byte"):
        register(tmp_path / "kube\0let.sock", ENDPOINTS, timeout=2)


class _Late(_Kubelet):
    """A kubelet that takes each Register and answers it ``after`` seconds later, or once released."""

    def __init__(self, path: Path, after: float = 60.0) -> None:
        self.received = threading.Event()
        self.release = threading.Event()
        self.after = after
        super().__init__(path)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.received.set()
        self.release.wait(self.after)
        self.calls += 1
        return pb.Empty()


@contextlib.contextmanager
def _replaced_while_registering(
    late: _Late, sock: Path, timeout: float, replace: Callable[[], object]
) -> Iterator[list[BaseException | tuple[int, int]]]:
    """register() with ``late`` at ``sock`` on a thread of its own; once ``late`` has the call, ``replace()``;
    yields what register() returned or raised once it ended."""
    _point(sock, late.path)
    outcome: list[BaseException | tuple[int, int]] = []

    def attempt() -> None:
        try:
            outcome.append(register(sock, ENDPOINTS, timeout=timeout))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    try:
        assert late.received.wait(10), "the kubelet never got the Register"
        replace()
        worker.join(10)
        assert not worker.is_alive(), "the registration still waits on the kubelet whose socket is gone"
        yield outcome
    finally:
        late.release.set()
        late.server.stop(None)


@pytest.mark.parametrize("replacement", ["another kubelet", "none yet"])
def test_a_registration_the_kubelet_never_answers_ends_when_its_socket_is_made_again(
    tmp_path: Path, kubelets: tuple[_Kubelet, _Kubelet], replacement: str
) -> None:
    """The kubelet dialled holds the Register without an answer, then kubelet.sock is made again (a new
    kubelet) or removed (a restart under way). The registration must end then, as unreachable (retried at
    once), not wait out its deadline while the new kubelet waits for us: an agent once went unregistered
    for a whole deadline after two kubelet restarts a few milliseconds apart."""
    sock = tmp_path / "kubelet.sock"
    replace = (lambda: _point(sock, kubelets[1].path)) if replacement == "another kubelet" else sock.unlink
    with _replaced_while_registering(_Late(tmp_path / "silent.sock"), sock, 30, replace) as outcome:
        (got,) = outcome
        assert isinstance(got, RegistrationError), got
        assert got.unreachable, got
        assert str(sock) in str(got) and "example.com/r" in str(got), got
        assert kubelets[1].calls == 0, "register() itself only ends the call; the caller registers again"


def test_a_kubelet_that_made_its_socket_again_still_answers_the_register_it_has(
    tmp_path: Path, kubelets: tuple[_Kubelet, _Kubelet]
) -> None:
    """A kubelet whose own gRPC server failed listens on a new socket and still serves the connections it had:
    its answer, a moment after the socket was made again, is a registration made (not one to send again, to
    overlap with the one it handles)."""
    slow = _Late(tmp_path / "slow.sock", after=registration.REPLACED_GRACE_SECONDS / 3)
    sock = tmp_path / "kubelet.sock"
    with _replaced_while_registering(slow, sock, 30, lambda: _point(sock, kubelets[0].path)) as outcome:
        assert outcome == [slow.identity] and slow.calls == 1, outcome


def test_without_procfs_an_unanswered_register_waits_for_its_deadline(
    tmp_path: Path, kubelets: tuple[_Kubelet, _Kubelet], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path itself is dialled: the file reached may be newer than the one held, so a replaced path tells
    nothing, and the call ends at its deadline, as a refusal naming it."""
    real_exists = os.path.exists
    monkeypatch.setattr(
        registration.os.path, "exists", lambda p: False if str(p).startswith("/proc/") else real_exists(p)
    )
    sock = tmp_path / "kubelet.sock"
    silent = _Late(tmp_path / "silent.sock")
    with _replaced_while_registering(silent, sock, 2, lambda: _point(sock, kubelets[1].path)) as outcome:
        (got,) = outcome
        assert isinstance(got, RegistrationError) and not got.unreachable, got
        assert "DEADLINE_EXCEEDED" in str(got), got
