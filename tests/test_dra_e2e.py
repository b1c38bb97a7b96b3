"""DRA mode end to end on the simulated node: the agent (``--mode=dra``) with the API-server simulator,
the claim controller and scheduler stand-ins and the kubelet DRA stand-in, through real gRPC and the
real kubernetes client."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager.vmanager import files
from simnode.dra_cluster import DRIVER, NODE, DRACluster, claim_pod, claim_template

GiB = 1 << 30


@pytest.fixture
def t4(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        yield cluster


def http_json(cluster: DRACluster, path: str) -> Any:
    assert cluster.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def test_slice_publishes_each_gpu_once_with_consumable_capacity(t4: DRACluster) -> None:
    s = t4.slice()
    assert s is not None
    spec = s["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE and spec["pool"]["name"] == NODE
    [dev] = spec["devices"]
    assert dev["name"] == "gpu-0" and dev["allowMultipleAllocations"] is True
    cores = dev["capacity"]["cores"]
    assert cores["value"] == "100" and cores["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}
    memory = dev["capacity"]["memory"]
    assert memory["value"] == "15Gi"  # 15360 MiB, canonical form
    assert memory["requestPolicy"]["validRange"]["step"] == "256Mi"
    attrs = dev["attributes"]
    assert attrs["productName"] == {"string": "Tesla T4"} and attrs["index"] == {"int": 0}
    assert attrs["uuid"]["string"].startswith("GPU-")
    assert "resource.kubernetes.io/numaNode" in attrs


def test_shares_fill_one_gpu_and_a_third_waits_until_one_ends(t4: DRACluster) -> None:
    t4.add_template(claim_template("c30", cores=30, memory="4Gi"))
    t4.add_template(claim_template("c60", cores=60, memory="8Gi"))
    t4.add_template(claim_template("c20", cores=20, memory="1Gi"))
    t4.create_pod(claim_pod("p30", "c30"))
    t4.create_pod(claim_pod("p60", "c60"))
    t4.settle()
    t4.create_pod(claim_pod("p20", "c20"))
    t4.settle()
    assert t4.pod("p30")["status"]["phase"] == "Running"
    assert t4.pod("p60")["status"]["phase"] == "Running"
    assert not t4.pod("p20")["spec"].get("nodeName"), "20 more cores do not fit next to 30 + 60"
    assert t4.scheduler is not None and "cannot allocate" in t4.scheduler.pending["default/p20"]

    claim30 = t4.claim_of("p30")
    [result] = claim30["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0" and result["consumedCapacity"] == {"cores": "30", "memory": "4Gi"}
    config = files.unpack((t4.vm_path / claim30["metadata"]["uid"] / "vcuda.config").read_bytes())
    assert (config.gpu_memory, config.utilization, config.enable) == (4 * GiB, 30, 1)
    spec_file = t4.cdi_root / f"{DRIVER}-{claim30['metadata']['uid']}.json"
    spec = json.loads(spec_file.read_text())
    assert spec["kind"] == f"{DRIVER}/gpu"
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["VCUDA_CONFIG_PATH"] == "/etc/vcuda/vcuda.config"
    assert env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    assert mounts["/etc/vcuda"]["hostPath"] == str(t4.vm_path / claim30["metadata"]["uid"])
    assert "ro" in mounts["/usr/local/nvidia"]["options"] and "bind" in mounts["/usr/local/nvidia"]["options"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia0"

    health = http_json(t4, "/healthz")
    assert health["mode"] == "dra" and health["claims"] == 2 and health["registered"] is True

    t4.end_pod("p60")
    t4.settle()
    assert t4.pod("p20")["spec"].get("nodeName") == NODE
    assert t4.pod("p20")["status"]["phase"] == "Running"
    # p60's claim is unprepared: its CDI spec and directory are gone, p20's are there.
    uid20 = t4.claim_of("p20")["metadata"]["uid"]
    specs = sorted(p.name for p in t4.cdi_root.iterdir())
    assert len(specs) == 2 and f"{DRIVER}-{uid20}.json" in specs
    assert len([d for d in t4.vm_path.iterdir() if d.is_dir()]) == 2
