"""The kubelet's device manager as the simulated node plays it, against the real kubelet's: the order of a
container's Allocate and PreStartContainer calls, a failed admission, and what the agent makes of them."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.api import podresources_v1_pb2 as pr
from gpumanager.api import podresources_v1_pb2_grpc as pr_grpc
from gpumanager.kube.owners import OwnerResolver
from gpumanager.kube.podresources import PodResourcesClient
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError, KubeletSimulator

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(
        tmp_path, "v100-pcie-x4", fill="random", seed=7, status_lag=0.2, agent_flags=["--allocation-check-period=1"]
    )
    c.start()
    yield c
    c.stop()


def ours(c: SimCluster) -> dict[tuple[str, str], dict[str, object]]:
    data = (read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {}).get("PodGPUMapping") or {}
    return {(uid, name): entry for uid, per in data.items() for name, entry in per.items()}


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_containers_resources_come_in_go_map_order(tmp_path: Path) -> None:
    """The kubelet ranges over a container's limits (a Go map) for Allocate and PreStartContainer: either
    resource may come first, on every pass; "sorted" keeps the order given."""
    sim = KubeletSimulator(tmp_path, fill="random", seed=3)
    firsts = {sim.limits_order([CORE, MEM])[0] for _ in range(64)}
    assert firsts == {CORE, MEM}
    assert KubeletSimulator(tmp_path, fill="sorted").limits_order([CORE, MEM]) == [CORE, MEM]


def test_memory_before_core_within_a_container_is_served(cluster: SimCluster) -> None:
    """Containers whose vcuda-memory Allocate and PreStart come before their vcuda-core ones get the memory
    and cores they asked for."""
    containers = [(f"c{i}", 10, 2 + i) for i in range(8)]
    run = cluster.run_pod(gpu_pod("mixed", containers))
    sent = [(a.container_name, a.resource) for a in cluster.kubelet.allocations(run.uid)]
    assert any(sent.index((c, MEM)) < sent.index((c, CORE)) for c, _, _ in containers), sent
    calls = [(c, r) for r, uid, c, _ in cluster.kubelet.pre_start_calls if uid == run.uid]
    assert {c for c, r in calls if r == MEM} == {c for c, _, _ in containers}
    held = ours(cluster)
    for name, cores, blocks in containers:
        entry = held[(run.uid, name)]
        assert (entry["Cores"], entry["Memory"]) == (cores, blocks * names.MEMORY_BLOCK_BYTES), (name, entry)


def test_failed_admission_fails_the_pod_and_frees_what_its_first_container_got(cluster: SimCluster) -> None:
    """The kubelet refuses the second container's memory: the pod turns Failed (UnexpectedAdmissionError) and
    is not admitted again, the kubelet forgets the first container's devices, and the agent releases the
    share it gave the first container, so every core is free for the next pod."""
    total_blocks = len(cluster.kubelet.devices(MEM))
    pod = gpu_pod("half", [("first", 100, 8), ("second", 100, total_blocks)])
    with pytest.raises(KubeletSimError, match="requested number of devices unavailable"):
        cluster.admit(pod)
    run = next(r for r in cluster.runs.values() if r.name == "half")
    assert cluster.kubelet.allocations(run.uid) == []
    # The kubelet writes its checkpoint once a container's resources are all allocated: never "second".
    entries = json.loads(cluster.kubelet.checkpoint_path.read_text())["Data"]["PodDeviceEntries"]
    assert {(e["ContainerName"], e["ResourceName"]) for e in entries if e["PodUID"] == run.uid} == {
        ("first", CORE),
        ("first", MEM),
    }
    wait_until(lambda: cluster.pod(run).get("status", {}).get("phase") == "Failed", "the pod's Failed status")
    status = cluster.pod(run)["status"]
    assert status["reason"] == "UnexpectedAdmissionError"
    assert "Allocate failed due to" in status["message"]
    wait_until(lambda: not any(uid == run.uid for uid, _ in ours(cluster)), "the failed pod's release")
    big = cluster.run_pod(gpu_pod("all", [(f"g{i}", 100, 0) for i in range(4)]))
    assert len(cluster.kubelet.allocations(big.uid)) == 4


def test_sockets_removed_under_a_running_kubelet_leave_the_new_endpoint_usable(cluster: SimCluster) -> None:
    """Our sockets removed while the kubelet runs on: the agent serves and registers again. Today's kubelet
    keeps the replaced client, and its stream ending after the new Register would stop the new endpoint;
    the agent ends the old streams before it registers, so the next pod is admitted and started."""
    first = cluster.run_pod(gpu_pod("before", [("c", 50, 4)]))
    counts = {res: cluster.kubelet.registration_count(res) for res in (CORE, MEM)}
    for name in ("vcore.sock", "vmemory.sock"):
        (cluster.kubelet.plugin_dir / name).unlink()
    for res, n in counts.items():
        cluster.kubelet.wait_for_registration(res, after=n, timeout=15, with_devices=True)
    wait_until(lambda: all(len(cluster.kubelet.healthy_ids(r)) > 0 for r in (CORE, MEM)), "healthy devices")
    run = cluster.run_pod(gpu_pod("after", [("c", 50, 4)]))
    assert (run.uid, "c") in ours(cluster) and (first.uid, "c") in ours(cluster)


def test_podresources_leaves_out_init_containers_and_their_start_is_served(cluster: SimCluster) -> None:
    """The kubelet's PodResources lists app containers and sidecars only: an init container's PreStart cannot
    be matched through it, and the agent serves it all the same."""
    manifest = gpu_pod("init", [("app", 50, 4)])
    limits = {CORE: "50", MEM: "4"}
    manifest["spec"]["initContainers"] = [
        {"name": "warmup", "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}},
        {
            "name": "side",
            "image": "cuda",
            "restartPolicy": "Always",
            "resources": {"limits": limits, "requests": dict(limits)},
        },
    ]
    run = cluster.admit(manifest)
    listed = {c.name for p in cluster.kubelet.pod_resources_snapshot() if p.uid == run.uid for c in p.containers}
    assert listed == {"app", "side"}
    cluster.start_containers(run)
    held = ours(cluster)
    for name in ("warmup", "side", "app"):
        assert (held[(run.uid, name)]["Cores"], held[(run.uid, name)]["Memory"]) == (50, 4 * names.MEMORY_BLOCK_BYTES)


def test_a_kubelet_with_get_disabled_is_asked_get_once(tmp_path: Path) -> None:
    """Kubelets 1.27 to 1.33 serve the Get method with its feature gate off: every Get fails with a plain
    error (code Unknown, "PodResources API Get method disabled"), as a pod it does not know does. Once seen,
    the client asks List only, instead of spending one of the kubelet's few tokens on a Get every time."""

    class GateOff(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.calls: list[str] = []

        def List(self, request: object, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
            self.calls.append("List")
            devices = [pr.ContainerDevices(resource_name=CORE, device_ids=["a", "b"])]
            pod = pr.PodResources(
                name="p", namespace="ns", containers=[pr.ContainerResources(name="c", devices=devices)]
            )
            return pr.ListPodResourcesResponse(pod_resources=[pod])

        def Get(self, request: pr.GetPodResourcesRequest, context: grpc.ServicerContext) -> pr.GetPodResourcesResponse:
            self.calls.append("Get")
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")

    lister = GateOff()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pr_grpc.add_PodResourcesListerServicer_to_server(lister, server)
    sock = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    client = PodResourcesClient(sock)
    try:
        for _ in range(3):
            assert client.owner_of(CORE, ["b", "a"], hint=("ns", "p")) == ("ns", "p", "c")
    finally:
        client.close()
        server.stop(0)
    assert lister.calls.count("Get") == 1, lister.calls


@pytest.mark.parametrize("get", ["enabled", "disabled", "absent"])
def test_prestart_finds_its_pod_whatever_the_kubelets_get(tmp_path: Path, sim_built: Path, get: str) -> None:
    """Two identical pods waiting (Allocate cannot tell them apart): PreStartContainer asks the kubelet who holds
    the IDs, through Get where the kubelet serves it, through List where its Get is turned off or absent."""
    c = SimCluster(tmp_path, "v100-pcie-x4", seed=11, status_lag=0.2)
    c.kubelet.pod_resources_get = get  # type: ignore[assignment]
    with c:
        runs = [c.admit(gpu_pod(f"same-{i}", [("c", 25, 2)])) for i in range(2)]
        for run in runs:
            c.start_containers(run)
        held = ours(c)
        for run in runs:
            core = {a.resource: a for a in c.kubelet.allocations(run.uid)}[CORE]
            assert sorted(held[(run.uid, "c")]["DeviceIDs"]) == sorted(core.device_ids)  # type: ignore[call-overload]
        methods = {call.method for call in c.kubelet.pod_resources_calls}
        assert ("Get" in methods) is (get != "absent")


def test_a_start_that_failed_for_want_of_the_agent_is_tried_again_and_the_pod_kept(cluster: SimCluster) -> None:
    """PreStartContainer fails while the agent is down: the kubelet shows the container waiting
    (CreateContainerConfigError, its error in the message) and tries the start again later. The agent, back,
    neither releases nor deletes the pod for that message, and the next try starts it."""
    run = cluster.admit(gpu_pod("waits", [("c", 30, 4)]))
    assert cluster.agent is not None
    cluster.agent.stop()
    with pytest.raises(KubeletSimError):
        cluster.start_containers(run)

    def waiting() -> str:
        statuses = cluster.pod(run).get("status", {}).get("containerStatuses") or [{}]
        return str(statuses[0].get("state", {}).get("waiting", {}).get("reason", ""))

    wait_until(lambda: waiting() == "CreateContainerConfigError", "the container's waiting status")
    message = cluster.pod(run)["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert message.startswith("device plugin PreStartContainer rpc failed with err: ")
    counts = {res: cluster.kubelet.registration_count(res) for res in (CORE, MEM)}
    cluster.start_agent()
    for res, n in counts.items():
        cluster.kubelet.wait_for_registration(res, after=n, timeout=15, with_devices=True)
    time.sleep(1.5)  # an allocation check period: a pod it took for failed would be released by now
    assert (run.uid, "c") in ours(cluster)
    cluster.start_containers(run)
    cluster.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})


def test_kubelet_restart_fails_a_pod_admitted_but_not_started_and_keeps_the_running_one(cluster: SimCluster) -> None:
    """At its restart the kubelet admits every pod again before the plugins are back: the running pod needs
    nothing, the one admitted but not started fails (no healthy devices). The agent releases the failed
    pod's share, keeps the running one's, and serves the next pod once registered again."""
    running = cluster.run_pod(gpu_pod("running", [("c", 50, 4)]))
    pending = cluster.admit(gpu_pod("pending", [("c", 50, 4)]))
    counts = {res: cluster.kubelet.registration_count(res) for res in (CORE, MEM)}
    cluster.restart_kubelet()
    assert cluster.kubelet.allocations(pending.uid) == []
    assert len(cluster.kubelet.allocations(running.uid)) == 2
    wait_until(lambda: cluster.pod(pending).get("status", {}).get("phase") == "Failed", "the pending pod's failure")
    assert "no healthy devices present" in cluster.pod(pending)["status"]["message"]
    wait_until(lambda: (pending.uid, "c") not in ours(cluster), "the failed pod's release")
    assert (running.uid, "c") in ours(cluster)
    for res, n in counts.items():
        cluster.kubelet.wait_for_registration(res, after=n, timeout=15, with_devices=True)
    after = cluster.run_pod(gpu_pod("after", [("c", 50, 4)]))
    assert (after.uid, "c") in ours(cluster)


def test_a_sidecars_ids_seen_in_a_recent_list_need_no_list_of_their_own(tmp_path: Path) -> None:
    """A sidecar (an init container that runs on beside the others) keeps its IDs, unlike the other init
    containers, whose IDs the kubelet hands on: a List made since its Allocate names it rightly, and
    lookups share it rather than each asking the kubelet (10 calls at once at most) for another."""
    lists: list[float] = []

    class Lister(pr_grpc.PodResourcesListerServicer):  # type: ignore[misc]
        def List(self, request: object, context: grpc.ServicerContext) -> pr.ListPodResourcesResponse:
            lists.append(time.monotonic())
            devices = [pr.ContainerDevices(resource_name=CORE, device_ids=["a", "b"])]
            side = pr.ContainerResources(name="side", devices=devices)
            return pr.ListPodResourcesResponse(
                pod_resources=[pr.PodResources(name="p", namespace="ns", containers=[side])]
            )

    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "app"}], "initContainers": [{"name": "side", "restartPolicy": "Always"}]},
    }
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pr_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    sock = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    client = PodResourcesClient(sock)
    resolver = OwnerResolver(
        pod_resources=client, kubelet_checkpoint_path=tmp_path / "none", find_pod=lambda ns, name, listed: pod
    )
    try:
        allocated_at = time.monotonic()
        for _ in range(2):
            assert resolver.owner(CORE, ["b", "a"], since=allocated_at) == ("u1", "side")
    finally:
        client.close()
        server.stop(0)
    assert len(lists) == 1, lists


