"""The kubelet DRA stand-in as unkind as the kubelet's DRA manager, and the agent under it.

Facts (kubelet pkg/kubelet/cm/dra): a claim enters the claim-info cache, with the pod's reference,
before NodePrepareResources is called; it is marked prepared only when every call for the pod
succeeded, and that mark is not checkpointed (a kubelet restart sends the claim again with the
next pod sandbox that uses it); a pod missing from a claim's ``reservedFor`` is refused; every claim
holding a gone pod's reference is unprepared, prepared or not; an Unprepare error keeps every claim
of the call in the cache."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from simnode.dra_cluster import DRIVER, DRACluster, claim_pod, claim_template
from simnode.dra_kubelet import VERSIONS, PrepareFailed
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]

JSON = dict[str, Any]


def reserve(client: DRAClient, claim: JSON, pods: Sequence[JSON]) -> JSON:
    """Write ``reservedFor`` (the pods) into the claim's status; returns it as stored."""
    claim = json.loads(
        client.cluster.resource.read_namespaced_resource_claim(
            claim["metadata"]["name"], claim["metadata"]["namespace"], _preload_content=False
        ).data
    )
    claim["status"]["reservedFor"] = [
        {"resource": "pods", "name": p["metadata"]["name"], "uid": p["metadata"]["uid"]} for p in pods
    ]
    stored: JSON = json.loads(
        client.cluster.resource.replace_namespaced_resource_claim_status(
            claim["metadata"]["name"], claim["metadata"]["namespace"], claim, _preload_content=False
        ).data
    )
    return stored


def pod(name: str, claims: Sequence[str]) -> JSON:
    """A bound pod whose one container uses every claim (by resourceClaimName)."""
    return {
        "metadata": {"name": name, "namespace": "default", "uid": str(uuid.uuid4())},
        "spec": {
            "resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)],
            "containers": [{"name": "main", "resources": {"claims": [{"name": f"c{i}"} for i in range(len(claims))]}}],
        },
    }


def calls_for(client: DRAClient, claim: str) -> int:
    """NodePrepareResources calls the kubelet made that named ``claim``."""
    kubelet = client.cluster.kubelet
    assert kubelet is not None
    return sum(1 for driver, names in kubelet.prepare_calls if driver == DRIVER and claim in names)


