"""DRA mode: which prepared claim a pod's claim name means when a claim of that name was deleted
and made again while the old one is still prepared (its pod still terminating), and what
admin-access containers request."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpumanager.vmanager import files
from simnode.cgroup_files import make_cgroup
from simnode.dra_cluster import DRIVER, NODE
from tests.dra_claim_fixtures import DRAClient, result, start_dra_node, stop_dra_node

JSON = dict[str, Any]


@pytest.fixture
def v100(tmp_path: Path, sim_built: Path) -> Iterator[DRAClient]:
    """A four-GPU DRA node (v100-pcie-x4), pods' status written at once."""
    client = start_dra_node(tmp_path / "node", "v100-pcie-x4")
    client.cluster.status_lag = 0
    try:
        yield client
    finally:
        stop_dra_node(client)


def make_pod(node: DRAClient, name: str, claims: dict[str, str], uses: Sequence[str] = ("gpu",)) -> JSON:
    """A pod on the node whose container ``main`` uses the pod claims ``uses`` (``claims``: pod claim
    name -> ResourceClaim name)."""
    body: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": k, "resourceClaimName": v} for k, v in claims.items()],
            "containers": [{"name": "main", "image": "cuda:12", "resources": {"claims": [{"name": u} for u in uses]}}],
        },
    }
    out: JSON = json.loads(node.cluster.core.create_namespaced_pod("default", body, _preload_content=False).data)
    return out


def run_pod(node: DRAClient, pod: JSON, pid: int) -> None:
    """The pod's container runs (status Running with its container ID) with process ``pid`` in its cgroup."""
    uid = pod["metadata"]["uid"]
    cid = f"{uid[:8]}main".replace("-", "")
    make_cgroup(node.cluster.cgroup_root / "kubepods" / f"pod{uid}" / cid, [pid])
    status = {
        "phase": "Running",
        "qosClass": "BestEffort",
        "containerStatuses": [
            {
                "name": "main",
                "containerID": f"containerd://{cid}",
                "ready": True,
                "restartCount": 0,
                "image": "cuda:12",
                "imageID": "",
                "state": {"running": {"startedAt": "2026-11-21T10:00:00Z"}},
            }
        ],
    }
    node.cluster.core.patch_namespaced_pod_status(
        pod["metadata"]["name"], "default", {"status": status}, _content_type="application/merge-patch+json"
    )


