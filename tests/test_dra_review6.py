"""DRA mode: a claim's consumers while the agent's pod cache has not listed pods yet, and late joiners.

Facts (kubelet pkg/kubelet/cm/dra): the kubelet calls NodePrepareResources for a claim once per node;
a second pod reserved in the same claim is started from the kubelet's claim-info cache without a
call, and the claim is unprepared when the last pod referring to it goes. So the agent learns of a
claim's pods only from the API server (its pod cache, and the claims' ``reservedFor``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager.vmanager import files
from simnode.dra_cluster import DRIVER, DRACluster, claim_pod, claim_template


@pytest.fixture
def t4(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        yield cluster


def _metrics(cluster: DRACluster) -> list[str]:
    assert cluster.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}/metrics", timeout=5) as resp:
        return [ln for ln in resp.read().decode().splitlines() if not ln.startswith("#")]


def _wait_pids(path: Path, want: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    got: list[int] = []
    while time.monotonic() < deadline:
        got = files.read_pids(path) if path.exists() else []
        if got == want:
            break
        time.sleep(0.1)
    return got


def test_a_restarted_agent_keeps_claims_pids_until_its_pod_cache_has_listed_pods(t4: DRACluster) -> None:
    # Before its first pod list the agent does not know which containers use a claim: it must not
    # write the claim's pids.config empty (the interceptor would stop counting the processes only
    # the agent lists), nor show the claim with no containers.
    t4.add_template(claim_template("c30", cores=30, memory="4Gi"))
    t4.create_pod(claim_pod("p", "c30"), commands={"main": ["sleep", "60"]})
    t4.settle()
    assert t4.kubelet is not None
    pod = t4.pod("p")
    run = t4.kubelet.containers[(pod["metadata"]["uid"], "main")]
    assert run.proc is not None
    claim = t4.claim_of("p")
    uid = claim["metadata"]["uid"]
    path = t4.vm_path / uid / "pids.config"
    assert _wait_pids(path, [run.proc.pid]) == [run.proc.pid]

    assert t4.agent is not None
    t4.agent.stop()
    t4.api.fail_next("GET", r"^/api/v1/pods$", 500, count=1_000_000, message="etcd is slow")
    t4.start_agent()
    t4.agent.wait_for_log("the pod cache is not synced yet", timeout=20)
    time.sleep(3)  # three pids.config refresh periods
    assert files.read_pids(path) == [run.proc.pid], "pids.config was rewritten without the pod cache"
    lines = _metrics(t4)
    claim_lines = [ln for ln in lines if ln.startswith("gpu_manager_claim_gpu_core_ratio{")]
    assert len(claim_lines) == 1 and f'claim_uid="{uid}"' in claim_lines[0] and claim_lines[0].endswith(" 0.3")
    # Which containers use the claim is not known yet: no per-container series and no claim users,
    # rather than series with wrong or empty labels.
    assert not [ln for ln in lines if ln.startswith(("gpu_manager_container_", "gpu_manager_claim_containers"))]

    t4.api.clear_faults()
    assert _wait_pids(path, [run.proc.pid], timeout=20) == [run.proc.pid]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = _metrics(t4)
        seen = {ln.partition("{")[0] for ln in lines}
        if {"gpu_manager_claim_containers", "gpu_manager_container_gpu_core_limit_ratio"} <= seen:
            break
        time.sleep(0.2)
    users = [ln for ln in lines if ln.startswith("gpu_manager_claim_containers{")]
    assert len(users) == 1 and f'claim_uid="{uid}"' in users[0] and 'pod="p"' in users[0], users
    [limit] = [ln for ln in lines if ln.startswith("gpu_manager_container_gpu_core_limit_ratio{")]
    assert 'container="main"' in limit and 'namespace="default"' in limit and 'pod="p"' in limit, limit
    assert limit.endswith(" 0.3"), limit


def _http_json(cluster: DRACluster, path: str) -> Any:
    assert cluster.agent is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}{path}", timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # /readyz answers 503 with the same body
        return json.loads(exc.read())


def test_consumable_capacity_off_on_the_api_server_is_said_in_the_log_health_and_metrics(
    tmp_path: Path, sim_built: Path
) -> None:
    # Kubernetes 1.34, or 1.35 without the DRAConsumableCapacity gate: the API server drops
    # allowMultipleAllocations and requestPolicy from the slice without an error, and its scheduler
    # gives each GPU to one claim, whole. The agent must say so where an operator looks.
    with DRACluster(tmp_path / "node", "t4-x1", features_off=["DRAConsumableCapacity"]) as cluster:
        stored = cluster.slice()
        assert stored is not None and "allowMultipleAllocations" not in json.dumps(stored), "the server drops it"
        assert cluster.agent is not None
        log_text = cluster.agent.wait_for_log("DRAConsumableCapacity is off", timeout=20)
        [line] = [ln for ln in log_text.splitlines() if "DRAConsumableCapacity is off" in ln]
        assert "one claim" in line and "kube-scheduler" in line, line
        deadline = time.monotonic() + 20
        health: Any = {}
        while time.monotonic() < deadline:
            health = _http_json(cluster, "/healthz")
            if "resourceslice-fields" in health.get("errors", {}):
                break
            time.sleep(0.2)
        assert "DRAConsumableCapacity" in health["errors"]["resourceslice-fields"], health
        assert health["feature_gates_off"] == ["DRAConsumableCapacity"], health
        lines = _metrics(cluster)
        assert 'gpu_manager_dra_feature_gate_off{gate="DRAConsumableCapacity"} 1.0' in lines, [
            ln for ln in lines if "gate" in ln
        ]
        assert 'gpu_manager_dra_feature_gate_off{gate="DRADeviceTaints"} 0.0' in lines


def test_a_server_that_keeps_every_field_reports_no_gate_off(tmp_path: Path, sim_built: Path) -> None:
    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        cluster.add_template(claim_template("c30", cores=30, memory="4Gi"))
        cluster.create_pod(claim_pod("p1", "c30"), commands={"main": ["sleep", "60"]})
        cluster.settle()
        assert cluster.pod("p1")["status"]["phase"] == "Running", cluster.prepare_errors
        health = _http_json(cluster, "/healthz")
        assert health["feature_gates_off"] == [] and health["claims"] == 1, health
        assert not {"resourceslice-fields", "scheduler-capacity"} & set(health["errors"]), health
        lines = _metrics(cluster)
        assert 'gpu_manager_dra_feature_gate_off{gate="DRAConsumableCapacity"} 0.0' in lines


def test_consumable_capacity_turned_on_while_the_agent_runs_is_published_at_the_next_sync(tmp_path: Path) -> None:
    # Kubernetes 1.35 without DRAConsumableCapacity: the stored slice lacks allowMultipleAllocations,
    # and the publisher counts it as published. The operator turns the gate on: the agent must offer
    # consumable capacity again at its next sync, not only after a restart (until then every GPU
    # goes to one claim, whole).
    from gpumanager.dra.publisher import SlicePublisher
    from simnode.apiserver import ApiServerSimulator
    from tests.dra_slice_fixtures import DRIVER, settle, slice_content, stored_slices

    seen: list[frozenset[str]] = []
    with ApiServerSimulator(disabled_features=["DRAConsumableCapacity"]) as sim:
        pub = SlicePublisher(
            sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}), on_gates=seen.append
        )
        settle(pub, passes=8)
        [stored] = stored_slices(sim)
        assert not any("allowMultipleAllocations" in d for d in stored["spec"]["devices"])
        assert pub.gates_off == {"DRAConsumableCapacity"} and seen == [frozenset({"DRAConsumableCapacity"})]
        assert settle(pub, passes=8) == 0, "settled: no write on every pass while the gate is off"
        sim.set_disabled_features([])
        settle(pub, passes=8)
        [stored] = stored_slices(sim)
        assert all(d.get("allowMultipleAllocations") is True for d in stored["spec"]["devices"]), stored
        assert pub.gates_off == frozenset() and seen[-1] == frozenset()
        assert settle(pub, passes=8) == 0


def test_an_api_server_without_resource_v1_is_named_as_such(tmp_path: Path) -> None:
    # Kubernetes 1.33 serves only beta versions of resource.k8s.io (and a newer one may have v1 off
    # with --runtime-config): every slice request answers 404 "the server could not find the
    # requested resource". The agent must say that DRA mode needs resource.k8s.io/v1, not leave the
    # operator with a bare 404.
    from gpumanager.dra.publisher import SlicePublisher
    from simnode.apiserver import ApiServerSimulator
    from tests.dra_slice_fixtures import DRIVER, slice_content

    errors: list[str] = []
    with ApiServerSimulator(resource_api=False, version="v1.33.5") as sim:
        pub = SlicePublisher(
            sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, {}), on_error=errors.append
        )
        pub.start()  # the first sync is done before it returns
        pub.stop()
    assert errors and "404" in errors[0], errors
    assert "resource.k8s.io/v1" in errors[0] and "1.34" in errors[0], errors


def _shared_claim(cluster: DRACluster, name: str, cores: int, memory: str) -> None:
    """A ResourceClaim made by hand (not from a template), for pods to name by resourceClaimName."""
    request = {"deviceClassName": DRIVER, "capacity": {"requests": {"cores": str(cores), "memory": memory}}}
    cluster.resource.create_namespaced_resource_claim(
        "default",
        {
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        },
    )


def _series(cluster: DRACluster, family: str) -> dict[str, str]:
    """pod label -> the sample's value, of one family (one series per pod expected)."""
    out = {}
    for ln in _metrics(cluster):
        if ln.startswith(family + "{"):
            labels, _, value = ln.rpartition(" ")
            pod = labels.split('pod="', 1)[1].split('"', 1)[0]
            out[pod] = value
    return out


