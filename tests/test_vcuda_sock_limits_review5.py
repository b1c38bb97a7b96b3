"""The vcuda.sock service against tenants that open connections without limit or leave them idle."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import sockets as sockets_module
from gpumanager.vmanager.sockets import PodSockets

PODS = [f"7d3c1b2a-0f9e-4d8c-b7a6-5e4d3c2b1a{i:02d}" for i in range(3)]


class Served:
    def __init__(self, sockets: PodSockets, directory: Path) -> None:
        self.sockets = sockets
        self.directory = directory
        self.calls: list[str] = []

    def path(self, pod: str) -> Path:
        return self.directory / pod[-2:] / "vcuda.sock"

    def serve(self, pod: str) -> Path:
        path = self.path(pod)
        path.parent.mkdir(exist_ok=True)
        self.sockets.serve(pod, path)
        return path


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    # Idle connections are closed after this long (the default is longer than a test should wait).
    monkeypatch.setattr(sockets_module, "IDLE_SECONDS", 0.5, raising=False)
    directory = Path(tempfile.mkdtemp(prefix="gm-lim-"))  # short: a unix socket path < 108 bytes
    holder: list[Served] = []

    async def handler(pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        holder[0].calls.append(pod)

    sockets = PodSockets(handler)
    sockets.start()
    holder.append(Served(sockets, directory))
    try:
        yield holder[0]
    finally:
        sockets.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_for(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _register(path: Path, pod: str) -> grpc.StatusCode:
    with grpc.insecure_channel(f"unix://{path}") as channel:
        try:
            pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(
                pb.VDeviceRequest(pod_uid=pod, container_id="c1"), timeout=20
            )
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _listening_abstract_names() -> list[str]:
    """Abstract unix addresses listened on whose name is the agent's (this process's) server's."""
    prefix = f"@gpu-manager-vcuda.{os.getpid()}."
    names = []
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            # Flags 00010000: __SO_ACCEPTCON (listening).
            if len(fields) >= 8 and fields[7].startswith(prefix) and int(fields[3], 16) & 0x10000:
                names.append(fields[7][1:])
    return names


def _closed_by_peer(sock: socket.socket, seconds: float = 15.0) -> bool:
    """Whether the other end closes ``sock`` within ``seconds`` (reading and dropping what comes)."""
    sock.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not sock.recv(4096):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_no_connection_without_limit_on_the_servers_own_address(served: Served) -> None:
    """The server behind the pods' sockets listened on an abstract address that any process in the
    host's network namespace (a hostNetwork pod) finds in /proc/net/unix: it could open connections
    there without limit (each one a descriptor of the agent's), bypassing every pod's limit."""
    path = served.serve(PODS[0])
    assert _listening_abstract_names() == [], "the server listens on an abstract address"
    attempts = 300
    held: list[socket.socket] = []
    before = _open_fds()
    try:
        for name in _listening_abstract_names():
            for _ in range(attempts):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect("\0" + name)
                except OSError:
                    sock.close()
                    break
                held.append(sock)
        time.sleep(0.5)  # the server accepts in its own threads
        agents_share = _open_fds() - before - len(held)
        assert agents_share <= sockets_module.MAX_CONNECTIONS_PER_POD, (
            f"the agent holds {agents_share} descriptors for {len(held)} connections to its server's address"
        )
    finally:
        for sock in held:
            sock.close()
    assert _register(path, PODS[0]) == grpc.StatusCode.OK


@pytest.mark.parametrize(
    "sent",
    [
        b"",
        b"PRI * HTTP/2.0\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00\x00\x00\x10\x01",
    ],
    ids=["nothing", "half-a-preface", "preface-and-half-a-frame"],
)
def test_an_idle_or_half_written_connection_is_closed(served: Served, sent: bytes) -> None:
    """A connection that sends nothing, or stops half-way, holds one of its pod's slots only until it has
    been idle a while (not for the whole connection lifetime of five minutes)."""
    path = served.serve(PODS[0])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
        sock.sendall(sent)
        assert _closed_by_peer(sock), "an idle connection is still open"
        assert _wait_for(lambda: not served.sockets._active)
    finally:
        sock.close()
    assert _register(path, PODS[0]) == grpc.StatusCode.OK


def test_a_call_in_progress_is_not_closed_as_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle limit counts a connection without a call: a registration waiting for its pod's status
    (longer than the idle limit) is answered."""
    monkeypatch.setattr(sockets_module, "IDLE_SECONDS", 0.3, raising=False)
    directory = Path(tempfile.mkdtemp(prefix="gm-lim-"))

    async def slow(pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        await asyncio.sleep(1.5)

    sockets = PodSockets(slow)
    sockets.start()
    try:
        sockets.serve(PODS[0], directory / "vcuda.sock")
        assert _register(directory / "vcuda.sock", PODS[0]) == grpc.StatusCode.OK
    finally:
        sockets.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_connections_of_all_pods_together_are_bounded(
    served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Many pods (one tenant's) each at their own limit cannot together take every descriptor: the
    connections relayed for all pods at once are bounded too, and the refusal names the pod and the peer."""
    monkeypatch.setattr(sockets_module, "MAX_CONNECTIONS_PER_POD", 4)
    monkeypatch.setattr(sockets_module, "MAX_CONNECTIONS_TOTAL", 6, raising=False)
    monkeypatch.setattr(sockets_module, "SLOT_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(sockets_module, "IDLE_SECONDS", 60.0, raising=False)
    paths = [served.serve(pod) for pod in PODS]
    held: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger=sockets_module.__name__):
            for path in paths:
                for _ in range(4):
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.connect(str(path))
                    held.append(sock)
            assert _wait_for(lambda: sum(1 for s in held if _closed_by_peer(s, 0.01)) >= len(held) - 6)
            time.sleep(0.3)
            with served.sockets._lock:
                relayed = sum(served.sockets._active.values())
            assert relayed <= 6, f"{relayed} connections relayed at once over a limit of 6"
        lines = [r.getMessage() for r in caplog.records if "closing" in r.getMessage()]
        assert lines, "no log line for the connections closed over the limit"
        assert any(f"pid {os.getpid()}" in line for line in lines), lines
        assert any(pod in line for line in lines for pod in PODS), lines
    finally:
        for sock in held:
            sock.close()
    assert _wait_for(lambda: not served.sockets._active)
    assert _register(paths[0], PODS[0]) == grpc.StatusCode.OK


