"""DRA mode: a server whose handling of device taints changes while the agent runs, claims holding
several shares, and the scheduler simulator allocating them."""

from __future__ import annotations

import json
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


def _slices(sim: ApiServerSimulator) -> list[dict[str, Any]]:
    api = k8s.ResourceV1Api(sim.client())
    resp: Any = api.list_resource_slice(_preload_content=False)
    items: list[dict[str, Any]] = json.loads(resp.data)["items"]
    return items


def _content(sysfs: Path, taints: dict[int, devices.Taint]) -> Any:
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


def _settle(pub: SlicePublisher) -> int:
    for n in range(8):
        if not pub.sync():
            return n
    raise AssertionError("the publisher never settles")


def _published(sim: ApiServerSimulator) -> dict[str, bool]:
    """Device name -> whether it is published with a taint."""
    [stored] = _slices(sim)
    return {d["name"]: bool(d.get("taints")) for d in stored["spec"]["devices"]}


def test_taints_are_sent_again_once_the_server_keeps_them(tmp_path: Path) -> None:
    # Kubernetes 1.35 drops device taints; the control plane is upgraded (or the gate turned on)
    # while the agent runs. The agent must notice at its next publication of a taint, not only
    # after a restart: otherwise an unhealthy GPU stays hidden instead of tainted (a claim that
    # tolerates the taint can never get it), for as long as the agent runs.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=["DRADeviceTaints"]) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=_content(tmp_path, taints))
        _settle(pub)
        assert _published(sim) == {"gpu-1": False}
        sim._ops.disabled_features = frozenset()  # the server keeps taints from now on
        taints[1] = devices.Taint("XID 48", "2026-11-23T00:01:00Z")
        _settle(pub)
        assert _published(sim) == {"gpu-0": True, "gpu-1": True}
        assert _settle(pub) == 0


def test_taints_dropped_again_after_a_recheck_hide_the_devices_again(tmp_path: Path) -> None:
    # The re-check must not expose an unhealthy GPU for good where the server still drops taints.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=["DRADeviceTaints"]) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=_content(tmp_path, taints))
        _settle(pub)
        taints[1] = devices.Taint("XID 48", "2026-11-23T00:01:00Z")
        _settle(pub)
        assert _slices(sim)[0]["spec"]["devices"] == []
        assert _settle(pub) == 0, "settled: no write on every pass"
        taints.clear()
        _settle(pub)
        assert _published(sim) == {"gpu-0": False, "gpu-1": False}