def test_started_pod_shows_its_init_containers_completed_and_its_sidecar_running(cluster: SimCluster) -> None:
    """As the kubelet reports a started pod: each init container terminated (exit code 0, its processes
    gone), each sidecar running beside the app containers with its own cgroup and container ID."""
    manifest = gpu_pod("phases", [("app", 30, 2)])
    limits = {CORE: "30", MEM: "2"}
    manifest["spec"]["initContainers"] = [
        {"name": "warmup", "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}},
        {"name": "side", "image": "cuda", "restartPolicy": "Always", "resources": {"limits": limits}},
    ]
    run = cluster.run_pod(manifest)
    wait_until(lambda: bool(cluster.pod(run).get("status", {}).get("initContainerStatuses")), "the init statuses")
    states = {s["name"]: s["state"] for s in cluster.pod(run)["status"]["initContainerStatuses"]}
    assert states["warmup"]["terminated"]["exitCode"] == 0 and "running" in states["side"]
    assert set(run.pids) == {"side", "app"}
    pod_dir = cluster.cgroup_root / "kubepods" / f"pod{run.uid}"
    assert len([d for d in pod_dir.iterdir() if d.is_dir() and d.name != run.sandbox]) == 2
    held = ours(cluster)
    assert {name for uid, name in held if uid == run.uid} == {"warmup", "side", "app"}
    cluster.wait_annotations(run, {"tencent.com/gpu-assigned": "true"})
