"""DRA mode: a server whose handling of device taints changes while the agent runs, claims holding
several shares, and the scheduler simulator allocating them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager.dra import devices
from gpumanager.dra.publisher import SlicePublisher
from simnode.apiserver import ApiServerSimulator
from tests.dra_slice_fixtures import DRIVER, GPUS, settle, slice_content, stored_slices


def _settle(pub: SlicePublisher) -> int:
    """Sync until a pass writes nothing; the number of passes that wrote."""
    return settle(pub, passes=8)


def _published(sim: ApiServerSimulator) -> dict[str, bool]:
    """Device name -> whether it is published with a taint."""
    [stored] = stored_slices(sim)
    return {d["name"]: bool(d.get("taints")) for d in stored["spec"]["devices"]}


def test_taints_are_sent_again_once_the_server_keeps_them(tmp_path: Path) -> None:
    # Kubernetes 1.35 drops device taints; the control plane is upgraded (or the gate turned on)
    # while the agent runs. The agent must notice at its next publication of a taint, not only
    # after a restart: otherwise an unhealthy GPU stays hidden instead of tainted (a claim that
    # tolerates the taint can never get it), for as long as the agent runs.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=["DRADeviceTaints"]) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
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
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        _settle(pub)
        taints[1] = devices.Taint("XID 48", "2026-11-23T00:01:00Z")
        _settle(pub)
        assert stored_slices(sim)[0]["spec"]["devices"] == []
        assert _settle(pub) == 0, "settled: no write on every pass"
        taints.clear()
        _settle(pub)
        assert _published(sim) == {"gpu-0": False, "gpu-1": False}


# -- several shares in one claim ------------------------------------------------------------------


def _two_request_template(name: str, first: tuple[int, str], second: tuple[int, str]) -> dict[str, Any]:
    """A template of two requests, ``a`` and ``b``, each a share (cores, memory)."""

    def request(req: str, cores: int, memory: str) -> dict[str, Any]:
        return {
            "name": req,
            "exactly": {
                "deviceClassName": DRIVER,
                "count": 1,
                "capacity": {"requests": {"cores": str(cores), "memory": memory}},
            },
        }

    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"spec": {"devices": {"requests": [request("a", *first), request("b", *second)]}}},
    }


def _pod_per_request(name: str, template: str) -> dict[str, Any]:
    """A pod whose container ``one`` uses request ``a`` of its claim, ``two`` request ``b``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": template}],
            "containers": [
                {"name": c, "image": "cuda:12", "resources": {"claims": [{"name": "gpu", "request": r}]}}
                for c, r in (("one", "a"), ("two", "b"))
            ],
        },
    }


def test_two_requests_of_one_claim_sharing_one_gpu_are_prepared(tmp_path: Path, sim_built: Path) -> None:
    # The scheduler may place two requests of one claim on the same GPU (allowMultipleAllocations:
    # "multiple requests within a ResourceClaim"), each result a share with its own shareID.
    from gpumanager.vmanager import files
    from simnode.dra_cluster import DRACluster

    with DRACluster(tmp_path / "node", "t4-x1") as node:
        node.add_template(_two_request_template("pair", (30, "4Gi"), (20, "2Gi")))
        node.create_pod(_pod_per_request("p", "pair"))
        node.settle()
        assert node.pod("p")["status"]["phase"] == "Running", node.prepare_errors
        claim = node.claim_of("p")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["device"]) for r in results] == [("a", "gpu-0"), ("b", "gpu-0")]
        assert results[0]["shareID"] != results[1]["shareID"]
        uid = claim["metadata"]["uid"]
        config = files.unpack((node.vm_path / uid / "vcuda.config").read_bytes())
        assert (config.utilization, config.gpu_memory, config.enable) == (50, 6 << 30, 1)
        assert node.kubelet is not None
        pod_uid = node.pod("p")["metadata"]["uid"]
        # Each container is held to the request it names, not to the claim's sum.
        for container, limits in (("one", (30, 4 << 30)), ("two", (20, 2 << 30))):
            run = node.kubelet.containers[(pod_uid, container)]
            assert len(run.cdi_ids) == 1 and "/dev/nvidia0" in run.device_nodes, run
            own = files.unpack((Path(run.mounts["/etc/vcuda"]) / "vcuda.config").read_bytes())
            assert (own.utilization, own.gpu_memory, own.enable) == (*limits, 1), container
        # The node's tree holds both shares; a third claim of 60 cores no longer fits.
        node.add_template(_two_request_template("more", (30, "1Gi"), (30, "1Gi")))
        node.create_pod(_pod_per_request("q", "more"))
        node.settle()
        assert not node.pod("q")["spec"].get("nodeName")