def test_a_pod_joining_a_prepared_claim_later_is_limited_and_shown_as_the_first(t4: DRACluster) -> None:
    # The kubelet prepares a claim once per node: the second pod's containers start from its cache,
    # with no call to the driver. They must still count in pids.config, the per-container metrics and
    # the claim's users, and the claim stays prepared until the last of them goes.
    _shared_claim(t4, "team", 40, "2Gi")
    for name in ("a", "b"):
        manifest = claim_pod(name, "unused")
        manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "team"}]
        t4.create_pod(manifest, commands={"main": ["sleep", "60"]})
        t4.settle()
        assert t4.pod(name)["status"]["phase"] == "Running", t4.prepare_errors
    assert t4.kubelet is not None
    assert [call for call in t4.kubelet.prepare_calls if "team" in call[1]] == [(DRIVER, ["team"])]
    claim = json.loads(t4.resource.read_namespaced_resource_claim("team", "default", _preload_content=False).data)
    uid = claim["metadata"]["uid"]
    procs = {n: t4.kubelet.containers[(t4.pod(n)["metadata"]["uid"], "main")].proc for n in ("a", "b")}
    pids = {n: p.pid for n, p in procs.items() if p is not None}
    path = t4.vm_path / uid / "pids.config"
    assert _wait_pids(path, sorted(pids.values())) == sorted(pids.values())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(_series(t4, "gpu_manager_container_gpu_core_limit_ratio")) < 2:
        time.sleep(0.2)
    assert _series(t4, "gpu_manager_container_gpu_core_limit_ratio") == {"a": "0.4", "b": "0.4"}
    gib2 = str(float(2 << 30))
    assert _series(t4, "gpu_manager_container_gpu_memory_limit_bytes") == {"a": gib2, "b": gib2}
    assert _series(t4, "gpu_manager_claim_containers") == {"a": "1.0", "b": "1.0"}

    t4.end_pod("a")
    t4.settle()
    assert (t4.vm_path / uid).exists(), "b still uses the claim"
    assert _wait_pids(path, [pids["b"]]) == [pids["b"]]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "a" in _series(t4, "gpu_manager_container_gpu_core_limit_ratio"):
        time.sleep(0.2)
    assert _series(t4, "gpu_manager_container_gpu_core_limit_ratio") == {"b": "0.4"}
    assert _series(t4, "gpu_manager_claim_containers") == {"b": "1.0"}
    t4.end_pod("b")
    t4.settle()
    assert not (t4.vm_path / uid).exists()
    assert _series(t4, "gpu_manager_claim_containers") == {}


