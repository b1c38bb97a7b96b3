"""Pods through the whole node-side life: API server, kubelet (PodResources), agent process, simulated GPUs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import empty_pb2

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.api import display_pb2_grpc, vcuda_pb2, vcuda_pb2_grpc
from gpumanager.vmanager import files
from simnode.agent_process import AgentProcess
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import load_spec, spec_dir
from simnode.kubelet import KubeletSimError, PluginRPCError
from tests.agent_fixtures import gpusim

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE
BLOCK = names.MEMORY_BLOCK_BYTES


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=["--allocation-check-period=1"])
    c.start()
    yield c
    c.stop()


def uuids() -> list[str]:
    return [g.uuid for g in load_spec(Path("deploy/sim/h100-nvlink-x8.json")).gpus]


def checkpoint(c: SimCluster) -> dict[str, dict[str, dict[str, object]]]:
    data = read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {}
    return data["PodGPUMapping"]  # type: ignore[no-any-return]


def test_annotated_share_pod_end_to_end(cluster: SimCluster) -> None:
    pod = gpu_pod("train", [("main", 30, 8)], annotations=admission_annotations([[5]], 1000))
    run = cluster.run_pod(pod)
    resp = run.core["main"].response
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == uuids()[5]
    assert resp.envs["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    assert resp.envs["VCUDA_CONFIG_PATH"] == "/etc/vcuda/main/vcuda.config"
    assert [d.host_path for d in resp.devices] == ["/dev/nvidia5", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert [(m.container_path, m.host_path) for m in resp.mounts] == [
        ("/usr/local/nvidia", str(cluster.workdir / "vdriver" / "nvidia")),
        ("/etc/vcuda", str(cluster.vm_path / run.uid)),
        ("/etc/vcuda/main", str(cluster.vm_path / "configs" / run.uid / "main")),
    ]
    assert dict(resp.annotations) == {
        CORE: "30",
        MEM: str(8 * BLOCK),
        names.VDEVICE_ANNOTATION: "/dev/nvidia5",
    }
    assert run.memory["main"].response.ByteSize() == 0
    cfg = files.unpack((cluster.vm_path / "configs" / run.uid / "main" / "vcuda.config").read_bytes())
    assert (cfg.pod_uid, cfg.container_name, cfg.gpu_memory, cfg.utilization, cfg.hard_limit, cfg.enable) == (
        run.uid,
        "main",
        8 * BLOCK,
        30,
        1,
        1,
    )
    cluster.wait_annotations(run, {"tencent.com/predicate-gpu-idx-0": "5", "tencent.com/gpu-assigned": "true"})
    assert checkpoint(cluster)[run.uid]["main"]["Devices"] == ["/dev/nvidia5"]


def test_unannotated_pods_whole_and_multi_gpu(cluster: SimCluster) -> None:
    four = cluster.run_pod(gpu_pod("four", [("m", 400, 0)]))
    assert (
        four.core["m"].response.annotations[names.VDEVICE_ANNOTATION]
        == "/dev/nvidia0,/dev/nvidia1,/dev/nvidia2,/dev/nvidia3"
    )
    assert four.core["m"].response.mounts[0].host_path == str(cluster.workdir / "vdriver" / "origin")
    two = cluster.run_pod(gpu_pod("two", [("m", 200, 0)]))
    assert two.core["m"].response.annotations[names.VDEVICE_ANNOTATION] == "/dev/nvidia4,/dev/nvidia5"
    one = cluster.run_pod(gpu_pod("one", [("a", 100, 0), ("b", 20, 4)]))
    devs = {c: r.response.annotations[names.VDEVICE_ANNOTATION] for c, r in one.core.items()}
    assert devs["a"] in ("/dev/nvidia6", "/dev/nvidia7") and devs["b"] in ("/dev/nvidia6", "/dev/nvidia7")
    assert devs["a"] != devs["b"]
    cluster.wait_annotations(
        one,
        {
            "tencent.com/predicate-gpu-idx-0": devs["a"][-1],
            "tencent.com/predicate-gpu-idx-1": devs["b"][-1],
            "tencent.com/gpu-assigned": "true",
        },
    )
    # The GetPreferredAllocation answer steered the kubelet onto the same GPUs.
    assert {int(i.rsplit("-", 1)[1]) // 100 for i in two.core["m"].device_ids} == {4, 5}


def test_identical_pods_arriving_together_get_distinct_gpus(cluster: SimCluster) -> None:
    pods = [gpu_pod(f"p{i}", [("c", 100, 0)]) for i in range(8)]
    for p in pods:
        cluster.create(p)
    runs = list(cluster.runs.values())
    errors: list[BaseException] = []

    def admit(run_index: int) -> None:
        try:
            cluster.admit(runs[run_index].manifest, create=False)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    mapping = checkpoint(cluster)
    assert sorted(mapping) == sorted(r.uid for r in runs)
    assert sorted(d for per in mapping.values() for e in per.values() for d in e["Devices"]) == [  # type: ignore[attr-defined]
        f"/dev/nvidia{i}" for i in range(8)
    ]
    with pytest.raises(KubeletSimError, match="Requested: 100, Available: 0"):
        cluster.admit(gpu_pod("ninth", [("c", 100, 0)]))


def test_prestart_through_the_kubelet_checkpoint_without_podresources(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", pod_resources=False) as c:
        run = c.run_pod(gpu_pod("x", [("c", 50, 4)]))
        assert (c.vm_path / "configs" / run.uid / "c" / "vcuda.config").exists()
        c.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})


def test_prestart_through_podresources_without_the_kubelet_checkpoint(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", kubelet_checkpoint=False) as c:
        assert not (tmp_path / "device-plugins" / names.KUBELET_CHECKPOINT).exists()
        run = c.run_pod(gpu_pod("x", [("c", 200, 0)]))
        assert (c.vm_path / "configs" / run.uid / "c" / "vcuda.config").exists()
        c.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})


def test_bad_requests_fail_admission_clearly(cluster: SimCluster) -> None:
    # Distinct core counts: a pod that failed admission stays Pending until the kubelet marks it Failed.
    cases = [
        (
            gpu_pod("badidx", [("c", 45, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "x"}),
            "predicate-gpu-idx-0='x'",
        ),
        (
            gpu_pod("pastlast", [("c", 46, 4)], annotations={"tencent.com/predicate-gpu-idx-0": "8"}),
            "GPU 8, which this node does not have",
        ),
        (gpu_pod("odd", [("c", 150, 0)]), "not a multiple of 100"),
        (gpu_pod("nomem", [("c", 47, 0)]), "needs tencent.com/vcuda-memory > 0"),
        (gpu_pod("huge", [("c", 48, 400)]), "larger than any GPU"),
    ]
    for manifest, message in cases:
        with pytest.raises(PluginRPCError) as err:
            cluster.admit(manifest)
        assert message in err.value.details, err.value.details
        assert manifest["metadata"]["name"] in err.value.details
    assert checkpoint_or_empty(cluster) == {}


def checkpoint_or_empty(c: SimCluster) -> dict[str, object]:
    document = read_document(c.checkpoint_dir / names.OWN_CHECKPOINT)
    return (document or {}).get("PodGPUMapping") or {}


def test_api_server_down_during_allocate(cluster: SimCluster) -> None:
    cluster.api.set_down(True)
    try:
        with pytest.raises(PluginRPCError) as err:
            _admit_unknown(cluster)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "API server cannot be asked" in err.value.details
    finally:
        cluster.api.set_down(False)
    assert checkpoint_or_empty(cluster) == {}


def _admit_unknown(cluster: SimCluster) -> None:
    # A pod the agent's cache has not seen: the agent must ask the API server, which is down.
    cluster.kubelet.allocate(CORE, 100, pod_uid="unknown-uid", container_name="c")


def test_deleted_pod_is_released_and_its_directory_removed(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("gone", [("c", 100, 0)]))
    assert (cluster.vm_path / run.uid).is_dir()
    cluster.delete(run)
    deadline = time.monotonic() + 10
    while run.uid in checkpoint_or_empty(cluster) or (cluster.vm_path / run.uid).exists():
        assert time.monotonic() < deadline, "pod not released"
        time.sleep(0.1)
    again = cluster.run_pod(gpu_pod("next", [("c", 800, 0)]))
    assert again.core["c"].response.annotations[names.VDEVICE_ANNOTATION].count("/dev/nvidia") == 8


def test_vcuda_sock_registration_and_isolation(cluster: SimCluster) -> None:
    a = cluster.run_pod(gpu_pod("a", [("main", 40, 4)]))
    b = cluster.run_pod(gpu_pod("b", [("main", 40, 4)]))
    sock = cluster.vm_path / a.uid / "vcuda.sock"
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        stub = vcuda_pb2_grpc.VCUDAServiceStub(ch)
        stub.RegisterVDevice(vcuda_pb2.VDeviceRequest(pod_uid=a.uid, container_name="main"), timeout=5)
        assert files.read_pids(cluster.vm_path / "configs" / a.uid / "main" / "pids.config") == [a.pids["main"]]
        cid = f"{a.uid[:8]}main".replace("-", "")
        stub.RegisterVDevice(vcuda_pb2.VDeviceRequest(pod_uid=a.uid, container_id=cid), timeout=5)
        assert (cluster.vm_path / a.uid / cid / "vcuda.config").stat().st_size == 8240
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterVDevice(vcuda_pb2.VDeviceRequest(pod_uid=b.uid, container_name="main"), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterVDevice(vcuda_pb2.VDeviceRequest(pod_uid=a.uid, container_name="intruder"), timeout=5)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert not (cluster.vm_path / a.uid / "intruder").exists()
    assert not (cluster.vm_path / "configs" / b.uid / "main" / "pids.config").exists()


def test_shared_containers_pids_config_follows_their_processes(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("pids", [("main", 20, 4)]))
    whole = cluster.run_pod(gpu_pod("nopids", [("main", 100, 0)]))
    path = cluster.vm_path / "configs" / run.uid / "main" / "pids.config"

    def pids() -> list[int]:
        return files.read_pids(path) if path.exists() else []

    deadline = time.monotonic() + 10
    while pids() != [run.pids["main"]]:
        assert time.monotonic() < deadline, f"pids.config is {pids()}"
        time.sleep(0.1)
    cid = f"{run.uid[:8]}main".replace("-", "")
    procs = cluster.cgroup_root / "kubepods" / f"pod{run.uid}" / cid / "cgroup.procs"
    procs.write_text(f"{run.pids['main']}\n7\n")
    while pids() != sorted([7, run.pids["main"]]):
        assert time.monotonic() < deadline + 5, f"pids.config is {pids()}"
        time.sleep(0.1)
    assert not (cluster.vm_path / "configs" / whole.uid / "main" / "pids.config").exists()


def test_node_labels_with_gpu_model(tmp_path: Path, sim_built: Path) -> None:
    flags = ["--node-labels=gaia.tencent.com/gpu-model=auto,team=ml"]
    with SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=flags) as c:
        deadline = time.monotonic() + 10
        while True:
            labels = (c.api.get_node("sim-node") or {}).get("metadata", {}).get("labels", {})
            if labels.get("team") == "ml":
                break
            assert time.monotonic() < deadline, f"labels not applied: {labels}"
            time.sleep(0.1)
        assert labels["gaia.tencent.com/gpu-model"] == "H100"
        assert labels["nvidia-device-enable"] == "enable"


def _prestart_failed(cluster: SimCluster, name: str, owned: bool) -> None:
    pod = gpu_pod(name, [("c", 100, 0)])
    if owned:
        pod["metadata"]["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "rs-uid", "controller": True}
        ]
    run = cluster.admit(pod)  # PreStart failed: the kubelet says so in the container's waiting state
    waiting = {"reason": "CreateContainerConfigError", "message": "PreStartContainer check failed"}
    status = {
        "name": "c",
        "ready": False,
        "restartCount": 0,
        "image": "cuda",
        "imageID": "",
        "state": {"waiting": waiting},
    }
    cluster.api.set_pod_phase(run.namespace, run.name, "Pending", containerStatuses=[status])


def test_pods_that_failed_to_start_are_freed_and_deleted_when_owned(cluster: SimCluster) -> None:
    _prestart_failed(cluster, "owned", owned=True)
    _prestart_failed(cluster, "naked", owned=False)
    deadline = time.monotonic() + 15
    # The agent deletes the owned pod; the API server keeps it until the kubelet has finished it.
    while checkpoint_or_empty(cluster) or cluster.api.get_pod("default", "owned") is not None:
        assert time.monotonic() < deadline, (checkpoint_or_empty(cluster), cluster.api.get_pod("default", "owned"))
        time.sleep(0.1)
    assert cluster.api.get_pod("default", "naked") is not None, "a pod no controller owns is not deleted"


def test_a_failed_pod_already_being_deleted_is_deleted_once(tmp_path: Path, sim_built: Path) -> None:
    """The API server keeps a pod the agent deleted until its kubelet is done with it (here 6 s): the
    periodic check (every second) does not send the DELETE again meanwhile."""
    with SimCluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=6.0) as c:
        _prestart_failed(c, "owned", owned=True)
        deadline = time.monotonic() + 15
        while not (c.api.get_pod("default", "owned") or {}).get("metadata", {}).get("deletionTimestamp"):
            assert time.monotonic() < deadline, "the agent did not delete the pod"
            time.sleep(0.1)
        while c.api.get_pod("default", "owned") is not None:  # the kubelet finishes it
            assert time.monotonic() < deadline + 10, "the pod's deletion was never finished"
            time.sleep(0.1)
        # (the kubelet's own DELETE is not among the requests: the simulated one acts in process)
        deletes = [r for r in c.api.requests if r.method == "DELETE" and r.path.endswith("/pods/owned")]
        assert len(deletes) == 1, [(r.status, r.body) for r in deletes]
        assert c.agent is not None and c.agent.log_text().count("deleted pod default/owned") == 1


def test_extra_config_devices_and_printusages(tmp_path: Path, sim_built: Path) -> None:
    extra = tmp_path / "extra-config.json"
    extra.write_text(json.dumps({"default": {"devices": ["/dev/nvidia-uvm-tools", "/dev/nvidia-modeset"]}}))
    with SimCluster(tmp_path / "node", "v100-pcie-x4", agent_flags=[f"--extra-config={extra}"]) as c:
        run = c.run_pod(gpu_pod("x", [("c", 50, 4)]))
        assert [d.host_path for d in run.core["c"].response.devices][-2:] == [
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-modeset",
        ]
        assert c.agent is not None
        gpu = int(run.core["c"].response.annotations[names.VDEVICE_ANNOTATION][-1])
        gpusim(c.agent, "proc", "--gpu", str(gpu), "--pid", str(run.pids["c"]), "--used-mib", "300")
        c.wait_status(run)  # the container's processes are known once its status names it
        deadline = time.monotonic() + 20
        while True:
            with grpc.insecure_channel(f"unix://{c.agent.display_socket}") as ch:
                usage = display_pb2_grpc.GPUDisplayStub(ch).PrintUsages(empty_pb2.Empty(), timeout=10).usage
            dev = usage[run.uid].stat["c"].dev[0]
            if list(dev.pids) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (dev.card_idx, list(dev.pids), dev.mem) == (str(gpu), [run.pids["c"]], 300.0)


def test_bad_extra_config_stops_the_agent_with_the_file_named(tmp_path: Path, sim_built: Path) -> None:
    extra = tmp_path / "extra-config.json"
    extra.write_text('{"default": {"devices": "oops"}}')
    agent = AgentProcess(tmp_path, spec_dir() / "t4-x1.json", extra_args=[f"--extra-config={extra}"]).start()
    assert agent.wait(30) == 2
    assert f"--extra-config={extra}" in agent.log_text()


def test_identical_pods_starting_together_share_one_podresources_list(cluster: SimCluster) -> None:
    """Allocate cannot tell identical waiting pods apart, so PreStartContainer asks the kubelet who
    holds each container's IDs. Started together, they read one List: every container's IDs were
    allocated before it began, so each takes its holder from it instead of asking for a List of its own."""
    pods = [gpu_pod(f"same-{i}", [("c", 25, 2)]) for i in range(8)]
    for p in pods:
        cluster.create(p)
    time.sleep(1.0)  # the agent's pod cache sees them before the kubelet admits them
    runs = list(cluster.runs.values())
    admitted = _together(lambda run: cluster.admit(run.manifest, create=False), runs)
    assert all(r is not None for r in admitted)
    before = len(cluster.kubelet.pod_resources_calls)
    _together(lambda run: cluster.kubelet.pre_start(CORE, pod_uid=run.uid, container_name="c"), runs)
    calls = [c.method for c in cluster.kubelet.pod_resources_calls[before:]]
    assert calls.count("List") == 1, calls
    # And each container ended up with the IDs the kubelet gave it.
    mapping = checkpoint(cluster)
    for run in runs:
        kubelet_ids = [sorted(a.device_ids) for a in cluster.kubelet.allocations(run.uid) if a.resource == CORE]
        assert kubelet_ids == [sorted(mapping[run.uid]["c"]["DeviceIDs"])], run.name  # type: ignore[arg-type]


def _together(fn: Callable[[Any], object], items: Sequence[Any]) -> list[object]:
    """``fn`` over ``items``, each in its own thread, all released at once; raises the first error."""
    go = threading.Event()
    results: list[object] = [None] * len(items)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        go.wait()
        try:
            results[i] = fn(items[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


def wait_until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_pods_directory_and_socket_are_ready_before_the_kubelet_starts_it(cluster: SimCluster) -> None:
    """The watch shows the pod first: its directories, the spare of each vcuda.config and its vcuda.sock are
    made then, and PreStartContainer fills the spare. A pod deleted before it ever started leaves nothing."""
    created = cluster.create(gpu_pod("early", [("main", 30, 8)]))
    uid = str(created["metadata"]["uid"])
    directory = cluster.vm_path / uid
    config = cluster.vm_path / "configs" / uid / "main" / names.VCUDA_CONFIG_FILE  # the container's own directory
    wait_until(lambda: (directory / names.VCUDA_SOCKET).exists() and files.spare_path(config).exists())
    spare_inode = files.spare_path(config).stat().st_ino
    run = cluster.admit(created, create=False)
    assert files.spare_path(config).stat().st_ino == spare_inode, "Allocate leaves it"
    cluster.kubelet.pre_start(CORE, pod_uid=uid, container_name="main")
    assert config.stat().st_ino == spare_inode and not files.spare_path(config).exists()
    assert files.unpack(config.read_bytes()).utilization == 30
    with grpc.insecure_channel(f"unix://{directory / names.VCUDA_SOCKET}") as channel:
        grpc.channel_ready_future(channel).result(timeout=5)
    cluster.delete(run, wait=True)

    never = cluster.create(gpu_pod("never", [("main", 30, 8)]))
    never_dir = cluster.vm_path / str(never["metadata"]["uid"])
    wait_until(lambda: (never_dir / names.VCUDA_SOCKET).exists())
    cluster.delete(cluster.runs[str(never["metadata"]["uid"])], wait=True)
    wait_until(lambda: not never_dir.exists() and not directory.exists())
    wait_until(lambda: not (cluster.vm_path / "configs" / uid).exists())
    assert not (cluster.vm_path / "configs" / str(never["metadata"]["uid"])).exists()