def _slice(sysfs: Path) -> dict[str, Any]:
    spec = slice_content(sysfs, {})(1)
    return {"metadata": {"name": "node-a-vcuda.tencent.com"}, "spec": spec}


CLASS = {
    "metadata": {"name": DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def _claim_of(template: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "c", "namespace": "default"}, "spec": template["spec"]["spec"]}


def test_the_scheduler_stand_in_counts_a_claims_own_shares_on_a_gpu(tmp_path: Path) -> None:
    from simnode.dra_scheduler import Allocator, Selectors

    fits = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [], Selectors())
    both = fits.allocate(_claim_of(_two_request_template("t", (40, "4Gi"), (60, "4Gi"))), "node-a") or []
    assert [(r["request"], r["device"]) for r in both] == [("a", "gpu-0"), ("b", "gpu-0")]
    spill = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [], Selectors())
    apart = spill.allocate(_claim_of(_two_request_template("t", (60, "4Gi"), (60, "4Gi"))), "node-a") or []
    assert [(r["request"], r["device"]) for r in apart] == [("a", "gpu-0"), ("b", "gpu-1")]
    # One request for two devices may take one GPU twice (the real allocator marks a device that
    # allows multiple allocations in use for no claim): a distinctAttribute constraint prevents it.
    from simnode.dra_cluster import claim_template

    twice = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [], Selectors())
    template = claim_template("t", count=2, cores=10, memory="1Gi")
    two = twice.allocate(_claim_of(template), "node-a") or []
    assert [r["device"] for r in two] == ["gpu-0", "gpu-0"] and two[0]["shareID"] != two[1]["shareID"]
    template["spec"]["spec"]["devices"]["constraints"] = [{"requests": ["gpu"], "distinctAttribute": f"{DRIVER}/uuid"}]
    apart_again = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [], Selectors())
    distinct = apart_again.allocate(_claim_of(template), "node-a") or []
    assert sorted(r["device"] for r in distinct) == ["gpu-0", "gpu-1"]


def test_shares_of_two_gpus_in_one_claim_are_refused_naming_the_claim_and_devices() -> None:
    # vcuda.config holds one GPU's limits: shares of two GPUs cannot both be enforced.
    import pytest

    from gpumanager.dra.claims import ClaimError, ClaimRef, parse_claim

    def share(device: str, request: str, sid: str) -> dict[str, Any]:
        return {
            "request": request,
            "driver": DRIVER,
            "pool": "node-a",
            "device": device,
            "shareID": sid,
            "consumedCapacity": {"cores": "60", "memory": "4Gi"},
        }

    results = [share("gpu-0", "a", "s1"), share("gpu-1", "a", "s2")]
    data: dict[str, Any] = {"metadata": {"uid": "u1"}, "status": {"allocation": {"devices": {"results": results}}}}
    with pytest.raises(ClaimError) as err:
        parse_claim(data, ClaimRef("ml", "c", "u1"), driver=DRIVER, pool="node-a", gpus=GPUS)
    text = str(err.value)
    assert "ml/c" in text and "a/gpu-0" in text and "a/gpu-1" in text and "request 'a'" in text
    assert f"matchAttribute: {DRIVER}/uuid" in text
    # Shares of two requests on two GPUs: each request is limited on its own.
    results[:] = [share("gpu-0", "a", "s1"), share("gpu-1", "b", "s2")]
    apart, _ = parse_claim(data, ClaimRef("ml", "c", "u1"), driver=DRIVER, pool="node-a", gpus=GPUS)
    assert apart.per_request and sorted(apart.share_requests) == ["a", "b"]
    results[:] = [share("gpu-1", "a", "s1"), share("gpu-1", "b", "s2")]
    results[1]["consumedCapacity"] = {"cores": "30", "memory": "2Gi"}
    claim, _ = parse_claim(data, ClaimRef("ml", "c", "u1"), driver=DRIVER, pool="node-a", gpus=GPUS)
    assert claim.share_limits == (90, 6 << 30)


