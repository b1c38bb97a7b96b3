"""The device-plugin gRPC server: calls the kubelet makes at once are served at once."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.deviceplugin.server import MAX_WORKERS, PluginServer
from gpumanager.deviceplugin.servicer import ResourceServicer


def test_pods_starting_together_are_not_queued_behind_each_other(tmp_path: Path) -> None:
    """Each pod's worker calls PreStartContainer at once; while the kubelet's ListAndWatch holds a thread,
    24 calls must all be in progress together (each waits here until all 24 are)."""
    calls = 24
    assert calls < MAX_WORKERS
    together = threading.Barrier(calls, timeout=30)

    def pre_start(request: pb.PreStartContainerRequest) -> pb.PreStartContainerResponse:
        together.wait()  # BrokenBarrierError (an error answer) when fewer than 24 get in at once
        return pb.PreStartContainerResponse()

    servicer = ResourceServicer(
        "example.com/r",
        devices=lambda: b"",
        options=pb.DevicePluginOptions(pre_start_required=True),
        pre_start=pre_start,
    )
    server = PluginServer(servicer, tmp_path / "r.sock")
    server.start()
    try:
        with grpc.insecure_channel(f"unix://{tmp_path / 'r.sock'}") as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            stream = stub.ListAndWatch(pb.Empty())
            next(stream)  # the kubelet's stream is open and holds its thread
            with ThreadPoolExecutor(calls) as pool:
                answers = list(
                    pool.map(
                        lambda i: stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=[str(i)]), timeout=60),
                        range(calls),
                    )
                )
            stream.cancel()
        assert len(answers) == calls
    finally:
        server.close()


def test_a_missing_directory_is_made_as_the_kubelet_makes_it(tmp_path: Path) -> None:
    servicer = ResourceServicer("example.com/r", devices=lambda: b"", options=pb.DevicePluginOptions())
    server = PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")
    server.start()
    try:
        assert (tmp_path / "device-plugins").stat().st_mode & 0o777 == 0o750
    finally:
        server.close()
    assert not server.socket_path.exists()
    with pytest.raises(RuntimeError, match="closed"):
        server.start()
