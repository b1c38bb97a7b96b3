"""The kubelet's DRAResourceHealth stream keeps every device's health current.

The kubelet stamps each report with its own clock and shows a device as Unknown once the driver has
not named it within the report's ``health_check_timeout_seconds`` (30 s by default); a stream that
sends only on changes leaves every healthy GPU Unknown in the pods' status half a minute later.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import grpc

from gpumanager.api import drahealth_v1_pb2 as health_pb
from gpumanager.api import drahealth_v1_pb2_grpc as health_grpc
from simnode.dra_cluster import DRIVER
from tests.dra_claim_fixtures import start_dra_node, stop_dra_node

PROBE_PERIOD = 0.2


def test_health_is_reported_again_within_the_timeout_it_announces(tmp_path: Path, sim_built: Path) -> None:
    node = start_dra_node(tmp_path / "node", "v100-pcie-x4", [f"--health-probe-period={PROBE_PERIOD}s"])
    try:
        channel = grpc.insecure_channel(f"unix://{node.cluster.plugin_dir / 'dra.sock'}")
        stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
            health_pb.NodeWatchResourcesRequest(), timeout=30
        )
        received: list[tuple[float, health_pb.NodeWatchResourcesResponse]] = []

        def read() -> None:
            try:
                for resp in stream:
                    received.append((time.monotonic(), resp))
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        # Long enough for several probe periods, far shorter than any timeout.
        time.sleep(3.0)
        stream.cancel()
        reader.join(5)
        channel.close()
        assert len(received) >= 3, f"{len(received)} reports in 3 s with a {PROBE_PERIOD} s probe period"
        for _at, resp in received:
            assert sorted(d.device.device_name for d in resp.devices) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
            assert all(d.health == health_pb.HEALTHY for d in resp.devices)
        timeouts = {d.health_check_timeout_seconds or 30 for _, resp in received for d in resp.devices}
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(received)]
        assert max(gaps) < min(timeouts) / 3, (gaps, timeouts)
        # The kubelet stand-in reads the same stream: every device is Healthy in its view.
        view = node.cluster.kubelet.device_health(DRIVER) if node.cluster.kubelet else {}
        assert {d: h[0] for d, h in view.items()} == dict.fromkeys(["gpu-0", "gpu-1", "gpu-2", "gpu-3"], 1)
    finally:
        stop_dra_node(node)
