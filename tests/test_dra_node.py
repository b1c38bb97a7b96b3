"""DRA mode on the simulated node: topology, restarts of the agent and the kubelet, GPU health, bad claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.allocation.journal import read_document
from simnode.agent_process import SPEC_DIR
from simnode.dra_cluster import DRIVER, NODE, DRACluster, claim_pod, claim_template
from simnode.gpusim_state import sim_env

GiB = 1 << 30


def nvlink_pairs_spec(tmp_path: Path) -> Path:
    """4 x V100 where NVLink joins GPUs 0-2 and 1-3 (not neighbours by index)."""
    spec = json.loads((SPEC_DIR / "v100-pcie-x4.json").read_text())
    spec["nvlink"] = [[0, 2, 6], [1, 3, 6]]
    path = tmp_path / "v100-nvlink-pairs.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture
def v100(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path / "node", nvlink_pairs_spec(tmp_path), health_quiet_period="1h") as cluster:
        yield cluster


def devices_of(cluster: DRACluster, pod: str) -> list[str]:
    return [r["device"] for r in cluster.claim_of(pod)["status"]["allocation"]["devices"]["results"]]


def test_nvlink_group_attribute_and_match_attribute_lands_on_a_pair(v100: DRACluster) -> None:
    s = v100.slice()
    assert s is not None
    groups = {d["name"]: d["attributes"].get("nvlinkGroup", {}).get("int") for d in s["spec"]["devices"]}
    assert groups == {"gpu-0": 0, "gpu-1": 1, "gpu-2": 0, "gpu-3": 1}
    v100.add_template(claim_template("one", count=1))
    v100.add_template(claim_template("pair", count=2, match_attribute=f"{DRIVER}/nvlinkGroup"))
    v100.create_pod(claim_pod("whole", "one"))
    v100.settle()
    assert devices_of(v100, "whole") == ["gpu-0"]
    v100.create_pod(claim_pod("two", "pair"))
    v100.settle()
    # First fit alone would give gpu-1 + gpu-2 (different groups); the constraint gives the 1-3 pair.
    assert devices_of(v100, "two") == ["gpu-1", "gpu-3"]
    assert v100.pod("two")["status"]["phase"] == "Running"
    claim = v100.claim_of("two")
    spec = json.loads((v100.cdi_root / f"{DRIVER}-{claim['metadata']['uid']}.json").read_text())
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void", "the GPUs come from the devices' nodes"
    assert [d["containerEdits"]["deviceNodes"][0]["path"] for d in spec["devices"]] == ["/dev/nvidia1", "/dev/nvidia3"]
    # Whole GPUs: the untouched driver mirror and no limit.
    from gpumanager.vmanager import files

    config = files.unpack((v100.vm_path / claim["metadata"]["uid"] / "vcuda.config").read_bytes())
    assert config.enable == 0
    # A third whole-GPU pair cannot be had: gpu-2 is free but its partner gpu-0 is not.
    v100.create_pod(claim_pod("two-more", "pair"))
    v100.settle()
    assert not v100.pod("two-more")["spec"].get("nodeName")


def test_agent_restart_keeps_every_prepared_claim(v100: DRACluster) -> None:
    v100.add_template(claim_template("c30", cores=30, memory="4Gi"))
    v100.create_pod(claim_pod("p30", "c30"))
    v100.settle()
    claim = v100.claim_of("p30")
    uid = claim["metadata"]["uid"]
    assert v100.kubelet is not None and v100.agent is not None
    first = v100.kubelet.prepare(DRIVER, [("default", claim["metadata"]["name"], uid)])[uid]
    old_pid = v100.agent.pid
    assert v100.agent.stop() == 0
    spec_file = v100.cdi_root / f"{DRIVER}-{uid}.json"
    assert spec_file.exists(), "stopping the agent keeps what running containers use"
    v100.start_agent()
    assert v100.agent.pid != old_pid
    again = v100.kubelet.prepare(DRIVER, [("default", claim["metadata"]["name"], uid)])[uid]
    assert again == first and not again["error"]
    checkpoint = json.loads((v100.checkpoint_dir / "gpumanager_internal_checkpoint").read_text())
    assert checkpoint["Claims"][uid]["Devices"][0]["Cores"] == 30
    # The restarted agent still counts the 30 cores: a claim of 80 more on that GPU is refused.
    device = first["devices"][0]["device"]
    over = make_claim(v100, "over", device=device, cores="80", memory="1Gi")
    answer = v100.kubelet.prepare(DRIVER, [("default", "over", over)])[over]
    assert "more than the device has left" in answer["error"] and "cores=80" in answer["error"]
    assert "default/over" in answer["error"] and device in answer["error"]


@pytest.mark.parametrize("point", ["prepare-before-checkpoint", "prepare-after-checkpoint"])
def test_sigkill_inside_prepare_then_the_kubelet_prepares_again(v100: DRACluster, point: str) -> None:
    assert v100.kubelet is not None and v100.agent is not None
    kept = make_claim(v100, "kept", device="gpu-1", cores="20", memory="1Gi")
    assert not v100.kubelet.prepare(DRIVER, [("default", "kept", kept)])[kept]["error"]
    v100.agent.stop()
    v100.start_agent(env={"GPU_MANAGER_CRASH_AT": point})
    victim = make_claim(v100, "victim", device="gpu-1", cores="40", memory="4Gi")
    with pytest.raises(grpc.RpcError):
        v100.kubelet.prepare(DRIVER, [("default", "victim", victim)])
    assert v100.agent.wait(10) == -9
    v100.start_agent()
    # The kubelet never got an answer and asks again: prepared once, with its files, whichever side of
    # the record the agent died on (before it, nothing was recorded; after it, the journal has it).
    again = v100.kubelet.prepare(DRIVER, [("default", "victim", victim)])[victim]
    assert not again["error"] and again["devices"][0]["device"] == "gpu-1"
    assert (v100.cdi_root / f"{DRIVER}-{victim}.json").exists()
    claims = (read_document(v100.checkpoint_dir / "gpumanager_internal_checkpoint") or {})["Claims"]
    assert sorted(claims) == sorted([kept, victim])
    # gpu-1 holds 20 + 40 cores, counted once each: 40 more fit, 41 do not.
    over = make_claim(v100, "over", device="gpu-1", cores="41", memory="1Gi")
    assert "cores=41" in v100.kubelet.prepare(DRIVER, [("default", "over", over)])[over]["error"]
    fits = make_claim(v100, "fits", device="gpu-1", cores="40", memory="1Gi")
    assert not v100.kubelet.prepare(DRIVER, [("default", "fits", fits)])[fits]["error"]


def test_kubelet_restart_reregisters_in_process_and_slice_comes_back(v100: DRACluster) -> None:
    assert v100.kubelet is not None and v100.agent is not None
    before = v100.kubelet.registrations(DRIVER)
    generation = v100.slice()["spec"]["pool"]["generation"]  # type: ignore[index]
    pid = v100.agent.pid
    v100.kubelet.restart(wipe_sockets=True, plugin_dirs=[v100.plugin_dir])
    v100.kubelet.wait_registered(DRIVER, after=before, timeout=20)
    republished = v100.wait_slice(lambda s: s is not None)
    assert republished is not None and republished["spec"]["pool"]["generation"] > generation
    assert v100.agent.pid == pid and v100.agent.proc is not None and v100.agent.proc.poll() is None
    # Claims still prepare through the new sockets.
    v100.add_template(claim_template("c10", cores=10, memory="1Gi"))
    v100.create_pod(claim_pod("after", "c10"))
    v100.settle()
    assert v100.pod("after")["status"]["phase"] == "Running"
    assert "socket was removed" in v100.agent.log_text()


def test_xid_79_taints_the_device_and_the_scheduler_avoids_it(v100: DRACluster) -> None:
    assert v100.agent is not None and v100.kubelet is not None
    done = subprocess.run(
        [sys.executable, "-m", "simnode.gpusim", "xid", "--gpu", "0", "--xid", "79"],
        env=sim_env(v100.spec, v100.agent.state),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr

    def tainted(s: Any) -> bool:
        return s is not None and bool(s["spec"]["devices"][0].get("taints"))

    s = v100.wait_slice(tainted)
    assert s is not None
    [taint] = s["spec"]["devices"][0]["taints"]
    assert taint == {
        "key": f"{DRIVER}/unhealthy",
        "value": "xid-79",
        "effect": "NoSchedule",
        "timeAdded": taint["timeAdded"],
    }
    assert all(not d.get("taints") for d in s["spec"]["devices"][1:])
    deadline = time.monotonic() + 10
    plugin = v100.kubelet.plugins()[DRIVER]
    while plugin.health.get("gpu-0", (0, ""))[0] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert plugin.health["gpu-0"] == (2, "XID 79"), "the kubelet's health stream says UNHEALTHY"
    assert plugin.health["gpu-1"][0] == 1
    v100.add_template(claim_template("one", count=1))
    for i in range(4):
        v100.create_pod(claim_pod(f"w{i}", "one"))
    v100.settle()
    placed = sorted(d for i in range(3) for d in devices_of(v100, f"w{i}"))
    assert placed == ["gpu-1", "gpu-2", "gpu-3"]
    assert not v100.pod("w3")["spec"].get("nodeName"), "the tainted GPU gets no claim"


def make_claim(
    cluster: DRACluster,
    name: str,
    *,
    device: str = "gpu-0",
    cores: str | None = "30",
    memory: str | None = "4Gi",
    driver: str = DRIVER,
    pool: str = NODE,
    allocate: bool = True,
) -> str:
    """A claim with a hand-written allocation (as if a scheduler made it); returns its UID."""
    body = {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    created = json.loads(
        cluster.resource.create_namespaced_resource_claim("default", body, _preload_content=False).data
    )
    if allocate:
        result: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": pool, "device": device}
        consumed = {k: v for k, v in (("cores", cores), ("memory", memory)) if v is not None}
        if consumed:
            result["consumedCapacity"] = consumed
            result["shareID"] = f"00000000-0000-4000-8000-{abs(hash(name)) % 10**12:012d}"
        cluster.resource.patch_namespaced_resource_claim_status(
            name, "default", {"status": {"allocation": {"devices": {"results": [result]}}}}
        )
    return str(created["metadata"]["uid"])


def test_every_bad_claim_is_refused_clearly_and_the_good_one_proceeds(v100: DRACluster) -> None:
    assert v100.kubelet is not None
    good = make_claim(v100, "good", device="gpu-1")
    refs = [("default", "good", good)]
    expect: dict[str, list[str]] = {}

    def bad(name: str, uid: str, *texts: str) -> None:
        refs.append(("default", name, uid))
        expect[uid] = [f"default/{name}", *texts]

    bad("missing", "0000-missing", "not found")
    mismatched = make_claim(v100, "mismatched")
    bad("mismatched", "not-" + mismatched, "UID is", mismatched)
    bad("pending", make_claim(v100, "pending", allocate=False), "not allocated")
    bad(
        "other",
        make_claim(v100, "other", driver="gpu.nvidia.com"),
        "no device of driver vcuda.tencent.com",
        "gpu.nvidia.com",
    )
    bad("elsewhere", make_claim(v100, "elsewhere", pool="node-b"), "gpu-0", "pool 'node-b'")
    bad("nodevice", make_claim(v100, "nodevice", device="gpu-9"), "'gpu-9'", "no such device")
    bad("toobig", make_claim(v100, "toobig", device="gpu-2", memory="64Gi"), "'gpu-2'", "'64Gi'")
    answer = v100.kubelet.prepare(DRIVER, refs)
    assert set(answer) == {uid for _, _, uid in refs}, "every claim gets an entry"
    assert not answer[good]["error"] and answer[good]["devices"][0]["device"] == "gpu-1"
    assert answer[good]["devices"][0]["share_id"], "v1 answers carry the share ID"
    for uid, texts in expect.items():
        error = answer[uid]["error"]
        assert error and all(t in error for t in texts), (texts, error)
    # Refusals leave nothing behind.
    uids = {p.name for p in v100.vm_path.iterdir()}
    assert uids == {good}
    assert sorted(p.name for p in v100.cdi_root.iterdir()) == [f"{DRIVER}-{good}.json"]
    # Unprepare is idempotent, also for claims never prepared.
    assert v100.kubelet.unprepare(DRIVER, [("default", "good", good), ("default", "missing", "0000-missing")]) == {
        good: "",
        "0000-missing": "",
    }
    assert v100.kubelet.unprepare(DRIVER, [("default", "good", good)]) == {good: ""}
    assert list(v100.cdi_root.iterdir()) == []
    assert os.path.exists(v100.checkpoint_dir / "gpumanager_internal_checkpoint")


def test_shipped_example_templates_are_allocated_as_documented(v100: DRACluster) -> None:
    import yaml

    from simnode.gpusim_state import repo_root

    docs = [d for d in yaml.safe_load_all((repo_root() / "deploy/dra/example.yaml").read_text()) if d]
    shipped_class = yaml.safe_load((repo_root() / "deploy/dra/deviceclass.yaml").read_text())
    live_class = v100.resource.read_device_class(DRIVER)
    assert live_class.spec.selectors[0].cel.expression == shipped_class["spec"]["selectors"][0]["cel"]["expression"]
    for doc in docs:
        if doc["kind"] == "ResourceClaimTemplate":
            v100.add_template(doc)
        else:
            v100.create_pod(doc)
    v100.settle()
    share = v100.claim_of("cuda-share")["status"]["allocation"]["devices"]["results"]
    assert [r["consumedCapacity"] for r in share] == [{"cores": "30", "memory": "4Gi"}]
    pair_pod = v100.pod("cuda-nvlink-pair")
    pair_claim = next(s["resourceClaimName"] for s in pair_pod["status"]["resourceClaimStatuses"])
    pair = v100.resource.read_namespaced_resource_claim(pair_claim, "default")
    devices = sorted(r.device for r in pair.status.allocation.devices.results)
    assert devices in (["gpu-0", "gpu-2"], ["gpu-1", "gpu-3"])
    for name in ("cuda-share", "cuda-whole", "cuda-nvlink-pair"):
        assert v100.pod(name)["status"]["phase"] == "Running", name


def test_a_kubelet_that_speaks_only_v1beta1_prepares_through_it(tmp_path: Path, sim_built: Path) -> None:
    with DRACluster(tmp_path / "node", "t4-x1") as c:
        assert c.kubelet is not None
        c.kubelet.stop()
        c.kubelet.versions = ("v1beta1.DRAPlugin",)
        before = c.kubelet.registrations(DRIVER)
        c.kubelet.start()
        assert c.kubelet.wait_registered(DRIVER, after=before).version == "v1beta1.DRAPlugin"
        c.wait_slice(lambda s: s is not None)
        uid = make_claim(c, "old-api", cores="20", memory="1Gi")
        answer = c.kubelet.prepare(DRIVER, [("default", "old-api", uid)])[uid]
        assert not answer["error"] and answer["devices"][0]["device"] == "gpu-0"
        assert answer["devices"][0]["share_id"] == "" and answer["devices"][0]["cdi_ids"][0].startswith(
            f"{DRIVER}/gpu={uid}-gpu-gpu-0-"
        )


def test_a_refused_registration_is_reported_on_readyz(v100: DRACluster) -> None:
    import urllib.error
    import urllib.request

    import grpc

    from gpumanager.api import pluginregistration_v1_pb2 as reg_pb
    from gpumanager.api import pluginregistration_v1_pb2_grpc as reg_grpc

    assert v100.agent is not None
    url = f"http://127.0.0.1:{v100.agent.query_port}/readyz"
    deadline = time.monotonic() + 30
    while True:  # the kubelet registers the driver before the pod cache's first sync (part of ready)
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                assert json.loads(resp.read())["registered"] is True
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.1)
    with grpc.insecure_channel(f"unix://{v100.registry_dir / (DRIVER + '-reg.sock')}") as ch:
        reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
            reg_pb.RegistrationStatus(plugin_registered=False, error="driver name is already registered"), timeout=5
        )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert err.value.code == 503
    body = json.loads(err.value.read())
    assert body["registration_error"] == "driver name is already registered"
    assert "dra-registration" in body["errors"]


def test_after_a_switch_from_device_plugin_mode_finished_pods_free_their_gpus(tmp_path: Path, sim_built: Path) -> None:
    cluster = DRACluster(tmp_path / "node", "t4-x1")
    checkpoint = cluster.checkpoint_dir / "gpumanager_internal_checkpoint"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text(
        json.dumps({"PodGPUMapping": {"gone-pod": {"main": {"Devices": ["/dev/nvidia0"], "Cores": 100, "Memory": 0}}}})
    )
    with cluster as c:
        assert c.kubelet is not None
        uid = make_claim(c, "whole", cores=None, memory=None)
        deadline = time.monotonic() + 20
        while True:
            answer = c.kubelet.prepare(DRIVER, [("default", "whole", uid)])[uid]
            if not answer["error"] or time.monotonic() > deadline:
                break
            assert "whole" in answer["error"]  # the old pod still counts until the pod cache has been read
            time.sleep(0.2)
        assert not answer["error"], answer["error"]
        assert "gone-pod" not in json.loads(checkpoint.read_text())["PodGPUMapping"]


def test_taint_goes_when_the_gpu_is_healthy_again_and_kubelet_restart_without_wipe(
    tmp_path: Path, sim_built: Path
) -> None:
    with DRACluster(tmp_path / "node", "t4-x1", health_quiet_period="2s") as c:
        assert c.agent is not None and c.kubelet is not None
        first = c.slice()
        assert first is not None
        subprocess.run(
            [sys.executable, "-m", "simnode.gpusim", "xid", "--gpu", "0", "--xid", "48"],
            env=sim_env(c.spec, c.agent.state),
            check=True,
            capture_output=True,
            timeout=30,
        )
        tainted = c.wait_slice(lambda s: s is not None and bool(s["spec"]["devices"][0].get("taints")))
        assert tainted is not None and tainted["spec"]["devices"][0]["taints"][0]["value"] == "xid-48"
        healed = c.wait_slice(lambda s: s is not None and not s["spec"]["devices"][0].get("taints"), timeout=30)
        assert healed is not None
        generations = [s["spec"]["pool"]["generation"] for s in (first, tainted, healed)]
        assert generations == sorted(set(generations)), f"every change bumps the generation: {generations}"
        # A kubelet restart that keeps the sockets: its plugin watcher finds ours and registers again.
        before = c.kubelet.registrations(DRIVER)
        c.kubelet.restart(wipe_sockets=False)
        c.kubelet.wait_registered(DRIVER, after=before)
        assert c.wait_slice(lambda s: s is not None) is not None


def test_a_stopped_driver_loses_its_slice_after_the_kubelets_delay(tmp_path: Path, sim_built: Path) -> None:
    with DRACluster(tmp_path / "node", "t4-x1") as c:
        assert c.agent is not None and c.kubelet is not None
        c.kubelet.slice_wipe_delay = 1.0
        assert c.agent.stop() == 0
        c.wait_slice(lambda s: s is None, timeout=15)
        c.start_agent()
        assert c.slice() is not None


def test_one_claim_shared_by_two_pods_holds_both_to_its_limits(tmp_path: Path, sim_built: Path) -> None:
    from gpumanager.vmanager import files

    with DRACluster(tmp_path / "node", "t4-x1") as c:
        assert c.kubelet is not None
        c.resource.create_namespaced_resource_claim(
            "default",
            {
                "metadata": {"name": "team-gpu", "namespace": "default"},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": DRIVER,
                                    "capacity": {"requests": {"cores": "40", "memory": "2Gi"}},
                                },
                            }
                        ]
                    }
                },
            },
        )
        pods = []
        for name in ("a", "b"):
            manifest = claim_pod(name, "unused")
            manifest["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "team-gpu"}]
            pods.append(c.create_pod(manifest, commands={"main": ["sleep", "60"]}))
        c.settle()
        claim = json.loads(
            c.resource.read_namespaced_resource_claim("team-gpu", "default", _preload_content=False).data
        )
        assert sorted(r["name"] for r in claim["status"]["reservedFor"]) == ["a", "b"]
        assert [call for call in c.kubelet.prepare_calls if call[1] == ["team-gpu"]] == [(DRIVER, ["team-gpu"])], (
            "the kubelet prepares a claim once per node"
        )
        procs = [c.kubelet.containers[(p["metadata"]["uid"], "main")].proc for p in pods]
        assert all(p is not None for p in procs)
        pids = sorted(p.pid for p in procs if p is not None)
        path = c.vm_path / claim["metadata"]["uid"] / "pids.config"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not path.exists() or files.read_pids(path) != pids):
            time.sleep(0.1)
        assert files.read_pids(path) == pids
        c.end_pod("a")
        c.settle()
        assert (c.vm_path / claim["metadata"]["uid"]).exists(), "b still uses the claim"
        c.end_pod("b")
        c.settle()
        assert not (c.vm_path / claim["metadata"]["uid"]).exists()
        released = json.loads(
            c.resource.read_namespaced_resource_claim("team-gpu", "default", _preload_content=False).data
        )
        assert not (released.get("status") or {}).get("allocation"), "a claim no pod reserves is deallocated"
