"""A device plugin that does nothing, for the allocation benchmark's floor through the kubelet simulator.

It registers ``example.com/floor-core`` (GetPreferredAllocation and PreStartContainer, as vcuda-core) and
``example.com/floor-memory`` (neither, as vcuda-memory) with ``--devices`` IDs each, and answers every
call at once: the lowest offered IDs, an empty Allocate answer per container, an empty PreStart answer.
Run in its own process, as the agent is, so a burst through the kubelet simulator costs what the
simulator, gRPC and this machine cost, and nothing of a plugin's own work.

    python bench/floor_plugin.py --kubelet-socket PATH [--devices 800]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc

CORE = "example.com/floor-core"
MEMORY = "example.com/floor-memory"
ENDPOINTS = {CORE: "floor-core.sock", MEMORY: "floor-memory.sock"}


class _Plugin(pb_grpc.DevicePluginServicer):  # type: ignore[misc]
    def __init__(self, resource: str, devices: int, stopped: threading.Event) -> None:
        self._core = resource == CORE
        self._devices = [pb.Device(ID=f"floor-{i}", health="Healthy") for i in range(devices)]
        self._stopped = stopped

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(pre_start_required=self._core, get_preferred_allocation_available=self._core)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        yield pb.ListAndWatchResponse(devices=self._devices)
        self._stopped.wait()

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        return pb.PreferredAllocationResponse(
            container_responses=[
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=list(dict.fromkeys([*c.must_include_deviceIDs, *c.available_deviceIDs]))[
                        : c.allocation_size
                    ]
                )
                for c in request.container_requests
            ]
        )

    def Allocate(self, request: Any, context: Any) -> Any:
        return pb.AllocateResponse(
            container_responses=[pb.ContainerAllocateResponse() for _ in request.container_requests]
        )

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kubelet-socket", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=800)
    args = parser.parse_args()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    servers = []
    for resource, endpoint in ENDPOINTS.items():
        path = args.kubelet_socket.parent / endpoint
        path.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        pb_grpc.add_DevicePluginServicer_to_server(_Plugin(resource, args.devices, stopped), server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        servers.append(server)
        with grpc.insecure_channel(f"unix://{args.kubelet_socket}") as channel:
            pb_grpc.RegistrationStub(channel).Register(
                pb.RegisterRequest(
                    version="v1beta1",
                    endpoint=endpoint,
                    resource_name=resource,
                    options=pb.DevicePluginOptions(
                        pre_start_required=resource == CORE, get_preferred_allocation_available=resource == CORE
                    ),
                ),
                timeout=15,
            )
    print("registered", flush=True)
    stopped.wait()
    for server in servers:
        server.stop(grace=None).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