def test_a_refused_connection_names_its_peer(
    served: Served, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection closed over its pod's limit is logged with the pod and the connecting process."""
    monkeypatch.setattr(sockets_module, "MAX_CONNECTIONS_PER_POD", 2)
    monkeypatch.setattr(sockets_module, "SLOT_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(sockets_module, "IDLE_SECONDS", 60.0, raising=False)
    path = served.serve(PODS[1])
    held: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger=sockets_module.__name__):
            for _ in range(3):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(str(path))
                held.append(sock)
            assert _closed_by_peer(held[-1])
            assert _wait_for(lambda: any("closing" in r.getMessage() for r in caplog.records))
        line = next(r.getMessage() for r in caplog.records if "closing" in r.getMessage())
        assert PODS[1] in line and f"pid {os.getpid()}" in line, line
    finally:
        for sock in held:
            sock.close()


def test_a_pod_flooding_its_socket_leaves_the_agent_serving_the_kubelet(tmp_path: Path) -> None:
    """A tenant opens thousands of connections to its vcuda.sock and holds them (most sending nothing):
    the agent holds a bounded number of descriptors for them, and the kubelet's Allocate and
    PreStartContainer for another pod are answered meanwhile."""
    from simnode.cluster import SimCluster, gpu_pod

    with SimCluster(tmp_path / "node", "v100-pcie-x4") as cluster:
        tenant = cluster.run_pod(gpu_pod("tenant", [("main", 30, 4)]))
        assert cluster.agent is not None
        fd_dir = Path(f"/proc/{cluster.agent.pid}/fd")
        before = len(list(fd_dir.iterdir()))
        path = cluster.vm_path / tenant.uid / "vcuda.sock"
        held: list[socket.socket] = []
        try:
            for _ in range(2000):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(str(path))
                except OSError:  # the backlog full: the agent closes faster than this loop connects
                    sock.close()
                    continue
                held.append(sock)
            other = cluster.run_pod(gpu_pod("other", [("main", 30, 4)]))
            assert other.core["main"].device_ids
            # Each relayed connection holds three descriptors; the waiting ones one each.
            bound = 3 * sockets_module.MAX_CONNECTIONS_PER_POD + sockets_module.MAX_WAITING_PER_POD + 64
            assert _wait_for(lambda: len(list(fd_dir.iterdir())) - before <= bound), (
                f"the agent holds {len(list(fd_dir.iterdir())) - before} more descriptors for {len(held)} connections"
            )
        finally:
            for sock in held:
                sock.close()


def test_a_killed_agents_private_directory_is_removed_at_the_next_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's socket lives in a private temporary directory; an agent killed (SIGKILL) leaves it
    behind, and the next start removes it, not that of an agent still running."""
    import subprocess
    import sys

    tmp_path = Path(tempfile.mkdtemp(prefix="gm-tmp-"))  # short: the socket's path must fit
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"gpu-manager-vcuda.{dead.pid}.abcd1234"
    stale.mkdir(mode=0o700)
    (stale / "grpc.sock").touch()
    alive = tmp_path / f"gpu-manager-vcuda.{os.getppid()}.abcd1234"
    alive.mkdir(mode=0o700)
    sockets = PodSockets(lambda *_args: asyncio.sleep(0))
    sockets.start()
    try:
        assert not stale.exists()
        assert alive.exists()
        ours = [p for p in tmp_path.iterdir() if p.name.startswith(f"gpu-manager-vcuda.{os.getpid()}.")]
        assert len(ours) == 1 and (ours[0] / "grpc.sock").exists()
        assert ours[0].stat().st_mode & 0o777 == 0o700
    finally:
        sockets.stop()
    assert not ours[0].exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_without_a_writable_temporary_directory_the_pod_sockets_are_served(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read-only root file system leaves no private directory: the server falls back to an abstract
    address (said in the log) and the pods register as before."""

    def no_directory(_self: PodSockets) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(PodSockets, "_make_private", no_directory)
    directory = Path(tempfile.mkdtemp(prefix="gm-lim-"))
    calls: list[str] = []

    async def handler(pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        calls.append(pod)

    sockets = PodSockets(handler)
    with caplog.at_level(logging.WARNING, logger=sockets_module.__name__):
        sockets.start()
    try:
        sockets.serve(PODS[0], directory / "vcuda.sock")
        assert _register(directory / "vcuda.sock", PODS[0]) == grpc.StatusCode.OK
        assert calls == [PODS[0]]
        assert any("abstract address" in r.getMessage() for r in caplog.records)
    finally:
        sockets.stop()
        shutil.rmtree(directory, ignore_errors=True)
