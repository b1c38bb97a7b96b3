"""A container that uses a share claim is held to that share, whatever other claims it lists.

A container's limits are one vcuda.config, mounted at /etc/vcuda from the claim's CDI spec; the
runtime merges the edits of several specs in the order the container lists its claims, the last
mount and env winning. A container listing a share and, after it, another claim of the driver
(a whole GPU, or a second share) got the other claim's /etc/vcuda: the share's GPU was no longer
held to the share. Either such a container is refused at Prepare, or it runs with the share's limits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpumanager.vmanager import files
from simnode.dra_cluster import DRACluster, claim_template

JSON = dict[str, Any]


@pytest.fixture
def node(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path / "node", "v100-pcie-x4") as c:
        c.add_template(claim_template("share", cores=30, memory="4Gi"))
        c.add_template(claim_template("share2", cores=50, memory="8Gi"))
        c.add_template(claim_template("whole"))
        c.add_template(claim_template("whole2"))
        c.add_template(claim_template("pair", count=2))
        yield c


def _pod(name: str, claims: Sequence[str], containers: dict[str, Sequence[str]]) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": c, "resourceClaimTemplateName": c} for c in claims],
            "containers": [
                {"name": n, "image": "cuda:12", "resources": {"claims": [{"name": c} for c in uses]}}
                for n, uses in containers.items()
            ],
        },
    }


def _effective_config(c: DRACluster, pod_uid: str, container: str) -> files.VcudaConfig | None:
    assert c.kubelet is not None
    run = c.kubelet.containers[(pod_uid, container)]
    mount = run.mounts.get("/etc/vcuda")
    if mount is None:
        return None
    path = Path(mount) / "vcuda.config"
    return files.unpack(path.read_bytes()) if path.exists() else None


@pytest.mark.parametrize(
    "order",
    [("share", "whole"), ("whole", "share"), ("share", "share2"), ("share2", "share")],
    ids=["share-then-whole", "whole-then-share", "share-then-share", "share2-then-share"],
)
def test_a_container_with_a_share_claim_never_runs_without_its_limits(node: DRACluster, order: list[str]) -> None:
    created = node.create_pod(_pod("mixed", order, {"main": order}))
    node.settle()
    uid = created["metadata"]["uid"]
    assert node.kubelet is not None
    if (uid, "main") in node.kubelet.containers:
        config = _effective_config(node, uid, "main")
        limits = {"share": (30, 4 << 30), "share2": (50, 8 << 30)}
        wanted = [limits[c] for c in order if c in limits]
        assert config is not None and config.enable == 1, "the container runs without the share's limits"
        assert (config.utilization, config.gpu_memory) in wanted
        assert len(wanted) == 1, "a container with two shares runs with one share's limits on both GPUs"
        return
    errors = node.prepare_errors.get(uid)
    assert errors, "the pod neither started nor got an error"
    text = " ".join(errors.values())
    assert "main" in text and "default/mixed" in text, errors


def test_claims_used_by_different_containers_of_a_pod_are_fine(node: DRACluster) -> None:
    created = node.create_pod(_pod("split", ["share", "whole"], {"a": ["share"], "b": ["whole"]}))
    node.settle()
    uid = created["metadata"]["uid"]
    assert node.prepare_errors.get(uid) is None
    config = _effective_config(node, uid, "a")
    assert config is not None and (config.enable, config.utilization, config.gpu_memory) == (1, 30, 4 << 30)


def _uuids(c: DRACluster) -> dict[str, str]:
    """/dev/nvidia<minor> -> the GPU's UUID, as the ResourceSlice says."""
    published = c.slice()
    assert published is not None
    return {
        f"/dev/nvidia{d['name'].rsplit('-', 1)[-1]}": d["attributes"]["uuid"]["string"]
        for d in published["spec"]["devices"]
    }


