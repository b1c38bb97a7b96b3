"""The vcuda.sock relay against a container that connects without pause (found by review)."""

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

import pytest

from gpumanager.api import vcuda_pb2 as pb
from gpumanager.vmanager import sockets as sockets_module
from gpumanager.vmanager.sockets import PodSockets

POD = "12345678-1234-1234-1234-123456789abc"


# -- a container connecting to its vcuda.sock without pause --------------------------------------


async def _never_answers(_pod: str, _req: pb.VDeviceRequest, _left: float | None) -> None:
    await asyncio.sleep(3600)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[PodSockets, Path]]:
    pod_sockets = PodSockets(_never_answers)
    pod_sockets.start()
    path = tmp_path / "vcuda.sock"
    pod_sockets.serve(POD, path)
    try:
        yield pod_sockets, path
    finally:
        pod_sockets.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_connections_over_the_limit_do_not_pile_up(
    served: tuple[PodSockets, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod whose connections are all in use cannot make the agent hold an open descriptor for each
    further connection it opens (one a connect, without pause: thousands, until the agent has no
    descriptor left for the kubelet or the API server), nor log a line for each."""
    # The connections over the limit would each be held this long: long enough to count them.
    monkeypatch.setattr(sockets_module, "SLOT_WAIT_SECONDS", 30.0)
    pod_sockets, path = served
    limit = sockets_module.MAX_CONNECTIONS_PER_POD
    held = [_connect(path) for _ in range(limit)]
    assert _wait_for(lambda: len(pod_sockets._peers) == limit)
    extra_count = 200
    with caplog.at_level(logging.WARNING, logger=sockets_module.__name__):
        before = _open_fds()
        extra = [_connect(path) for _ in range(extra_count)]
        try:
            # The agent's ends of the extra connections: at most a few wait for a slot, the rest are closed.
            bound = sockets_module.MAX_WAITING_PER_POD
            assert _wait_for(lambda: _open_fds() - before - extra_count <= bound), (
                f"the agent holds {_open_fds() - before - extra_count} descriptors for {extra_count} connections "
                f"over the limit of {limit}"
            )
        finally:
            for sock in extra + held:
                sock.close()
    lines = [r for r in caplog.records if "connections open already" in r.getMessage()]
    assert len(lines) <= 2, f"{len(lines)} log lines for {extra_count} refused connections"


def test_a_restart_serves_every_pods_socket_again_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An agent restart on a node of 250 pods serves each pod's vcuda.sock again: one line says so, not one
    per pod; a pod prepared afterwards still has its own line."""
    from gpumanager.vmanager.manager import VirtualManager

    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))  # short: a unix socket's path has at most 107 bytes

    def manager() -> VirtualManager:
        return VirtualManager(
            vm_path=vm_path,
            cgroup_root=tmp_path / "cgroup",
            allocation=lambda uid, name: None,
            pod=lambda uid: None,
            driver_version="550.54.15",
        )

    uids = [f"0000000{i}-aaaa-bbbb-cccc-dddddddddddd" for i in range(5)]
    first = manager()
    try:
        for uid in uids:
            first.prepare_ahead(uid, ["main"])
    finally:
        first.stop()
    again = manager()
    try:
        caplog.clear()  # the first run's own lines, one per pod it prepared
        with caplog.at_level(logging.INFO, logger="gpumanager.vmanager.manager"):
            again.resume(uids)
        assert sorted(again.serving()) == uids
        lines = [r.getMessage() for r in caplog.records if "vcuda.sock" in r.getMessage()]
        assert lines == [f"serving the vcuda.sock of 5 pods again, in {vm_path}"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="gpumanager.vmanager.manager"):
            again.prepare_ahead("00000009-aaaa-bbbb-cccc-dddddddddddd", ["main"])
        assert [r.getMessage() for r in caplog.records if "vcuda.sock" in r.getMessage()] == [
            f"serving {vm_path / '00000009-aaaa-bbbb-cccc-dddddddddddd' / 'vcuda.sock'}"
        ]
    finally:
        again.stop()
        shutil.rmtree(vm_path, ignore_errors=True)
