"""The vcuda.sock listeners: PreStartContainer does not wait for the relay's loop, and a pod let go
before the loop took its socket up leaves nothing listening."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import sockets as sockets_module
from gpumanager.vmanager.sockets import PodSockets

POD = "7d3c1b2a-0f9e-4d8c-b7a6-5e4d3c2b1a09"


class Sockets:
    def __init__(self, sockets: PodSockets, directory: Path) -> None:
        self.sockets = sockets
        self.directory = directory
        self.calls: list[tuple[str, str]] = []

    @property
    def path(self) -> Path:
        return self.directory / "vcuda.sock"

    def block_loop(self) -> threading.Event:
        """Keep the relay's loop busy (as a slow handler would) until the returned event is set."""
        release = threading.Event()
        busy = threading.Event()

        def hold() -> None:
            busy.set()
            release.wait(30)

        loop = self.sockets._loop
        assert loop is not None
        loop.call_soon_threadsafe(hold)
        assert busy.wait(10)
        return release


@pytest.fixture
def pod_sockets() -> Iterator[Sockets]:
    directory = Path(tempfile.mkdtemp(prefix="gm-ps-"))  # short: a unix socket path < 108 bytes
    holder: list[Sockets] = []

    async def handler(pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        holder[0].calls.append((pod, req.container_id))

    sockets = PodSockets(handler)
    sockets.start()
    holder.append(Sockets(sockets, directory))
    try:
        yield holder[0]
    finally:
        sockets.stop()
        shutil.rmtree(directory, ignore_errors=True)


def register(path: Path) -> grpc.StatusCode:
    with grpc.insecure_channel(f"unix://{path}") as channel:
        try:
            pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(
                pb.VDeviceRequest(pod_uid=POD, container_id="c1"), timeout=20
            )
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_serving_does_not_wait_for_a_busy_loop(pod_sockets: Sockets) -> None:
    release = pod_sockets.block_loop()
    try:
        done = threading.Event()

        def serve() -> None:
            pod_sockets.sockets.serve(POD, pod_sockets.path)
            done.set()

        threading.Thread(target=serve, daemon=True).start()
        assert done.wait(10), "serve() waited for the relay's loop"
        assert pod_sockets.sockets.is_serving(POD)
        # Listening already: the kernel takes the connection while the loop is still busy.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(pod_sockets.path))
    finally:
        release.set()
    assert register(pod_sockets.path) == grpc.StatusCode.OK
    assert pod_sockets.calls == [(POD, "c1")]


def test_a_pod_let_go_before_the_loop_took_its_socket_up(pod_sockets: Sockets) -> None:
    release = pod_sockets.block_loop()
    try:
        pod_sockets.sockets.serve(POD, pod_sockets.path)
    finally:
        release.set()
    pod_sockets.sockets.unserve(POD)
    assert not pod_sockets.sockets.is_serving(POD)
    assert not pod_sockets.path.exists()
    # Served again, it answers.
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    assert register(pod_sockets.path) == grpc.StatusCode.OK


def test_serving_a_pod_again_replaces_its_socket(pod_sockets: Sockets) -> None:
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    assert register(pod_sockets.path) == grpc.StatusCode.OK
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    assert register(pod_sockets.path) == grpc.StatusCode.OK
    assert pod_sockets.sockets.serving() == [POD]
    pod_sockets.sockets.unserve(POD)
    assert not pod_sockets.path.exists()


def test_a_connection_open_when_its_pod_is_served_again_goes_on(pod_sockets: Sockets) -> None:
    # A client that keeps its channel (grpc shares one connection per address, even across channels)
    # makes its next call on the connection the earlier socket accepted.
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    with grpc.insecure_channel(f"unix://{pod_sockets.path}") as channel:
        stub = pb_grpc.VCUDAServiceStub(channel)
        stub.RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c1"), timeout=20)
        pod_sockets.sockets.serve(POD, pod_sockets.path)
        stub.RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c2"), timeout=20)
    assert pod_sockets.calls == [(POD, "c1"), (POD, "c2")]
    assert register(pod_sockets.path) == grpc.StatusCode.OK  # and the new socket answers


def test_a_pods_connections_end_when_it_is_let_go(pod_sockets: Sockets) -> None:
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    with grpc.insecure_channel(f"unix://{pod_sockets.path}") as channel:
        stub = pb_grpc.VCUDAServiceStub(channel)
        stub.RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c1"), timeout=20)
        pod_sockets.sockets.unserve(POD)
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c2"), timeout=20)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED)
    assert pod_sockets.calls == [(POD, "c1")]


def test_a_stopped_relay_refuses_to_serve(pod_sockets: Sockets) -> None:
    pod_sockets.sockets.stop()
    with pytest.raises(OSError, match="not running"):
        pod_sockets.sockets.serve(POD, pod_sockets.path)


def test_two_calls_serving_one_pod_at_once_leave_its_socket_served(pod_sockets: Sockets) -> None:
    """Start-up's resume and a PreStartContainer may serve one pod together: neither may remove the
    socket file of the other and leave the pod served with no file."""

    def serve(barrier: threading.Barrier, errors: list[BaseException]) -> None:
        barrier.wait()
        try:
            pod_sockets.sockets.serve(POD, pod_sockets.path)
        except BaseException as exc:  # reported below
            errors.append(exc)

    for _ in range(20):
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=serve, args=(barrier, errors)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == []
        assert pod_sockets.path.is_socket()
        assert register(pod_sockets.path) == grpc.StatusCode.OK


def test_serving_one_pod_does_not_wait_for_another_pods_socket(
    pod_sockets: Sockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fifty PreStartContainer calls serve fifty pods at once: a slow bind of one pod's socket (the file
    system busy with the kubelet's and our own flushes) must not hold up the others; two calls for one
    pod still take turns."""
    slow_dir = pod_sockets.directory / "slow"
    slow_dir.mkdir()
    entered, release = threading.Event(), threading.Event()
    real_bind = sockets_module._bind_listening

    def bind(path: Path) -> object:
        if path.parent == slow_dir:
            entered.set()
            release.wait(30)
        return real_bind(path)

    monkeypatch.setattr(sockets_module, "_bind_listening", bind)
    slow = threading.Thread(target=pod_sockets.sockets.serve, args=("slow-pod", slow_dir / "vcuda.sock"))
    slow.start()
    try:
        assert entered.wait(10)
        other = threading.Thread(target=pod_sockets.sockets.serve, args=(POD, pod_sockets.path))
        other.start()
        other.join(5)
        assert not other.is_alive(), "serving a pod waited for another pod's socket"
        assert register(pod_sockets.path) == grpc.StatusCode.OK
        # The same pod again waits for the serve in progress.
        again = threading.Thread(target=pod_sockets.sockets.serve, args=("slow-pod", slow_dir / "vcuda.sock"))
        again.start()
        again.join(0.3)
        assert again.is_alive(), "two serves of one pod ran at once"
    finally:
        release.set()
        slow.join(10)
    again.join(10)
    assert (slow_dir / "vcuda.sock").is_socket()


def test_stop_waits_for_serves_in_progress_and_later_ones_refuse(
    pod_sockets: Sockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real_bind = sockets_module._bind_listening

    def bind(path: Path) -> object:
        entered.set()
        release.wait(30)
        return real_bind(path)

    monkeypatch.setattr(sockets_module, "_bind_listening", bind)
    serving = threading.Thread(target=pod_sockets.sockets.serve, args=(POD, pod_sockets.path))
    serving.start()
    assert entered.wait(10)
    stopping = threading.Thread(target=pod_sockets.sockets.stop)
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive(), "stop() did not wait for the serve in progress"
    release.set()
    serving.join(10)
    stopping.join(10)
    assert not stopping.is_alive()
    assert not pod_sockets.path.exists(), "the socket of a serve that ended during stop() was left behind"
    with pytest.raises(OSError, match="not running"):
        pod_sockets.sockets.serve("another", pod_sockets.directory / "other.sock")


def test_a_pod_let_go_while_the_relay_stops_returns_quietly(
    pod_sockets: Sockets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod deletion's unserve() racing stop(): stop() cancels what runs on the loop, the pod's close
    included; unserve() returns (stop closes every socket anyway) instead of raising CancelledError."""
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    closing = threading.Event()

    async def close_never_ends(pod_uid: str) -> None:
        closing.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(pod_sockets.sockets, "_close", close_never_ends)
    errors: list[BaseException] = []

    def let_go() -> None:
        try:
            pod_sockets.sockets.unserve(POD)
        except BaseException as exc:  # reported below
            errors.append(exc)

    letting_go = threading.Thread(target=let_go)
    letting_go.start()
    assert closing.wait(10)
    monkeypatch.undo()  # stop() closes the pod's socket for real
    pod_sockets.sockets.stop()
    letting_go.join(10)
    assert not letting_go.is_alive()
    assert errors == []


def _hold_connections(path: Path, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        held.append(s)
    return held


def _relayed(pod_sockets: Sockets, count: int) -> None:
    for _ in range(500):
        with pod_sockets.sockets._lock:
            if pod_sockets.sockets._active.get(POD, 0) >= count:
                return
        threading.Event().wait(0.01)
    raise AssertionError(f"{count} connections were not relayed")


def test_a_call_over_the_pods_connection_limit_waits_a_moment_for_a_slot(pod_sockets: Sockets) -> None:
    """A client calling again at once on new connections may find its earlier ones not yet torn down on a
    busy node: the call over the limit is served once one of them ends, not refused."""
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    held = _hold_connections(pod_sockets.path, sockets_module.MAX_CONNECTIONS_PER_POD)
    try:
        _relayed(pod_sockets, sockets_module.MAX_CONNECTIONS_PER_POD)
        threading.Timer(0.1, held.pop().close).start()
        assert register(pod_sockets.path) == grpc.StatusCode.OK
    finally:
        for s in held:
            s.close()
    assert pod_sockets.calls == [(POD, "c1")]


def test_a_call_still_over_the_limit_after_the_wait_is_refused(pod_sockets: Sockets) -> None:
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    held = _hold_connections(pod_sockets.path, sockets_module.MAX_CONNECTIONS_PER_POD)
    try:
        _relayed(pod_sockets, sockets_module.MAX_CONNECTIONS_PER_POD)
        assert register(pod_sockets.path) == grpc.StatusCode.UNAVAILABLE
    finally:
        for s in held:
            s.close()
    assert pod_sockets.calls == []