def test_a_late_pod_whose_container_uses_a_share_and_another_prepared_claim_is_reported(t4: DRACluster) -> None:
    # At Prepare a claim is refused where a container of its pods uses it and another claim of the
    # driver, one of them a share (the container would run with the other's /etc/vcuda). A pod that
    # joins both claims after their Prepare gets no call: the kubelet starts it from its cache. The
    # agent cannot refuse it; it must say so, naming the pod, the container and the claims.
    _shared_claim(t4, "share", 30, "2Gi")
    _shared_claim(t4, "other", 20, "1Gi")
    for name, claims in (("p1", ["share"]), ("p2", ["other"]), ("p3", ["share", "other"])):
        manifest = claim_pod(name, "unused")
        manifest["spec"]["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in claims]
        manifest["spec"]["containers"][0]["resources"]["claims"] = [{"name": c} for c in claims]
        t4.create_pod(manifest, commands={"main": ["sleep", "60"]})
        t4.settle()
    assert t4.pod("p3")["status"]["phase"] == "Running", "the kubelet calls no driver for prepared claims"
    assert t4.agent is not None
    text = "container main of pod default/p3 uses claims"
    log_text = t4.agent.wait_for_log(text, timeout=20)
    [line] = [ln for ln in log_text.splitlines() if text in ln]
    assert "default/share" in line and "default/other" in line and "not held to" in line, line
    health = _http_json(t4, "/healthz")
    assert text in health["errors"].get("claim-sharing", ""), health
    t4.end_pod("p3")
    t4.settle()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "claim-sharing" in _http_json(t4, "/healthz")["errors"]:
        time.sleep(0.2)
    assert "claim-sharing" not in _http_json(t4, "/healthz")["errors"]


def test_with_consumable_capacity_off_a_share_template_gets_a_whole_gpu_and_the_next_waits(
    tmp_path: Path, sim_built: Path
) -> None:
    # What the agent's report warns of, as the cluster does it: the server drops the template's
    # capacity requests and the slice's allowMultipleAllocations, so the first pod takes the GPU
    # whole (no limits) and the second finds none.
    with DRACluster(tmp_path / "node", "t4-x1", features_off=["DRAConsumableCapacity"]) as cluster:
        cluster.add_template(claim_template("c30", cores=30, memory="4Gi"))
        for name in ("p1", "p2"):
            cluster.create_pod(claim_pod(name, "c30"), commands={"main": ["sleep", "60"]})
            cluster.settle()
        assert cluster.pod("p1")["status"]["phase"] == "Running", cluster.prepare_errors
        assert cluster.pod("p2")["status"].get("phase") != "Running"
        claim = cluster.claim_of("p1")
        assert "capacity" not in json.dumps(claim["spec"]), "the server dropped the capacity request"
        [res] = claim["status"]["allocation"]["devices"]["results"]
        assert "consumedCapacity" not in res and "shareID" not in res, res
        config = files.unpack((cluster.vm_path / claim["metadata"]["uid"] / "vcuda.config").read_bytes())
        assert config.enable == 0, "a whole GPU: no limits"


def test_a_scheduler_that_ignores_consumable_capacity_is_noticed_at_prepare(tmp_path: Path, sim_built: Path) -> None:
    # Kubernetes 1.35 with DRAConsumableCapacity on the API server but not on kube-scheduler: the
    # slice is stored whole, but the scheduler's allocator ignores allowMultipleAllocations and the
    # claims' capacity requests, and gives each GPU to one claim with no consumed capacity. The
    # agent sees it at Prepare (a claim that asks for cores and memory, allocated without them) and
    # must say so, rather than prepare a whole GPU for a 30-core request without a word.
    with DRACluster(tmp_path / "node", "t4-x1", scheduler_features_off=["DRAConsumableCapacity"]) as cluster:
        cluster.add_template(claim_template("c30", cores=30, memory="4Gi"))
        for name in ("p1", "p2"):
            cluster.create_pod(claim_pod(name, "c30"), commands={"main": ["sleep", "60"]})
            cluster.settle()
        assert cluster.pod("p1")["status"]["phase"] == "Running", cluster.prepare_errors
        assert cluster.pod("p2")["status"].get("phase") != "Running", "the GPU went to p1 whole"
        claim = cluster.claim_of("p1")
        assert "capacity" in json.dumps(claim["spec"]) and "consumedCapacity" not in json.dumps(claim["status"])
        assert cluster.agent is not None
        text = "without the capacity it asks for"
        log_text = cluster.agent.wait_for_log(text, timeout=20)
        [line] = [ln for ln in log_text.splitlines() if text in ln]
        assert claim["metadata"]["name"] in line and "kube-scheduler" in line and "DRAConsumableCapacity" in line
        health = _http_json(cluster, "/healthz")
        assert health["feature_gates_off"] == ["DRAConsumableCapacity"], health
        assert text in health["errors"].get("scheduler-capacity", ""), health
        lines = _metrics(cluster)
        assert 'gpu_manager_dra_feature_gate_off{gate="DRAConsumableCapacity"} 1.0' in lines