def test_a_claim_of_two_shares_of_one_gpu_survives_a_kill_and_holds_their_sum(tmp_path: Path, sim_built: Path) -> None:
    from tests.dra_claim_fixtures import result, start_dra_node, stop_dra_node

    node = start_dra_node(tmp_path / "node")
    try:
        c = node.cluster
        pair = node.claim(
            "pair",
            [
                result(cores="30", memory="4Gi", share="s-1", request="a"),
                result(cores="20", memory="2Gi", share="s-2", request="b"),
            ],
        )
        ref = node.ref(pair)
        node.prepare_killed_after_checkpoint(ref)
        answer = node.prepare(ref)[ref[2]]
        assert answer.error == "" and len(answer.cdi_ids) == 2 and sorted(answer.share_ids) == ["s-1", "s-2"]
        # 50 cores are held: 51 more do not fit, 50 do.
        big = node.claim("big", [result(cores="51", memory="1Gi", share="s-3")])
        assert "cores=51" in node.prepare(node.ref(big))[big["metadata"]["uid"]].error
        # The checkpoint lost: the claim is rebuilt from the API server, both shares held again.
        assert c.agent is not None
        c.agent.stop()
        for f in c.checkpoint_dir.iterdir():
            f.unlink()
        c.start_agent()
        for _ in range(100):
            if "cores=51" in node.prepare(node.ref(big))[big["metadata"]["uid"]].error:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the rebuilt claim does not hold its shares")
        fits = node.claim("fits", [result(cores="50", memory="1Gi", share="s-4")])
        assert node.prepare(node.ref(fits))[fits["metadata"]["uid"]].error == ""
        assert node.unprepare(ref) == {ref[2]: ""}
        assert not node.spec_path(ref[2]).exists()
    finally:
        stop_dra_node(node)


def _record_stored(pub: SlicePublisher) -> list[dict[str, Any]]:
    """Every slice the server stored for the publisher's writes (dry runs are not stored)."""
    stored: list[dict[str, Any]] = []
    rest = pub._rest
    plain = rest.json

    def json_(method: str, path: str, **kwargs: Any) -> Any:
        out = plain(method, path, **kwargs)
        dry = any(k == "dryRun" for k, _ in kwargs.get("query") or ())
        if method in ("POST", "PUT") and not dry and isinstance(out, dict):
            stored.append(out)
        return out

    rest.json = json_  # type: ignore[method-assign]
    return stored


def test_an_unhealthy_gpu_is_never_stored_untainted_where_the_server_drops_taints(tmp_path: Path) -> None:
    # Finding out by a real write that the server drops taints stores the unhealthy GPU untainted,
    # offered to a scheduler that ignores taints anyway, until the next write: a claim placed then
    # can never be prepared. Not at start, and not at any later re-check.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=["DRADeviceTaints"]) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        stored = _record_stored(pub)
        _settle(pub)
        taints[1] = devices.Taint("XID 48", "2026-11-23T00:01:00Z")
        _settle(pub)
        del taints[1]
        _settle(pub)
        offered = [{d["name"] for d in s["spec"]["devices"]} for s in stored]
        assert offered and all("gpu-0" not in names for names in offered), offered


def test_a_gpu_that_stays_unhealthy_is_tainted_once_the_server_keeps_taints(tmp_path: Path) -> None:
    # The gate turned on while the GPU stays unhealthy (nothing else changes): the next resync
    # finds out, and the GPU is published tainted rather than hidden.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=["DRADeviceTaints"]) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        _settle(pub)
        assert _published(sim) == {"gpu-1": False}
        sim._ops.disabled_features = frozenset()
        _settle(pub)
        assert _published(sim) == {"gpu-0": True, "gpu-1": False}


