"""DRA mode: claims the kubelet never unprepares (its DRA state lost, a pod force-deleted while it was down) are
freed once the API server has positively said they are gone; and the ResourceSlice is withdrawn while the kubelet
refuses the driver or its sockets cannot be served."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from simnode.dra_cluster import DRIVER, NODE, DRACluster
from tests.test_dra_review11 import make_claim

JSON = dict[str, Any]


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    # A check period of 1 s: a claim unused for two periods (2 s) is looked at.
    with DRACluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=0) as c:
        yield c


def share(device: str, cores: str, memory: str = "1Gi") -> JSON:
    return {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"cores": cores, "memory": memory},
    }


def healthz(c: DRACluster) -> Any:
    assert c.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}/healthz", timeout=5) as resp:
        return json.loads(resp.read())


def metrics(c: DRACluster) -> str:
    assert c.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout:g} s")


def prepared(c: DRACluster, ref: tuple[str, str, str]) -> None:
    assert c.kubelet is not None
    assert c.kubelet.prepare(DRIVER, [ref])[ref[2]]["error"] == ""
    assert (c.cdi_root / f"{DRIVER}-{ref[2]}.json").exists()


def spec_gone(c: DRACluster, uid: str) -> bool:
    return not (c.cdi_root / f"{DRIVER}-{uid}.json").exists() and not (c.vm_path / uid).exists()


def delete_claim(c: DRACluster, name: str) -> None:
    c.resource.delete_namespaced_resource_claim(name, "default")


def bound_pod(c: DRACluster, name: str, claim: str) -> JSON:
    """A pod on the node whose container uses claim ``claim`` (by name), running."""
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [{"name": "main", "image": "cuda:12", "resources": {"claims": [{"name": "gpu"}]}}],
        },
    }
    pod: JSON = json.loads(c.core.create_namespaced_pod("default", manifest, _preload_content=False).data)
    c.core.patch_namespaced_pod_status(
        name, "default", {"status": {"phase": "Running"}}, _content_type="application/merge-patch+json"
    )
    return pod


# -- 1. leaked claims ----------------------------------------------------------------------------


def test_a_deleted_claim_the_kubelet_never_unprepares_is_freed(cluster: DRACluster) -> None:
    """The kubelet lost its DRA state: a claim it prepared is deleted from the API server and never unprepared.
    The agent frees it (its capacity, its CDI spec and directory), says so in one line naming it and its GPU,
    and a claim needing all of that GPU is prepared afterwards."""
    ref = make_claim(cluster, "leaked", [share("gpu-1", "60")])
    prepared(cluster, ref)
    delete_claim(cluster, "leaked")
    wait_for("the leaked claim freed", lambda: spec_gone(cluster, ref[2]))
    assert healthz(cluster)["claims"] == 0
    assert cluster.agent is not None
    line = next(ln for ln in cluster.agent.log_text().splitlines() if ref[2] in ln and "freed" in ln)
    assert "default/leaked" in line and "gpu-1" in line, line
    assert healthz(cluster)["leaked_claims_freed"] == 1
    assert "gpu_manager_dra_leaked_claims_freed_total 1.0" in metrics(cluster)
    whole = make_claim(cluster, "after", [share("gpu-1", "100")])
    prepared(cluster, whole)


def test_a_claim_recreated_under_its_name_frees_the_old_one(cluster: DRACluster) -> None:
    """A claim of the same name with another UID: the old claim is gone."""
    old = make_claim(cluster, "again", [share("gpu-0", "50")])
    prepared(cluster, old)
    delete_claim(cluster, "again")
    new = make_claim(cluster, "again", [share("gpu-2", "50")])
    assert new[2] != old[2]
    wait_for("the old claim freed", lambda: spec_gone(cluster, old[2]))
    assert healthz(cluster)["claims"] == 0


def test_a_claim_the_api_server_still_has_is_kept(cluster: DRACluster) -> None:
    """No pod uses it, but the API server still has it (a pod may come): kept."""
    ref = make_claim(cluster, "kept", [share("gpu-0", "50")])
    prepared(cluster, ref)
    time.sleep(5)
    assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1


def test_a_deleted_claim_a_pod_on_the_node_still_names_is_kept(cluster: DRACluster) -> None:
    """Gone from the API server, but a running pod of the node names it: kept until that pod goes."""
    ref = make_claim(cluster, "used", [share("gpu-0", "50")])
    prepared(cluster, ref)
    bound_pod(cluster, "user", "used")
    delete_claim(cluster, "used")
    time.sleep(5)
    assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1
    cluster.core.delete_namespaced_pod("user", "default", grace_period_seconds=0)
    wait_for("the claim freed once its pod went", lambda: spec_gone(cluster, ref[2]))


def test_an_api_server_that_errs_or_hangs_frees_nothing(cluster: DRACluster) -> None:
    """Only a positive answer (404, or another UID) frees a claim: errors and a hanging GET free nothing, and the
    claim is freed once the API server answers again."""
    ref = make_claim(cluster, "unsure", [share("gpu-3", "50")])
    prepared(cluster, ref)
    cluster.api.fail_next("GET", r"/resourceclaims/unsure$", 503, count=100000)
    delete_claim(cluster, "unsure")
    time.sleep(5)
    assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1
    cluster.api.clear_faults()
    cluster.api.delay(r"/resourceclaims/unsure$", 60, method="GET")
    time.sleep(5)
    assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1
    cluster.api.clear_faults()
    wait_for("the claim freed once the API server answers", lambda: spec_gone(cluster, ref[2]), timeout=40)


# -- 2. the slice withdrawn while the driver cannot be served ------------------------------------


@pytest.fixture
def fast(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    # The sockets' watch every 0.2 s: a refusal or unserved sockets lasting two passes (at least 1 s) withdraw.
    with DRACluster(tmp_path, "t4-x1", agent_flags=["--kubelet-watch-period=0.2"], status_lag=0) as c:
        yield c


def refused(c: DRACluster) -> bool:
    assert c.kubelet is not None
    return any(name == DRIVER and result != "ok" for _, name, result in c.kubelet.registration_log)


def test_the_slice_is_withdrawn_while_the_kubelet_refuses_the_driver(fast: DRACluster) -> None:
    """A kubelet that refuses the registration (here: it speaks none of the driver's versions) cannot prepare a
    claim: the slice it deletes at its start is not published again, so no claim is placed on these GPUs; it is
    published again once the kubelet registers the driver."""
    from simnode.dra_kubelet import VERSIONS

    kubelet = fast.kubelet
    assert kubelet is not None and fast.agent is not None
    kubelet.stop()
    kubelet.versions = ("v9.DRAPlugin",)
    before = kubelet.registrations(DRIVER)
    kubelet.start()
    wait_for("the registration refused", lambda: refused(fast))
    fast.wait_slice(lambda s: s is None, timeout=10)
    time.sleep(3)  # the agent's slice watch, its periodic passes: it stays withdrawn
    assert fast.slice() is None
    assert "withdrawn" in healthz(fast)["slice_withdrawn"]
    assert "gpu_manager_dra_slice_withdrawn 1.0" in metrics(fast)
    log = fast.agent.log_text()
    assert log.count("withdrawing ResourceSlice") == 1, log[-3000:]
    kubelet.versions = VERSIONS
    kubelet.wait_registered(DRIVER, after=before, timeout=60)
    fast.wait_slice(lambda s: s is not None, timeout=20)
    assert "publishing ResourceSlice" in fast.agent.log_text()
    assert healthz(fast)["slice_withdrawn"] == ""
    assert "gpu_manager_dra_slice_withdrawn 0.0" in metrics(fast)


def test_the_slice_is_withdrawn_while_the_sockets_cannot_be_served(fast: DRACluster) -> None:
    """The directory of dra.sock replaced by a file: the sockets cannot be served again, no claim can be prepared.
    The slice is withdrawn (and not published again when the kubelet deletes it), then published again once the
    sockets are served again."""
    import shutil

    kubelet = fast.kubelet
    assert kubelet is not None and fast.agent is not None
    before = kubelet.registrations(DRIVER)
    shutil.rmtree(fast.plugin_dir)
    fast.plugin_dir.write_text("not a directory\n")
    fast.agent.wait_for_log("cannot serve the DRA sockets again", timeout=30)
    fast.wait_slice(lambda s: s is None, timeout=10)
    kubelet.restart()  # deletes the node's slices at its start
    time.sleep(3)
    assert fast.slice() is None
    fast.plugin_dir.unlink()
    kubelet.wait_registered(DRIVER, after=before, timeout=30)
    fast.wait_slice(lambda s: s is not None, timeout=20)


def test_a_kubelet_restart_does_not_withdraw_the_slice(fast: DRACluster) -> None:
    """A kubelet restart that removes the sockets: served again, registered again, the slice published again,
    never withdrawn."""
    kubelet = fast.kubelet
    assert kubelet is not None and fast.agent is not None
    for _ in range(3):
        before = kubelet.registrations(DRIVER)
        kubelet.restart(wipe_sockets=True, plugin_dirs=[fast.plugin_dir])
        kubelet.wait_registered(DRIVER, after=before, timeout=30)
        fast.wait_slice(lambda s: s is not None, timeout=20)
    time.sleep(2)
    assert fast.slice() is not None
    assert "withdrawing ResourceSlice" not in fast.agent.log_text()


def test_a_force_deleted_pod_whose_containers_still_run_keeps_its_claim(cluster: DRACluster) -> None:
    """A pod force-deleted while the kubelet was down: its containers run until the kubelet is back (its cgroup
    is there). Its claim, deleted too, is kept while that cgroup is there, and freed once it is gone."""
    ref = make_claim(cluster, "forced", [share("gpu-0", "50")])
    prepared(cluster, ref)
    pod = bound_pod(cluster, "forced-pod", "forced")
    uid = pod["metadata"]["uid"]
    cgroup = cluster.cgroup_root / "kubepods" / f"pod{uid}" / "c1"
    cgroup.mkdir(parents=True)
    time.sleep(3)  # the agent's checks see the pod use the claim
    cluster.core.delete_namespaced_pod("forced-pod", "default", grace_period_seconds=0)
    delete_claim(cluster, "forced")
    time.sleep(5)
    assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1
    cgroup.rmdir()
    cgroup.parent.rmdir()
    wait_for("the claim freed once the pod's containers stopped", lambda: spec_gone(cluster, ref[2]))