@pytest.mark.parametrize(
    "order",
    [("whole", "whole2"), ("whole2", "whole"), ("whole", "pair"), ("pair", "whole")],
    ids=["whole-then-whole", "whole2-then-whole", "whole-then-pair", "pair-then-whole"],
)
def test_a_container_with_several_whole_gpu_claims_is_told_every_gpu(node: DRACluster, order: list[str]) -> None:
    """The runtime keeps the last spec's env: no spec names GPUs (NVIDIA_VISIBLE_DEVICES=void in each), and
    the container gets the device nodes of every claim it uses."""
    created = node.create_pod(_pod("many", order, {"main": order}))
    node.settle()
    uid = created["metadata"]["uid"]
    assert node.prepare_errors.get(uid) is None
    assert node.kubelet is not None
    run = node.kubelet.containers[(uid, "main")]
    gpus = sorted(p for p in run.device_nodes if p[len("/dev/nvidia") :].isdigit())
    assert len(gpus) == (3 if "pair" in order else 2)
    assert run.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    if order == ("whole", "whole2"):  # kept across an agent restart, which writes every spec again
        specs = {p: p.read_text() for p in node.cdi_root.glob("*.json")}
        assert node.agent is not None
        assert node.agent.stop() == 0
        for path in specs:
            path.unlink()
        node.start_agent()
        assert {p: p.read_text() for p in node.cdi_root.glob("*.json")} == specs


def test_containers_with_one_claim_each_are_told_their_own_gpus(node: DRACluster) -> None:
    created = node.create_pod(_pod("apart", ["whole", "whole2"], {"a": ["whole"], "b": ["whole2"]}))
    node.settle()
    uid = created["metadata"]["uid"]
    assert node.kubelet is not None
    seen = []
    for name in ("a", "b"):
        run = node.kubelet.containers[(uid, name)]
        gpus = [p for p in run.device_nodes if p[len("/dev/nvidia") :].isdigit()]
        assert len(gpus) == 1 and run.env["NVIDIA_VISIBLE_DEVICES"] == "void"
        seen += gpus
    assert len(set(seen)) == 2


def test_no_claim_spec_names_the_gpus_of_another_claim(node: DRACluster) -> None:
    """c1 uses two whole-GPU claims, c2 only one of them: CDI applies a spec's own edits to every
    container using any of its devices, so a GPU of the other claim named there reached c2 (and, with
    nvidia-container-runtime as the default runtime, the GPU itself). No spec names a GPU: each device
    brings its own node, and NVIDIA_VISIBLE_DEVICES is "void" in every spec, as NVIDIA's specs have it."""
    created = node.create_pod(_pod("leak", ["whole", "whole2"], {"c1": ["whole", "whole2"], "c2": ["whole"]}))
    node.settle()
    uid = created["metadata"]["uid"]
    assert node.prepare_errors.get(uid) is None
    assert node.kubelet is not None
    uuids = _uuids(node)
    c1 = node.kubelet.containers[(uid, "c1")]
    c2 = node.kubelet.containers[(uid, "c2")]
    gpus1 = sorted(p for p in c1.device_nodes if p[len("/dev/nvidia") :].isdigit())
    gpus2 = sorted(p for p in c2.device_nodes if p[len("/dev/nvidia") :].isdigit())
    assert len(gpus1) == 2 and len(gpus2) == 1 and set(gpus2) < set(gpus1)
    other = uuids[next(p for p in gpus1 if p not in gpus2)]
    assert all(other not in v for v in c2.env.values()), c2.env
    assert c1.env["NVIDIA_VISIBLE_DEVICES"] == c2.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    for path in node.cdi_root.glob("*.json"):
        assert not any(u in path.read_text() for u in uuids.values()), path.read_text()
    config = _effective_config(node, uid, "c1")
    assert config is not None and config.enable == 0, "whole GPUs: no limit"


def test_a_container_sees_every_gpu_whatever_pod_prepared_its_claims_first(node: DRACluster) -> None:
    """A claim prepared for another pod first is never rewritten; with a GPU list in each claim's env,
    last-wins left a later container with the GPUs of one claim only. The env names no GPU now."""
    first = node.create_pod(_pod("first", ["whole"], {"m": ["whole"]}))
    node.settle()
    assert node.prepare_errors.get(first["metadata"]["uid"]) is None
    [path] = node.cdi_root.glob("*.json")
    before = path.read_text()
    created = node.create_pod(_pod("second", ["whole2"], {"m": ["whole2"]}))
    node.settle()
    assert node.kubelet is not None
    for pod in (first, created):
        run = node.kubelet.containers[(pod["metadata"]["uid"], "m")]
        assert run.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert path.read_text() == before