def test_a_uuid_match_keeps_a_claims_shares_on_one_gpu(tmp_path: Path) -> None:
    # First fit puts the second share of a claim on the next GPU when the first has no room left
    # (a claim the agent must refuse); matchAttribute on the GPU's uuid keeps them together.
    from simnode.dra_cluster import claim_template
    from simnode.dra_scheduler import Allocator, Selectors

    taken = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": "node-a",
                            "device": "gpu-0",
                            "shareID": "s-0",
                            "consumedCapacity": {"cores": "60", "memory": "1Gi"},
                        }
                    ]
                }
            }
        }
    }
    template = claim_template("t", count=2, cores=30, memory="1Gi")
    loose = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [taken], Selectors()).allocate(_claim_of(template), "node-a")
    assert [r["device"] for r in loose or []] == ["gpu-0", "gpu-1"]
    template = claim_template("t", count=2, cores=30, memory="1Gi", match_attribute=f"{DRIVER}/uuid")
    tight = Allocator([_slice(tmp_path)], {DRIVER: CLASS}, [taken], Selectors()).allocate(_claim_of(template), "node-a")
    assert [r["device"] for r in tight or []] == ["gpu-1", "gpu-1"]


def test_count_two_shares_land_on_one_gpu_or_are_refused_naming_the_fix(tmp_path: Path, sim_built: Path) -> None:
    # count: 2 of 30 cores: first fit puts both on gpu-0 (prepared, 60 cores together); once
    # gpu-0 has room for one only, the second goes to gpu-1 and the claim is refused at Prepare
    # with the way out; with matchAttribute on the uuid both go to gpu-1 and it runs.
    from gpumanager.vmanager import files
    from simnode.dra_cluster import DRACluster, claim_pod, claim_template

    with DRACluster(tmp_path / "node", "v100-pcie-x4") as node:
        node.add_template(claim_template("two", count=2, cores=30, memory="4Gi"))
        node.create_pod(claim_pod("p", "two"))
        node.settle()
        assert node.pod("p")["status"]["phase"] == "Running", node.prepare_errors
        claim = node.claim_of("p")
        assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == ["gpu-0", "gpu-0"]
        config = files.unpack((node.vm_path / claim["metadata"]["uid"] / "vcuda.config").read_bytes())
        assert (config.utilization, config.gpu_memory) == (60, 8 << 30)
        node.create_pod(claim_pod("q", "two"))
        node.settle()
        q = node.pod("q")
        assert q["status"].get("phase") != "Running"
        [error] = node.prepare_errors[q["metadata"]["uid"]].values()
        assert "gpu-0" in error and "gpu-1" in error and "matchAttribute" in error, error
        node.add_template(claim_template("tight", count=2, cores=30, memory="4Gi", match_attribute=f"{DRIVER}/uuid"))
        node.create_pod(claim_pod("r", "tight"))
        node.settle()
        assert node.pod("r")["status"]["phase"] == "Running", node.prepare_errors


NO_DRY_RUN = 'admission webhook "slices.example.com" does not support dry run'  # a webhook with sideEffects: Unknown


@pytest.mark.parametrize("disabled", [[], ["DRADeviceTaints"]])
def test_a_server_that_refuses_dry_runs_still_gets_the_slice(tmp_path: Path, disabled: list[str]) -> None:
    # A cluster with an admission webhook on ResourceSlices that does not declare sideEffects None
    # refuses every dry run (400): the taint check must not keep the node's GPUs unpublished.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=disabled) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        sim.fail_next("POST", "resourceslices$", 400, 1, message=NO_DRY_RUN)
        _settle(pub)
        assert _published(sim) == ({"gpu-1": False} if disabled else {"gpu-0": True, "gpu-1": False})
        sim.fail_next("PUT", "resourceslices/", 400, 1, message=NO_DRY_RUN)
        taints[1] = devices.Taint("XID 48", "2026-11-23T00:01:00Z")
        _settle(pub)
        assert _published(sim) == ({} if disabled else {"gpu-0": True, "gpu-1": True})


