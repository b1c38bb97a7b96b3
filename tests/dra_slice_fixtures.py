"""A node's ResourceSlice as the agent's SlicePublisher writes it to a simulated API server: two H100s, the
slice content for a set of taints, the slices the server stored, and syncing until a pass writes nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import devices
from gpumanager.dra.publisher import SlicePublisher
from simnode.apiserver import ApiServerSimulator

DRIVER = "vcuda.tencent.com"
GPUS = [
    GPUInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, 81559 << 20, f"00000000:{i + 7:02x}:00.0", 0) for i in range(2)
]
TOPOLOGY = NodeTopology(levels=((0, 40), (40, 0)))


def stored_slices(sim: ApiServerSimulator) -> list[dict[str, Any]]:
    """Every ResourceSlice the server holds, as stored."""
    api = k8s.ResourceV1Api(sim.client())
    resp: Any = api.list_resource_slice(_preload_content=False)
    items: list[dict[str, Any]] = json.loads(resp.data)["items"]
    return items


def slice_content(sysfs: Path, taints: dict[int, devices.Taint]) -> Callable[[int], dict[str, Any]]:
    """The publisher's content callback for node-a's GPUS with ``taints`` (read at each call)."""

    def content(generation: int) -> dict[str, Any]:
        return devices.slice_spec(
            node="node-a",
            driver=DRIVER,
            gpus=GPUS,
            topology=TOPOLOGY,
            taints=taints,
            generation=generation,
            sysfs_root=sysfs,
        )

    return content


def settle(pub: SlicePublisher, passes: int) -> int:
    """Sync until a pass writes nothing; the number of passes that wrote (at most ``passes``, else an error)."""
    for n in range(passes):
        if not pub.sync():
            return n
    raise AssertionError("the publisher never settles")