def test_kubelet_restart_sends_a_prepared_claim_again_with_the_next_pod(dra_node: DRAClient) -> None:
    kubelet = dra_node.cluster.kubelet
    assert kubelet is not None
    claim = dra_node.claim("shared", [result(cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    first, second = pod("first", ["shared"]), pod("second", ["shared"])
    reserve(dra_node, claim, [first, second])
    started = kubelet.start_pod(first)
    before = kubelet.registrations(DRIVER)
    kubelet.restart()
    kubelet.wait_registered(DRIVER, after=before)
    again = kubelet.start_pod(second)
    assert calls_for(dra_node, "shared") == 2, "the prepared mark does not survive a kubelet restart"
    assert again["main"].cdi_ids == started["main"].cdi_ids and again["main"].env == started["main"].env
    assert kubelet.stop_pod(first["metadata"]["uid"]) == {}
    assert dra_node.spec_path(claim["metadata"]["uid"]).exists(), "the second pod still uses the claim"
    assert kubelet.stop_pod(second["metadata"]["uid"]) == {}
    assert not dra_node.spec_path(claim["metadata"]["uid"]).exists()


def test_one_claim_failing_sends_the_whole_call_again_and_both_are_unprepared(dra_node: DRAClient) -> None:
    kubelet = dra_node.cluster.kubelet
    assert kubelet is not None
    good = dra_node.claim("good", [result(cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    bad = dra_node.claim("bad", [result("gpu-7", cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    p = pod("both", ["good", "bad"])
    reserve(dra_node, good, [p])
    reserve(dra_node, bad, [p])
    for attempt in (1, 2):
        with pytest.raises(PrepareFailed) as failed:
            kubelet.start_pod(p)
        assert list(failed.value.errors) == ["bad"] and "gpu-7" in failed.value.errors["bad"]
        assert calls_for(dra_node, "good") == attempt, "no claim of a failed call is marked prepared"
    assert dra_node.spec_path(good["metadata"]["uid"]).exists()
    assert not any(c.prepared for c in kubelet.claims.values())
    # The pod goes: both claims hold its reference, so both are unprepared.
    assert kubelet.stop_pod(p["metadata"]["uid"]) == {}
    assert kubelet.claims == {}
    assert not dra_node.spec_path(good["metadata"]["uid"]).exists()
    assert not (dra_node.cluster.vm_path / good["metadata"]["uid"]).exists()


def test_a_pod_missing_from_reserved_for_is_refused_before_any_call(dra_node: DRAClient) -> None:
    kubelet = dra_node.cluster.kubelet
    assert kubelet is not None
    claim = dra_node.claim("theirs", [result(cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    reserve(dra_node, claim, [pod("owner", ["theirs"])])
    with pytest.raises(PrepareFailed) as failed:
        kubelet.start_pod(pod("intruder", ["theirs"]))
    assert "is not allowed to use ResourceClaim theirs" in failed.value.errors["theirs"]
    assert calls_for(dra_node, "theirs") == 0 and kubelet.claims == {}


def test_a_spec_the_runtime_refuses_fails_only_its_containers_until_a_prepare_writes_it_again(
    dra_node: DRAClient,
) -> None:
    kubelet = dra_node.cluster.kubelet
    assert kubelet is not None
    mine = dra_node.claim("mine", [result(cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    other = dra_node.claim("other", [result(cores="30", memory="4Gi", share=str(uuid.uuid4()))])
    first, second, third = pod("first", ["mine"]), pod("second", ["mine"]), pod("third", ["other"])
    reserve(dra_node, mine, [first, second])
    reserve(dra_node, other, [third])
    kubelet.start_pod(first)
    spec_file = dra_node.spec_path(mine["metadata"]["uid"])
    good = spec_file.read_text()
    spec_file.write_text(good.replace('"containerEdits"', '"containerEdit"', 1))  # an unknown field
    with pytest.raises(RuntimeError, match="unresolvable CDI device"):
        kubelet.start_pod(second)
    kubelet.start_pod(third)  # another claim's spec still loads
    # The kubelet sends the claim again after a restart; the agent writes the spec again.
    before = kubelet.registrations(DRIVER)
    kubelet.restart()
    kubelet.wait_registered(DRIVER, after=before)
    kubelet.start_pod(second)
    assert json.loads(spec_file.read_text()) == json.loads(good)


@pytest.fixture
def t4(tmp_path: Any, sim_built: Any) -> Any:
    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        yield cluster


def test_admin_access_is_given_a_full_gpu_and_takes_none_of_it(t4: DRACluster) -> None:
    t4.add_template(claim_template("all", cores=100, memory="15Gi"))
    admin = claim_template("monitor")
    admin["spec"]["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
    t4.add_template(admin)
    t4.add_template(claim_template("small", cores=10, memory="1Gi"))
    t4.create_pod(claim_pod("worker", "all"))
    t4.settle()
    t4.create_pod(claim_pod("watcher", "monitor"))
    t4.settle()
    assert t4.pod("watcher")["status"]["phase"] == "Running", t4.kubelet and t4.prepare_errors
    [res] = t4.claim_of("watcher")["status"]["allocation"]["devices"]["results"]
    assert res["adminAccess"] is True and res["device"] == "gpu-0"
    [work] = t4.claim_of("worker")["status"]["allocation"]["devices"]["results"]
    assert work["adminAccess"] is False
    t4.end_pod("worker")
    t4.settle()
    t4.create_pod(claim_pod("next", "small"))
    t4.settle()
    assert t4.pod("next")["status"]["phase"] == "Running", "the admin claim holds none of the GPU"


def test_a_refused_registration_is_tried_again_and_the_agent_becomes_ready(t4: DRACluster) -> None:
    kubelet = t4.kubelet
    assert kubelet is not None and t4.agent is not None
    kubelet.stop()
    kubelet.versions = ("v9.DRAPlugin",)  # a kubelet that speaks none of the driver's versions
    before = kubelet.registrations(DRIVER)
    kubelet.start()
    deadline = time.monotonic() + 20
    while not any(name == DRIVER and result != "ok" for _, name, result in kubelet.registration_log):
        assert time.monotonic() < deadline, "never refused"
        time.sleep(0.05)
    url = f"http://127.0.0.1:{t4.agent.query_port}/readyz"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert "none of the supported versions" in json.loads(err.value.read())["registration_error"]
    kubelet.versions = VERSIONS  # the same socket, no new file: only the plugin manager's retry registers it
    assert kubelet.wait_registered(DRIVER, after=before).version == "v1.DRAPlugin"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                assert json.loads(resp.read())["registered"] is True
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline + 10, "never ready after the retry registered it"
            time.sleep(0.1)


@pytest.mark.parametrize("service", ["v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"])
def test_a_kubelet_of_each_health_api_version_reads_the_health_stream(t4: DRACluster, service: str) -> None:
    kubelet = t4.kubelet
    assert kubelet is not None
    kubelet.stop()
    kubelet.health_service = service
    before = kubelet.registrations(DRIVER)
    kubelet.start()
    kubelet.wait_registered(DRIVER, after=before)
    deadline = time.monotonic() + 20
    while kubelet.device_health(DRIVER).get("gpu-0") is None:
        assert time.monotonic() < deadline, f"no health report through {service}"
        time.sleep(0.05)
    assert kubelet.device_health(DRIVER)["gpu-0"][0] == 1  # HEALTHY


def test_a_driver_whose_dra_socket_is_dead_loses_its_slice_and_publishes_it_again(t4: DRACluster) -> None:
    """The kubelet watches the gRPC connection: a driver killed without removing its sockets is
    not usable, and its slices go ``slice_wipe_delay`` later; the restarted agent publishes again."""
    kubelet = t4.kubelet
    assert kubelet is not None and t4.agent is not None
    kubelet.slice_wipe_delay = 1.0
    assert t4.wait_slice(lambda s: s is not None) is not None
    t4.agent.signal(signal.SIGKILL)
    t4.agent.wait()
    assert (t4.registry_dir / f"{DRIVER}-reg.sock").exists(), "a killed agent leaves its sockets"
    assert t4.wait_slice(lambda s: s is None) is None
    before = kubelet.registrations(DRIVER)
    t4.start_agent()
    kubelet.wait_registered(DRIVER, after=before)
    assert t4.wait_slice(lambda s: s is not None) is not None