def test_a_kill_inside_unprepare_leaves_the_gpu_free_once_the_kubelet_retries(tmp_path: Path, sim_built: Path) -> None:
    # Killed after the release is recorded but before the files go: the spec left behind must not
    # hold the GPU for good, and the kubelet's retry must succeed and remove the files.
    import grpc

    from tests.dra_claim_fixtures import result, start_dra_node, stop_dra_node

    node = start_dra_node(tmp_path / "node")
    try:
        c = node.cluster
        share = node.claim("share", [result(cores="60", memory="4Gi", share="s-1")])
        ref = node.ref(share)
        assert c.agent is not None
        c.agent.stop()
        c.start_agent(env={"GPU_MANAGER_CRASH_AT": "unprepare-after-checkpoint"})
        assert node.prepare(ref)[ref[2]].error == ""
        with pytest.raises(grpc.RpcError):
            node.unprepare(ref, timeout=20)
        assert c.agent.wait(20) != 0, "the agent did not die at the crash point"
        assert node.spec_path(ref[2]).exists(), "the kill came before the files were removed"
        c.start_agent()
        assert node.unprepare(ref) == {ref[2]: ""}
        assert not node.spec_path(ref[2]).exists() and not (c.vm_path / ref[2]).exists()
        other = node.claim("other", [result(cores="60", memory="4Gi", share="s-2")])
        assert node.prepare(node.ref(other))[other["metadata"]["uid"]].error == ""
    finally:
        stop_dra_node(node)


def test_the_shipped_two_share_example_runs_each_container_with_its_share(tmp_path: Path, sim_built: Path) -> None:
    import yaml

    from gpumanager.vmanager import files
    from simnode.dra_cluster import DRACluster
    from simnode.gpusim_state import repo_root

    docs = [d for d in yaml.safe_load_all((repo_root() / "deploy/dra/example.yaml").read_text()) if d]
    template = next(d for d in docs if d["metadata"]["name"] == "gpu-two-shares")
    pod = next(d for d in docs if d["metadata"]["name"] == "cuda-two-shares")
    with DRACluster(tmp_path / "node", "v100-pcie-x4") as node:
        # gpu-0 has room for the first share only: the uuid match moves both to gpu-1.
        node.add_template(_two_request_template("filler", (40, "1Gi"), (20, "1Gi")))
        node.create_pod(_pod_per_request("filler", "filler"))
        node.settle()
        node.add_template(template)
        node.create_pod(pod)
        node.settle()
        assert node.pod("cuda-two-shares")["status"]["phase"] == "Running", node.prepare_errors
        claim = node.claim_of("cuda-two-shares")
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["device"]) for r in results] == [("trainer", "gpu-1"), ("helper", "gpu-1")]
        uid = claim["metadata"]["uid"]
        for request, limits in (("trainer", (30, 4 << 30)), ("helper", (20, 2 << 30))):
            config = files.unpack((node.vm_path / uid / f"request-{request}" / "vcuda.config").read_bytes())
            assert (config.utilization, config.gpu_memory) == limits, request


def test_requests_on_two_gpus_run_each_container_on_its_gpu_with_its_share(tmp_path: Path, sim_built: Path) -> None:
    # First fit spills the second request to gpu-1: each container gets its request's GPU, its
    # limits, and its own pids.config; a container that uses the whole claim is refused, naming it.
    from gpumanager.vmanager import files
    from simnode.dra_cluster import DRACluster

    with DRACluster(tmp_path / "node", "v100-pcie-x4") as node:
        node.add_template(_two_request_template("pair", (60, "4Gi"), (60, "2Gi")))
        node.create_pod(_pod_per_request("p", "pair"), commands={"one": ["sleep", "60"], "two": ["sleep", "60"]})
        node.settle()
        assert node.pod("p")["status"]["phase"] == "Running", node.prepare_errors
        claim = node.claim_of("p")
        uid = claim["metadata"]["uid"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [(r["request"], r["device"]) for r in results] == [("a", "gpu-0"), ("b", "gpu-1")]
        assert node.kubelet is not None
        pod_uid = node.pod("p")["metadata"]["uid"]
        for container, gpu, request, limits in (("one", 0, "a", (60, 4 << 30)), ("two", 1, "b", (60, 2 << 30))):
            run = node.kubelet.containers[(pod_uid, container)]
            gpus = [n for n in run.device_nodes if n[len("/dev/nvidia") :].isdigit()]
            assert gpus == [f"/dev/nvidia{gpu}"], (container, run.device_nodes)
            assert run.mounts["/etc/vcuda"] == str(node.vm_path / uid / f"request-{request}")
            own = files.unpack((Path(run.mounts["/etc/vcuda"]) / "vcuda.config").read_bytes())
            assert (own.utilization, own.gpu_memory) == limits, container
            assert run.proc is not None
            path = Path(run.mounts["/etc/vcuda"]) / "pids.config"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not path.exists() or files.read_pids(path) != [run.proc.pid]):
                time.sleep(0.1)
            assert files.read_pids(path) == [run.proc.pid], container
        # A container that names no request of such a claim would get both shares' mounts.
        node.add_template(_two_request_template("pair2", (10, "1Gi"), (10, "1Gi")))
        whole = _pod_per_request("q", "pair2")
        whole["spec"]["containers"][1]["resources"]["claims"] = [{"name": "gpu"}]
        node.create_pod(whole)
        node.settle()
        q = node.pod("q")
        assert q["status"].get("phase") != "Running"
        [error] = node.prepare_errors[q["metadata"]["uid"]].values()
        assert "container two" in error and "whole claim" in error and "request" in error, error


