"""The tencent.com/gpu-inventory Node annotation: its format, the publisher, and the agent publishing it."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.kube.gpu_inventory import ANNOTATION, InventoryError, decode, encode
from gpumanager.kube.inventory_publisher import InventoryPublisher
from gpumanager.topology import build_tree, render_shape
from simnode.apiserver import ApiServerSimulator
from simnode.cluster import NODE, SimCluster
from simnode.gpusim_state import load_spec, spec_dir
from tests.agent_fixtures import gpusim
from tests.extender_fixtures import wait_for


def spec_gpus(stem: str) -> tuple[list[GPUInfo], NodeTopology]:
    spec = load_spec(spec_dir() / f"{stem}.json")
    gpus = [
        GPUInfo(i, g.uuid, g.name, g.minor, g.memory_mib << 20, g.pci_bus_id, g.numa_node, g.multi_gpu_board)
        for i, g in enumerate(spec.gpus)
    ]
    links = tuple((n.gpu_a, n.gpu_b, n.links) for n in spec.nvlink)
    return gpus, NodeTopology(levels=spec.topology, nvlink=links)


@pytest.mark.parametrize("stem", ["h100-nvlink-x8", "v100-pcie-x4", "t4-x1", "h200-x16"])
def test_round_trip_rebuilds_the_agents_tree(stem: str) -> None:
    gpus, topology = spec_gpus(stem)
    text = encode(gpus, topology, {1: False}, share_mode=True)
    inv = decode(text)
    assert [g.info() for g in inv.gpus] == [GPUInfo(**{**g.__dict__, "pci_bus_id": ""}) for g in gpus]
    assert [g.healthy for g in inv.gpus] == [i != 1 for i in range(len(gpus))]
    assert render_shape(build_tree([g.info() for g in inv.gpus], inv.topology())) == render_shape(
        build_tree(gpus, topology)
    )


def test_fields_of_one_gpu() -> None:
    gpus, topology = spec_gpus("h100-nvlink-x8")
    data = json.loads(encode(gpus, topology, {}, share_mode=False))
    assert data["version"] == 1 and data["shareMode"] is False
    first = data["gpus"][0]
    assert first == {
        "index": 0,
        "minor": 0,
        "uuid": gpus[0].uuid,
        "model": "NVIDIA H100 80GB HBM3",
        "memory": 81559 << 20,
        "cores": 100,
        "health": "Healthy",
        "nvlinkGroup": 0,
        "nvlinkPeers": [1, 2, 3, 4, 5, 6, 7],
        "numa": 0,
        "multiGpuBoard": False,
        "levels": list(topology.levels[0]),
    }
    pcie, pcie_topology = spec_gpus("v100-pcie-x4")
    assert {g["nvlinkGroup"] for g in json.loads(encode(pcie, pcie_topology, {}, share_mode=True))["gpus"]} == {None}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{", "not JSON"),
        ("[]", "not a JSON object"),
        ('{"version": 2, "gpus": []}', "version=2"),
        ('{"version": 1, "gpus": {}}', "is not a list"),
        ('{"version": 1, "gpus": [{"index": 0, "minor": 0, "memory": -1, "cores": 100}]}', "gpus[0].memory=-1"),
        ('{"version": 1, "gpus": [{"index": 0, "minor": 0, "memory": 1, "cores": 50}]}', "only 100 cores"),
        ('{"version": 1, "gpus": [{"index": 0, "minor": 0, "memory": 1, "cores": 100, "health": "ok"}]}', "health"),
        (
            '{"version": 1, "gpus": [{"index": 0, "minor": 0, "memory": 1, "cores": 100, "health": "Healthy"},'
            '{"index": 1, "minor": 0, "memory": 1, "cores": 100, "health": "Healthy"}]}',
            "levels has 0 entries for 2 GPUs",
        ),
        (
            '{"version": 1, "gpus": [{"index": 3, "minor": 0, "memory": 1, "cores": 100, "health": "Healthy"}]}',
            "not 0..0",
        ),
        (
            '{"version": 1, "gpus": [{"index": 0, "minor": 0, "memory": 1, "cores": 100, "health": "Healthy",'
            '"nvlinkPeers": [0]}]}',
            "nvlinkPeers [0]",
        ),
    ],
)
def test_bad_annotations_are_named(text: str, problem: str) -> None:
    with pytest.raises(InventoryError, match=problem.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        decode(text)


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    sim = ApiServerSimulator()
    sim.start()
    sim.add_node("n1")
    yield sim
    sim.stop()


def node_inventory(api: ApiServerSimulator, node: str = "n1") -> dict[str, object] | None:
    found = api.get_node(node)
    text = ((found or {}).get("metadata") or {}).get("annotations", {}).get(ANNOTATION)
    return json.loads(text) if text else None


def test_publisher_coalesces_changes_and_survives_an_outage(api: ApiServerSimulator) -> None:
    gpus, topology = spec_gpus("v100-pcie-x4")
    health = {i: True for i in range(4)}
    pub = InventoryPublisher(
        api.component_client("device-plugin"), "n1", gpus, topology, lambda: dict(health), share_mode=True
    )
    pub.start()
    try:
        wait_for(lambda: node_inventory(api) is not None, what="first publication")
        api.clear_requests()
        for i in range(4):  # a burst of changes
            health[i] = False
            pub.changed()
        wait_for(lambda: all(g["health"] == "Unhealthy" for g in node_inventory(api)["gpus"]))  # type: ignore[index]
        patches = [r for r in api.requests if r.method == "PATCH"]
        assert 1 <= len(patches) <= 2, patches  # coalesced: at most one per second
        api.set_down(True)
        health[2] = True
        returned = threading.Event()
        threading.Thread(target=lambda: (pub.changed(), returned.set())).start()
        assert returned.wait(5)  # the caller (the health listener) never waits for the API server
        wait_for(lambda: pub.failures > 0, what="a failed publication")
        api.set_down(False)
        wait_for(lambda: node_inventory(api)["gpus"][2]["health"] == "Healthy", timeout=20)  # type: ignore[index]
    finally:
        pub.stop()


def test_publisher_waits_for_its_node(api: ApiServerSimulator) -> None:
    gpus, topology = spec_gpus("t4-x1")
    pub = InventoryPublisher(api.component_client("device-plugin"), "late", gpus, topology, dict, share_mode=True)
    pub.start()
    try:
        wait_for(lambda: pub.failures > 0, what="a 404")
        api.add_node("late")
        wait_for(lambda: node_inventory(api, "late") is not None, timeout=20)
    finally:
        pub.stop()


def test_agent_publishes_its_gpus_and_their_health(tmp_path: Path, sim_built: Path) -> None:
    flags = ["--health-quiet-period=2s", "--health-probe-period=200ms"]
    with SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=flags) as cluster:
        wait_for(lambda: node_inventory(cluster.api, NODE) is not None, what="the agent's inventory")
        inv = node_inventory(cluster.api, NODE)
        assert inv is not None and inv["shareMode"] is True
        gpus = inv["gpus"]
        assert isinstance(gpus, list) and len(gpus) == 8
        assert {g["model"] for g in gpus} == {"NVIDIA H100 80GB HBM3"} and {g["nvlinkGroup"] for g in gpus} == {0}
        assert cluster.agent is not None
        cluster.agent.wait_for_log("watching XID events on 8 of 8 GPUs")
        gpusim(cluster.agent, "xid", "--gpu", "5", "--xid", "79")
        wait_for(lambda: node_inventory(cluster.api, NODE)["gpus"][5]["health"] == names.UNHEALTHY)  # type: ignore[index]
        assert [g["health"] for g in node_inventory(cluster.api, NODE)["gpus"]].count("Healthy") == 7  # type: ignore[index]
        wait_for(lambda: node_inventory(cluster.api, NODE)["gpus"][5]["health"] == names.HEALTHY, timeout=20)  # type: ignore[index]
        port = cluster.agent.query_port
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200