def make_claim(node: DRAClient, name: str, results: Sequence[JSON], pods: Sequence[JSON]) -> JSON:
    """A ResourceClaim allocated ``results`` and reserved for ``pods``."""
    api = node.cluster.resource
    body: JSON = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    created: JSON = json.loads(api.create_namespaced_resource_claim("default", body, _preload_content=False).data)
    created["status"] = {
        "allocation": {"devices": {"results": list(results)}},
        "reservedFor": [{"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in pods],
    }
    out: JSON = json.loads(
        api.replace_namespaced_resource_claim_status(name, "default", created, _preload_content=False).data
    )
    return out


def delete_claim(node: DRAClient, name: str) -> None:
    node.cluster.resource.delete_namespaced_resource_claim(name, "default", grace_period_seconds=0)


def terminate(node: DRAClient, pod: JSON) -> None:
    """The pod is being deleted (deletionTimestamp); its containers have not stopped yet."""
    node.cluster.core.delete_namespaced_pod(pod["metadata"]["name"], "default", grace_period_seconds=30)
    stored = node.cluster.pod(pod["metadata"]["name"])
    assert stored["metadata"].get("deletionTimestamp"), "the pod stays, terminating"


def http_json(node: DRAClient, path: str) -> Any:
    agent = node.cluster.agent
    assert agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.query_port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def metrics(node: DRAClient) -> str:
    agent = node.cluster.agent
    assert agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.query_port}/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


def wait_for(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``check`` until it holds; the caller asserts the outcome after (never a timing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)


def pids_of(node: DRAClient, uid: str) -> list[int]:
    path = node.cluster.vm_path / uid / "pids.config"
    return files.read_pids(path) if path.exists() else []


def recreated(
    node: DRAClient, old_results: Sequence[JSON], new_results: Sequence[JSON]
) -> tuple[JSON, JSON, JSON, JSON]:
    """Claim ``c`` prepared for pod ``old`` (running process 4001); ``old`` terminating, ``c`` deleted and
    made again, reserved for pod ``new`` (process 4002) and prepared too. Returns (old pod, old claim,
    new pod, new claim)."""
    old = make_pod(node, "old", {"gpu": "c"})
    run_pod(node, old, 4001)
    c1 = make_claim(node, "c", old_results, [old])
    assert node.prepare(node.ref(c1))[c1["metadata"]["uid"]].error == ""
    terminate(node, old)
    delete_claim(node, "c")
    new = make_pod(node, "new", {"gpu": "c"})
    run_pod(node, new, 4002)
    c2 = make_claim(node, "c", new_results, [new])
    assert c2["metadata"]["uid"] != c1["metadata"]["uid"]
    assert node.prepare(node.ref(c2))[c2["metadata"]["uid"]].error == ""
    return old, c1, new, c2


# -- 1. a claim deleted and made again under the same name --------------------------------------------


def test_recreated_claim_never_gets_the_old_claims_processes(v100: DRAClient) -> None:
    old, c1, new, c2 = recreated(
        v100,
        [result("gpu-0", cores="30", memory="1Gi", share="s-old")],
        [result("gpu-1", cores="20", memory="1Gi", share="s-new")],
    )
    uid1, uid2 = c1["metadata"]["uid"], c2["metadata"]["uid"]
    wait_for("both pids.config", lambda: 4001 in pids_of(v100, uid1) and 4002 in pids_of(v100, uid2))
    assert pids_of(v100, uid1) == [4001], "the old claim's interceptor counts its own pod's processes only"
    assert pids_of(v100, uid2) == [4002], "the new claim's interceptor counts its own pod's processes only"

    usage = http_json(v100, "/usage")["usage"]
    assert usage[old["metadata"]["uid"]]["spec"]["main"] == {"gpu": 0.3, "mem": 1024.0}
    assert usage[new["metadata"]["uid"]]["spec"]["main"] == {"gpu": 0.2, "mem": 1024.0}

    users = [ln for ln in metrics(v100).splitlines() if ln.startswith("gpu_manager_claim_containers{")]
    assert sorted(users) == sorted(
        [
            f'gpu_manager_claim_containers{{claim="c",claim_uid="{uid1}",namespace="default",pod="old"}} 1.0',
            f'gpu_manager_claim_containers{{claim="c",claim_uid="{uid2}",namespace="default",pod="new"}} 1.0',
        ]
    )


def test_recreated_claim_is_matched_after_a_restart_of_the_agent(v100: DRAClient) -> None:
    """The pods each claim is reserved for are not in the checkpoint: after a restart, the claim the
    API server has now tells them apart."""
    _old, c1, _new, c2 = recreated(
        v100,
        [result("gpu-0", cores="30", memory="1Gi", share="s-old")],
        [result("gpu-1", cores="20", memory="1Gi", share="s-new")],
    )
    uid1, uid2 = c1["metadata"]["uid"], c2["metadata"]["uid"]
    cluster = v100.cluster
    assert cluster.agent is not None
    cluster.agent.stop()
    for uid in (uid1, uid2):
        (cluster.vm_path / uid / "pids.config").unlink(missing_ok=True)
    v100.close()
    cluster.start_agent()
    v100.__init__(cluster)  # type: ignore[misc]  # a channel to the new socket
    wait_for("both pids.config", lambda: 4001 in pids_of(v100, uid1) and 4002 in pids_of(v100, uid2))
    assert pids_of(v100, uid2) == [4002]
    assert pids_of(v100, uid1) == [4001]


def test_sharing_check_reads_the_recreated_claim_not_the_old_one(v100: DRAClient) -> None:
    """The old ``c`` is a share, the new ``c`` a whole GPU: a container using the new ``c`` and a whole
    GPU ``w`` is fine, and ``w`` is prepared."""
    recreated(
        v100,
        [result("gpu-0", cores="30", memory="1Gi", share="s-old")],
        [result("gpu-1")],
    )
    both = make_pod(v100, "both", {"gpu": "c", "w": "w"}, uses=("gpu", "w"))
    w = make_claim(v100, "w", [result("gpu-2")], [both])
    # c (new) is reserved for "both" too
    api = v100.cluster.resource
    stored = json.loads(api.read_namespaced_resource_claim("c", "default", _preload_content=False).data)
    stored["status"]["reservedFor"].append({"resource": "pods", "name": "both", "uid": both["metadata"]["uid"]})
    api.replace_namespaced_resource_claim_status("c", "default", stored, _preload_content=False)
    answer = v100.prepare(v100.ref(w))[w["metadata"]["uid"]]
    assert answer.error == ""


# -- 2. admin access is monitoring access, not a share ------------------------------------------------


@pytest.fixture
def t4_legacy(tmp_path: Path, sim_built: Path) -> Iterator[DRAClient]:
    """A one-GPU DRA node with upstream's container_* families on."""
    client = start_dra_node(tmp_path / "node", "t4-x1", flags=["--legacy-metrics"])
    client.cluster.status_lag = 0
    try:
        yield client
    finally:
        stop_dra_node(client)


def test_admin_access_container_requests_nothing(t4_legacy: DRAClient) -> None:
    node = t4_legacy
    worker = make_pod(node, "worker", {"gpu": "share"})
    run_pod(node, worker, 5001)
    share = make_claim(node, "share", [result("gpu-0", cores="30", memory="1Gi", share="s-1")], [worker])
    monitor = make_pod(node, "monitor", {"gpu": "admin"})
    run_pod(node, monitor, 5002)
    admin = {**result("gpu-0"), "adminAccess": True}
    watch = make_claim(node, "admin", [admin], [monitor])
    answers = node.prepare(node.ref(share), node.ref(watch))
    assert [a.error for a in answers.values()] == ["", ""]

    worker_uid, monitor_uid = worker["metadata"]["uid"], monitor["metadata"]["uid"]
    wait_for("the worker in /usage", lambda: worker_uid in http_json(node, "/usage")["usage"])
    usage = http_json(node, "/usage")["usage"]
    assert usage[worker_uid]["spec"]["main"] == {"gpu": 0.3, "mem": 1024.0}
    assert usage.get(monitor_uid, {}).get("spec", {}).get("main", {}).get("gpu", 0.0) == 0.0, (
        "an admin-access container requests no share of the GPU"
    )

    text = metrics(node)
    requests = [
        ln for ln in text.splitlines() if ln.startswith("container_request_gpu_") and 'pod_name="monitor"' in ln
    ]
    assert all(ln.endswith(" 0") for ln in requests), requests
    limits = [ln for ln in text.splitlines() if ln.startswith("gpu_manager_container_gpu_") and 'pod="monitor"' in ln]
    assert limits == [], "left out of the per-container families, as the claim families leave it out"
    # The claim families: the admin claim consumes nothing (no series), its container is listed as a user.
    assert f'claim_uid="{watch["metadata"]["uid"]}"' not in "".join(
        ln for ln in text.splitlines() if ln.startswith("gpu_manager_claim_gpu_core_ratio{")
    )


# -- 3. the node renamed: claims recorded under the old pool -------------------------------------------


def test_claims_of_the_old_pool_are_named_once_at_start_and_stay_enforced(tmp_path: Path, sim_built: Path) -> None:
    node = start_dra_node(tmp_path / "node", "t4-x1")
    try:
        cluster = node.cluster
        worker = make_pod(node, "worker", {"gpu": "share"})
        share = make_claim(node, "share", [result("gpu-0", cores="30", memory="1Gi", share="s-1")], [worker])
        uid = share["metadata"]["uid"]
        assert node.prepare(node.ref(share))[uid].error == ""
        assert cluster.agent is not None
        cluster.agent.stop()
        before = len(cluster.agent.log_text())
        # The node comes back under another name: the agent's pool is now "renamed".
        cluster.api.add_node("renamed")
        cluster._agent_flags.append("--hostname-override=renamed")
        node.close()
        agent = cluster.start_agent()
        node.__init__(cluster)  # type: ignore[misc]  # a channel to the new socket
        line = f"{uid}"
        agent.wait_for_log("renamed", timeout=20)
        wait_for("the start's line", lambda: line in agent.log_text()[before:] and "pool" in agent.log_text()[before:])
        since = agent.log_text()[before:]
        named = [ln for ln in since.splitlines() if uid in ln and "sim-node" in ln and "'renamed'" in ln]
        assert len(named) == 1, since[-3000:]
        assert "default/share" in named[0]

        # Still prepared and enforced: its files are there, its 30 cores held, the kubelet's retry answered.
        assert (cluster.vm_path / uid / "vcuda.config").exists()
        assert (cluster.cdi_root / f"{DRIVER}-{uid}.json").exists()
        assert node.prepare(node.ref(share))[uid].error == ""
        big = make_claim(
            node, "big", [result("gpu-0", cores="80", memory="1Gi", share="s-2", pool="renamed")], [worker]
        )
        assert "cores" in node.prepare(node.ref(big))[big["metadata"]["uid"]].error
        assert http_json(node, "/healthz")["claims"] == 1
        assert len([ln for ln in agent.log_text()[before:].splitlines() if uid in ln and "'renamed'" in ln]) == 1
    finally:
        stop_dra_node(node)


def test_claim_of_the_old_pool_whose_record_was_lost_is_rebuilt_and_holds_its_gpu(
    tmp_path: Path, sim_built: Path
) -> None:
    """Renamed, and the checkpoint lost: the claim's files say this node prepared it, so its rebuild from
    the API server takes its results' pool (the old name) and it holds its GPU again."""
    node = start_dra_node(tmp_path / "node", "t4-x1")
    try:
        cluster = node.cluster
        worker = make_pod(node, "worker", {"gpu": "share"})
        share = make_claim(node, "share", [result("gpu-0", cores="30", memory="1Gi", share="s-1")], [worker])
        uid = share["metadata"]["uid"]
        assert node.prepare(node.ref(share))[uid].error == ""
        assert cluster.agent is not None
        cluster.agent.stop()
        for path in cluster.checkpoint_dir.iterdir():
            if path.is_file():
                path.unlink()
        cluster.api.add_node("renamed")
        cluster._agent_flags.append("--hostname-override=renamed")
        node.close()
        cluster.start_agent()
        node.__init__(cluster)  # type: ignore[misc]  # a channel to the new socket
        wait_for("the rebuild", lambda: http_json(node, "/healthz")["claims"] == 1)
        assert http_json(node, "/healthz")["claims"] == 1
        assert (cluster.vm_path / uid / "vcuda.config").exists()
        big = make_claim(
            node, "big", [result("gpu-0", cores="80", memory="1Gi", share="s-2", pool="renamed")], [worker]
        )
        assert "cores" in node.prepare(node.ref(big))[big["metadata"]["uid"]].error
    finally:
        stop_dra_node(node)
