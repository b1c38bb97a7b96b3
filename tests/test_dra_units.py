"""DRA mode's pieces on their own: the ResourceSlice publisher against the API-server simulator,
claim parsing, the claim records, and the scheduler stand-in's capacity rounding."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from gpumanager.allocation import claims as claim_records
from gpumanager.allocation.allocator import AllocationError, Allocator, AllocatorSettings
from gpumanager.allocation.journal import read_document
from gpumanager.allocation.response import ResponseSettings
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import devices
from gpumanager.dra.claims import ClaimError, ClaimRef, parse_claim
from gpumanager.dra.publisher import SlicePublisher
from gpumanager.topology import build_tree
from simnode.apiserver import ApiServerSimulator
from simnode.dra_scheduler import rounded

GiB = 1 << 30
GPUS = [
    GPUInfo(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", i, 81559 << 20, f"00000000:{i + 7:02x}:00.0", 0) for i in range(4)
]
TOPOLOGY = NodeTopology(
    levels=tuple(tuple(0 if i == j else 40 for j in range(4)) for i in range(4)), nvlink=((0, 1, 18), (2, 3, 18))
)


@pytest.fixture
def sim() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator() as s:
        yield s


def slices(sim: ApiServerSimulator) -> list[dict[str, Any]]:
    api = k8s.ResourceV1Api(sim.client())
    items: list[dict[str, Any]] = json.loads(api.list_resource_slice(_preload_content=False).data)["items"]
    return items


def test_publisher_removes_stale_slices_never_rewrites_an_equal_one_and_bumps_generations(
    sim: ApiServerSimulator, tmp_path: Path
) -> None:
    api = k8s.ResourceV1Api(sim.client())
    taints: dict[int, devices.Taint] = {}

    content = _slice_content(tmp_path, gpus=GPUS, topology=TOPOLOGY, taints=taints)

    stale = {"metadata": {"name": "node-a-old"}, "spec": content(7)}
    other_node = {"metadata": {"name": "node-b-vcuda.tencent.com"}, "spec": {**content(1), "nodeName": "node-b"}}
    api.create_resource_slice(stale)
    api.create_resource_slice(other_node)
    pub = SlicePublisher(sim.component_client("dra"), node="node-a", driver="vcuda.tencent.com", content=content)
    assert pub.sync() is True
    names = sorted(s["metadata"]["name"] for s in slices(sim))
    assert names == ["node-a-vcuda.tencent.com", "node-b-vcuda.tencent.com"], "only our node's stale slice goes"
    ours = next(s for s in slices(sim) if s["metadata"]["name"] == "node-a-vcuda.tencent.com")
    assert ours["spec"]["pool"]["generation"] == 8, "above every generation seen in the pool"
    # Quantities are compared by value (the server answers canonical forms): a second sync writes nothing.
    assert ours["spec"]["devices"][0]["capacity"]["memory"]["value"] == "81408Mi"
    assert devices.published_memory(GPUS[0]) == 81408 << 20
    assert pub.sync() is False and pub.writes == 1
    taints[2] = devices.Taint("XID 79", "2026-11-23T00:00:00Z")
    assert pub.sync() is True
    ours = next(s for s in slices(sim) if s["metadata"]["name"] == "node-a-vcuda.tencent.com")
    assert ours["spec"]["pool"]["generation"] == 9
    assert ours["spec"]["devices"][2]["taints"][0]["value"] == "xid-79"
    groups = [d["attributes"]["nvlinkGroup"]["int"] for d in ours["spec"]["devices"]]
    assert groups == [0, 0, 2, 2]


def _slice_content(
    sysfs_root: Path,
    *,
    gpus: list[Any] | None = None,
    topology: NodeTopology | None = None,
    taints: dict[int, devices.Taint] | None = None,
) -> Callable[[int], dict[str, Any]]:
    """node-a's slice content by pool generation (by default one healthy GPU); ``taints`` is read at
    each call (a test may change it)."""
    held = {} if taints is None else taints

    def content(generation: int) -> dict[str, Any]:
        return devices.slice_spec(
            node="node-a",
            driver="vcuda.tencent.com",
            gpus=GPUS[:1] if gpus is None else gpus,
            topology=topology or NodeTopology(levels=((0,),)),
            taints=held,
            generation=generation,
            sysfs_root=sysfs_root,
        )

    return content


def test_publisher_puts_back_a_deleted_slice(sim: ApiServerSimulator, tmp_path: Path) -> None:
    content = _slice_content(tmp_path)
    pub = SlicePublisher(sim.component_client("dra"), node="node-a", driver="vcuda.tencent.com", content=content)
    pub.start()
    try:
        assert sim.wait_for_watches(1, timeout=10)
        k8s.ResourceV1Api(sim.client()).delete_resource_slice("node-a-vcuda.tencent.com")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not slices(sim):
            time.sleep(0.05)
        [back] = slices(sim)
        assert back["spec"]["pool"]["generation"] == 2
    finally:
        pub.stop()


def test_publisher_reports_a_server_that_is_down(sim: ApiServerSimulator, tmp_path: Path) -> None:
    errors: list[str] = []
    pub = SlicePublisher(
        sim.client(retries=False),
        node="node-a",
        driver="vcuda.tencent.com",
        content=lambda g: devices.slice_spec(
            node="node-a",
            driver="vcuda.tencent.com",
            gpus=GPUS[:1],
            topology=NodeTopology(levels=((0,),)),
            taints={},
            generation=g,
            sysfs_root=tmp_path,
        ),
        on_error=errors.append,
    )
    sim.set_down(True)
    assert pub._sync_logged() is False
    assert errors and "node-a-vcuda.tencent.com" in errors[0] and "503" in errors[0]
    sim.set_down(False)
    assert pub._sync_logged() is True and pub.last_error == ""


def pcie_sysfs(tmp_path: Path) -> Path:
    """A sysfs where GPU 0's PCI device sits under root complex pci0000:00."""
    real = tmp_path / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:07:00.0"
    real.mkdir(parents=True)
    link = tmp_path / "bus" / "pci" / "devices"
    link.mkdir(parents=True)
    (link / "0000:07:00.0").symlink_to(real)
    return tmp_path