def test_a_later_pod_using_all_of_a_per_request_claim_counts_against_every_request(
    tmp_path: Path, sim_built: Path
) -> None:
    # A claim is prepared once per node: a second pod that joins it later is never seen by the
    # Prepare-time check. A container of it that uses all of the claim must still count against
    # the requests' limits (against every one), never against none.
    from gpumanager.vmanager import files
    from simnode.dra_cluster import DRACluster

    with DRACluster(tmp_path / "node", "t4-x1") as node:
        template = _two_request_template("unused", (30, "2Gi"), (20, "1Gi"))
        node.resource.create_namespaced_resource_claim(
            "default", {"metadata": {"name": "team", "namespace": "default"}, "spec": template["spec"]["spec"]}
        )
        first = _pod_per_request("p", "unused")
        first["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "team"}]
        node.create_pod(first)
        node.settle()
        assert node.pod("p")["status"]["phase"] == "Running", node.prepare_errors
        later = _pod_per_request("q", "unused")
        later["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "team"}]
        later["spec"]["containers"] = [later["spec"]["containers"][0]]
        later["spec"]["containers"][0]["resources"]["claims"] = [{"name": "gpu"}]
        node.create_pod(later, commands={"one": ["sleep", "60"]})
        node.settle()
        assert node.kubelet is not None
        run = node.kubelet.containers.get((node.pod("q")["metadata"]["uid"], "one"))
        assert run is not None and run.proc is not None
        uid = node.resource.read_namespaced_resource_claim("team", "default").metadata.uid
        for request in ("a", "b"):
            path = node.vm_path / uid / f"request-{request}" / "pids.config"
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (not path.exists() or run.proc.pid not in files.read_pids(path)):
                time.sleep(0.1)
            assert run.proc.pid in files.read_pids(path), request


def test_usage_shows_each_container_its_requests_share() -> None:
    from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
    from gpumanager.dra.consumers import container_allocations

    def dev(request: str, minor: int, cores: int, memory: int) -> ClaimDevice:
        return ClaimDevice(request, "node-a", f"gpu-{minor}", minor, f"s-{request}", cores, memory, False)

    claim = ClaimAllocation("u1", "ml", "pair", (dev("a", 0, 30, 4 << 30), dev("b", 1, 60, 2 << 30)))
    pod = _pod_per_request("p", "unused")
    pod["metadata"].update({"namespace": "ml", "uid": "pod-1"})
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "pair"}]
    pod["status"] = {"phase": "Running"}
    got = {(a.container, a.minors, a.cores, a.memory) for a in container_allocations([claim], [pod])}
    assert got == {("one", (0,), 30, 4 << 30), ("two", (1,), 60, 2 << 30)}


def test_every_config_of_a_claim_with_shares_on_two_gpus_is_one_the_interceptor_takes() -> None:
    # The interceptor fails closed on a vcuda.config with utilization above 100.
    from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
    from gpumanager.vmanager.claims import config_for, request_configs

    def dev(request: str, minor: int) -> ClaimDevice:
        return ClaimDevice(request, "node-a", f"gpu-{minor}", minor, f"s-{request}", 60, 1 << 30, False)

    claim = ClaimAllocation("u1", "ml", "pair", (dev("a", 0), dev("b", 1)))
    configs = [config_for(claim, "550.54.15"), *request_configs(claim, "550.54.15").values()]
    assert len(configs) == 3 and all(0 <= cfg.utilization <= 100 for cfg in configs), configs
