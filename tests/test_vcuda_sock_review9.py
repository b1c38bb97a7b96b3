"""vcuda.sock against a caller whose call stops after its headers, the request never sent whole."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import sockets as sockets_module
from gpumanager.vmanager.sockets import PodSockets

POD = "6a1f0e2d-3c4b-4a59-8e7d-1c2b3a4f5e60"


def _wait_for(condition: Callable[[], bool], seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[PodSockets, Path, list[str]]]:
    monkeypatch.setattr(sockets_module, "IDLE_SECONDS", 0.5)
    directory = Path(tempfile.mkdtemp(prefix="gm-r9-"))  # short: a unix socket path < 108 bytes
    calls: list[str] = []

    async def handler(pod: str, req: pb.VDeviceRequest, time_left: float | None) -> None:
        calls.append(req.container_id)

    sockets = PodSockets(handler)
    sockets.start()
    try:
        path = directory / "vcuda.sock"
        sockets.serve(POD, path)
        yield sockets, path, calls
    finally:
        sockets.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _open_connections(sockets: PodSockets) -> int:
    return len(sockets._relays.get(POD, ()))


def test_a_call_whose_request_never_comes_frees_its_slot(served: tuple[PodSockets, Path, list[str]]) -> None:
    """A caller that sends a call's headers and never its request held its connection (one of the pod's
    16 slots, one of the 1,024 of all pods) for the connection's whole lifetime of 5 minutes: 16 such calls
    shut the pod's own containers out, 64 pods' all pods'. It is given up as an idle connection is."""
    sockets, path, calls = served
    release = threading.Event()

    def never() -> Iterator[bytes]:
        release.wait()
        yield pb.VDeviceRequest(pod_uid=POD, container_id="late").SerializeToString()

    channel = grpc.insecure_channel(f"unix://{path}")
    try:
        stuck = channel.stream_unary(
            "/vcuda.VCUDAService/RegisterVDevice",
            request_serializer=lambda b: b,
            response_deserializer=pb.VDeviceResponse.FromString,
        ).future(never())
        assert _wait_for(lambda: _open_connections(sockets) == 1), "the call never reached the relay"
        assert _wait_for(lambda: _open_connections(sockets) == 0, seconds=20), (
            "a call without its request still holds its pod's slot"
        )
        assert stuck.done() and stuck.exception() is not None
        assert calls == []
    finally:
        release.set()
        channel.close()


def test_a_whole_call_is_still_answered(served: tuple[PodSockets, Path, list[str]]) -> None:
    """An ordinary unary call (the library's gpu-client) is read whole and handed to the handler."""
    _sockets, path, calls = served
    with grpc.insecure_channel(f"unix://{path}") as channel:
        pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c1"), timeout=20)
    assert calls == ["c1"]