def test_pcie_root_from_sysfs(tmp_path: Path) -> None:
    root = pcie_sysfs(tmp_path)
    assert devices.pcie_root("00000000:07:00.0", root) == "pci0000:00"
    assert devices.pcie_root("00000000:08:00.0", root) is None
    dev = devices.device(GPUS[0], driver="d", nvlink_group=None, pcie="pci0000:00", taint=None)
    assert dev["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert "nvlinkGroup" not in dev["attributes"]


def claim(results: list[dict[str, Any]], uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": results}}}}


def result(device: str = "gpu-0", **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": "vcuda.tencent.com", "pool": "node-a", "device": device, **extra}


REF = ClaimRef("ml", "c", "u1")


def parse(data: dict[str, Any]) -> Any:
    return parse_claim(data, REF, driver="vcuda.tencent.com", pool="node-a", gpus=GPUS)


def test_claim_results_become_shares_and_whole_gpus() -> None:
    share, _ = parse(claim([result(shareID="s1", consumedCapacity={"cores": "30", "memory": "4Gi"})]))
    [d] = share.devices
    assert (d.cores, d.memory, d.whole, d.share_id, d.minor) == (30, 4 * GiB, False, "s1", 0)
    whole, _ = parse(claim([result("gpu-1"), result("gpu-3")]))
    assert [(d.device, d.whole, d.cores) for d in whole.devices] == [("gpu-1", True, 100), ("gpu-3", True, 100)]
    full, _ = parse(claim([result(shareID="s", consumedCapacity={"cores": "100", "memory": "81408Mi"})]))
    assert full.devices[0].whole, "all of both capacities is a whole GPU"
    _, tolerant = parse(
        claim([result("gpu-2", tolerations=[{"key": "vcuda.tencent.com/unhealthy", "operator": "Exists"}])])
    )
    assert tolerant == frozenset({2})


@pytest.mark.parametrize(
    ("results", "text"),
    [
        ([result(shareID="a", consumedCapacity={"cores": "30"}), result("gpu-1")], "must hold one device"),
        ([result(consumedCapacity={"cores": "150"})], "'150'"),
        ([result(consumedCapacity={"memory": "lots"})], "'lots'"),
        ([result(consumedCapacity={"shares": "1"})], "shares"),
        ([result(pool="node-b")], "pool 'node-b'"),
        ([result(shareID="a", consumedCapacity={"cores": "\u0663\u0660"})], "'\u0663\u0660'"),  # Arabic-Indic 30
    ],
)
def test_bad_results_are_named(results: list[dict[str, Any]], text: str) -> None:
    with pytest.raises(ClaimError) as err:
        parse(claim(results))
    assert "ml/c" in str(err.value) and text in str(err.value)


def test_claim_records_survive_the_checkpoint_and_bad_entries_are_skipped(tmp_path: Path) -> None:
    tree = build_tree(GPUS, TOPOLOGY)

    class NoPods:
        def synced(self) -> bool:
            return True

        def pods(self) -> list[Any]:
            return []

        def get(self, uid: str) -> None:
            return None

        def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
            return 0, frozenset()

        def refresh(self) -> list[Any]:
            return []

        def recent(self, within: float, since: float) -> list[Any] | None:
            return None

    settings = AllocatorSettings(True, ResponseSettings("n", "o", str(tmp_path / "vm")))
    path = tmp_path / "cp" / "gpumanager_internal_checkpoint"
    a = Allocator(gpus=GPUS, tree=tree, pods=NoPods(), settings=settings, checkpoint_path=path)
    share, _ = parse(claim([result(shareID="s1", consumedCapacity={"cores": "60", "memory": "8Gi"})]))
    assert a.prepare_claim(share) is True and a.prepare_claim(share) is False
    second, _ = parse(claim([result(shareID="s2", consumedCapacity={"cores": "50", "memory": "1Gi"})]))
    with pytest.raises(AllocationError, match="cores=50"):
        a.prepare_claim(type(second)(uid="u2", namespace="ml", name="c2", devices=second.devices))
    a.compact()  # the snapshot catches up with the journal
    data = json.loads(path.read_text())
    data["Claims"]["broken"] = {"Namespace": "ml", "Name": "x", "Devices": [{"Minor": "zero"}]}
    path.write_text(json.dumps(data))
    found, problems = claim_records.from_json(data)
    assert [c.uid for c in found] == ["u1"] and problems and "broken" in problems[0]
    b = Allocator(
        gpus=GPUS,
        tree=build_tree(GPUS, TOPOLOGY),
        pods=NoPods(),
        settings=settings,
        checkpoint_path=path,
    )
    loaded = b.load()
    assert b.claims() == [share] and "broken" in loaded.problems[0]
    assert b.claims_in_doubt, "a claim entry was lost: the claims on disk are checked against the API server"
    assert b.unprepare_claim("u1") == share and b.unprepare_claim("u1") is None
    b.compact()  # the snapshot is written from the state: the bad entry is gone with u1
    assert "Claims" not in (read_document(path) or {})


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(None, "80Gi"), ("1", "256Mi"), ("300Mi", "512Mi"), ("4Gi", "4Gi"), ("81Gi", None)],
)
def test_scheduler_rounds_requests_by_the_policy(requested: str | None, expected: str | None) -> None:
    cap = {
        "value": "80Gi",
        "requestPolicy": {"default": "80Gi", "validRange": {"min": "256Mi", "max": "80Gi", "step": "256Mi"}},
    }
    got = rounded(cap, requested)
    assert got == (None if expected is None else Decimal(k8s_quantity(expected)))


def k8s_quantity(text: str) -> int:
    from simnode.apiserver_quantity import value

    return int(value(text))


def test_slice_comparison_is_by_quantity_value_not_text() -> None:
    from gpumanager.dra.publisher import _comparable

    desired = {"pool": {"generation": 3}, "devices": [{"capacity": {"memory": {"value": "81920Mi"}}}]}
    live = {"pool": {"generation": 4}, "devices": [{"capacity": {"memory": {"value": "80Gi"}}}]}
    assert _comparable(desired) == _comparable(live)
    live["devices"][0]["capacity"]["memory"]["value"] = "79Gi"
    assert _comparable(desired) != _comparable(live)


@pytest.mark.parametrize(
    ("gate", "dropped"),
    [("DRADeviceTaints", "taints"), ("DRAConsumableCapacity", "allowMultipleAllocations")],
)
def test_publisher_settles_when_the_server_drops_fields_of_a_gate_that_is_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, gate: str, dropped: str
) -> None:
    # Kubernetes 1.35 with only DRAConsumableCapacity on (as documented) has DRADeviceTaints off:
    # the server keeps the slice but drops the taint of an unhealthy GPU. Each write then comes
    # back as a watch event whose content differs from ours: the publisher must not answer with
    # another write (and another generation) forever, and must say what the server dropped.
    content = _slice_content(
        tmp_path, gpus=GPUS, topology=TOPOLOGY, taints={1: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    )

    with ApiServerSimulator(disabled_features=[gate]) as sim:
        pub = SlicePublisher(sim.component_client("dra"), node="node-a", driver="vcuda.tencent.com", content=content)
        with caplog.at_level("WARNING", logger="gpumanager.dra.publisher"):
            pub.start()
            try:
                assert sim.wait_for_watches(1, timeout=10)
                time.sleep(2.0)
                [stored] = slices(sim)
                assert dropped not in json.dumps(stored["spec"]), "the simulator drops the field"
                # Dropped taints: found out by a dry run, and written once, without the tainted
                # device (its scheduler would place claims on it); test_dra_review2 checks where
                # claims go.
                assert pub.writes == 1, f"the slice was written {pub.writes} times"
                assert stored["spec"]["pool"]["generation"] == 1
            finally:
                pub.stop()
        said = "drops device taints" if gate == "DRADeviceTaints" else "did not keep"
        warnings = [r.getMessage() for r in caplog.records if said in r.getMessage()]
        assert len(warnings) == 1 and "node-a-vcuda.tencent.com" in warnings[0], warnings
        assert gate == "DRADeviceTaints" or dropped in warnings[0], warnings
        # Content that changes (the GPU recovers) is still written.
        pub2 = SlicePublisher(
            sim.component_client("dra"),
            node="node-a",
            driver="vcuda.tencent.com",
            content=lambda g: {**content(g), "devices": content(g)["devices"][:2]},
        )
        assert pub2.sync() is True


def _owners(sim: ApiServerSimulator) -> list[Any]:
    [ours] = slices(sim)
    return list(ours["metadata"].get("ownerReferences") or [])


def test_the_slice_is_owned_by_its_node_so_it_goes_with_the_node(sim: ApiServerSimulator, tmp_path: Path) -> None:
    # The garbage collector deletes a ResourceSlice with the Node that owns it: without the owner a
    # node removed from the cluster (scaled down, renamed) left its slice for ever.
    content = _slice_content(tmp_path)
    pub = SlicePublisher(sim.component_client("dra"), node="node-a", driver="vcuda.tencent.com", content=content)
    # No Node object (yet): published all the same, without an owner, and not rewritten for it.
    assert pub.sync() is True and _owners(sim) == []
    assert pub.sync() is False
    # The node registers: the slice gets it as owner (one write), then settles.
    node = sim.add_node("node-a")
    assert pub.sync() is True
    assert _owners(sim) == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": node["metadata"]["uid"], "controller": True}
    ]
    assert pub.sync() is False
    # A slice published by an earlier version, with no owner, gets one.
    api = k8s.ResourceV1Api(sim.client())
    [ours] = slices(sim)
    del ours["metadata"]["ownerReferences"]
    api.replace_resource_slice(ours["metadata"]["name"], ours)
    assert _owners(sim) == []
    assert pub.sync() is True and [o["uid"] for o in _owners(sim)] == [node["metadata"]["uid"]]
