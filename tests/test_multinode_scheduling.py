"""Pods scheduled over several simulated nodes with real agents: the kube-scheduler stand-in calls the
real extender process over HTTP; a second stand-in without the extender shows what fails without it.

Nodes: ``a800`` (8 x A800, GPU 7 has 40 GB instead of 80, NVLink pairs 0-1 2-3 4-5 6-7),
``v100`` (4 x V100 PCIe), ``t4`` (1 x T4). The cluster is shared by the tests of this module;
each test deletes its pods afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.kube.gpu_inventory import ANNOTATION
from simnode.gpusim_state import load_spec, spec_dir
from simnode.multinode import MultiNodeCluster, pending_pod
from simnode.scheduler import SchedulerStandIn
from tests.agent_fixtures import gpusim
from tests.extender_fixtures import wait_for
from tests.metrics_text import samples, value

GIB_BLOCKS = (1 << 30) // names.MEMORY_BLOCK_BYTES
PREFIX = names.PREDICATE_GPU_IDX_PREFIX
PLAIN = "plain-scheduler"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, sim_built: Path) -> Iterator[MultiNodeCluster]:
    c = MultiNodeCluster(
        tmp_path_factory.mktemp("multinode"),
        [("a800", "a800-nvlink-pairs-x8"), ("v100", "v100-pcie-x4"), ("t4", "t4-x1")],
        agent_flags=["--health-probe-period=200ms"],
        node_status_period=0.3,
        scheduler_backoff=(0.2, 1.0),
    )
    c.start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def plain(cluster: MultiNodeCluster) -> Iterator[SchedulerStandIn]:
    """A second scheduler, without the extender: node totals only (a cluster without gpu-admission)."""
    s = SchedulerStandIn(cluster.api.client(), scheduler_name=PLAIN, initial_backoff=0.2, max_backoff=1.0)
    s.start()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def clean(cluster: MultiNodeCluster) -> Iterator[None]:
    yield
    for pod in cluster.api.pods():
        cluster.api.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
    wait_for(lambda: all(not n.kubelet.allocations() for n in cluster.nodes.values()), what="devices given back")
    wait_for(lambda: "gpu_extender_pods 0.0" in extender(cluster).metrics(), what="the extender forgets the pods")


def extender(cluster: MultiNodeCluster) -> Any:
    assert cluster.extender is not None
    return cluster.extender


def on(node: str, containers: Sequence[tuple[int, int]], name: str, **kw: Any) -> dict[str, Any]:
    """A pod the scheduler may place only on ``node``."""
    return pending_pod(name, containers, node_selector={"kubernetes.io/hostname": node}, **kw)


def pinned(
    node: str, gpus: Sequence[Sequence[int]], containers: Sequence[tuple[int, int]], name: str
) -> dict[str, Any]:
    """A pod created on ``node`` with gpu-admission's annotations naming its GPUs (no scheduler)."""
    annotations = {f"{PREFIX}{i}": ",".join(map(str, g)) for i, g in enumerate(gpus)}
    annotations.update({names.PREDICATE_NODE: node, names.PREDICATE_TIME: str(time.time_ns())})
    annotations[names.GPU_ASSIGNED] = "false"
    return pending_pod(name, containers, node=node, annotations=annotations)


def run_all(cluster: MultiNodeCluster, pods: Sequence[Mapping[str, Any]]) -> None:
    for pod in pods:
        cluster.create(pod)
    for pod in pods:
        cluster.wait_phase(pod["metadata"]["name"])


def plain_pod(manifest: dict[str, Any]) -> dict[str, Any]:
    manifest["spec"]["schedulerName"] = PLAIN
    return manifest


def refusal_of(cluster: MultiNodeCluster, name: str) -> str:
    pod = cluster.wait_phase(name, ("Failed",), timeout=60)
    assert pod["status"]["reason"] == "UnexpectedAdmissionError", pod["status"]
    return str(pod["status"]["message"])


def refused(cluster: MultiNodeCluster, pods: Sequence[Mapping[str, Any] | str]) -> list[str]:
    """The pods among ``pods`` that a node refused at admission."""
    wanted = {f"default/{p if isinstance(p, str) else p['metadata']['name']}" for p in pods}
    return [r.pod for r in cluster.refusals() if r.pod in wanted]


def gpu_health(cluster: MultiNodeCluster, node: str) -> list[str]:
    """Each GPU's health as the agent published it on its node."""
    found = cluster.api.get_node(node)
    assert found is not None
    return [g["health"] for g in json.loads(found["metadata"]["annotations"][ANNOTATION])["gpus"]]


def uuids(spec: str) -> list[str]:
    return [g.uuid for g in load_spec(spec_dir() / f"{spec}.json").gpus]


def visible_devices(cluster: MultiNodeCluster, node: str, pod: Mapping[str, Any]) -> str:
    records = cluster.nodes[node].kubelet.allocations(pod["metadata"]["uid"])
    core = [r for r in records if r.resource == names.VCORE_RESOURCE]
    return str(core[0].response.envs["NVIDIA_VISIBLE_DEVICES"])


def test_fragmented_node_refuses_a_share_another_node_runs_it(
    cluster: MultiNodeCluster, plain: SchedulerStandIn
) -> None:
    run_all(cluster, [pinned("a800", [[i]], [(60, 4)], f"busy-{i}") for i in range(8)])  # 40 cores left on each GPU
    pod = cluster.create(pending_pod("share60", [(60, 4)]))
    running = cluster.wait_phase("share60")
    assert running["spec"]["nodeName"] in ("v100", "t4")
    reason = extender(cluster).post("filter", {"Pod": pod, "Nodes": {"items": cluster.api.nodes()}})["FailedNodes"]
    assert "needs 60 cores" in reason["a800"] and "no GPU has 60 free cores" in reason["a800"], reason
    # Without the extender the node totals (320 cores free) admit it, and the agent must refuse it.
    cluster.create(plain_pod(on("a800", [(60, 4)], "share60-plain")))
    assert "no GPU has 60 cores" in refusal_of(cluster, "share60-plain")
    assert refused(cluster, ["share60"]) == []


def test_a800_node_with_a_smaller_gpu(cluster: MultiNodeCluster, plain: SchedulerStandIn) -> None:
    run_all(cluster, [pinned("a800", [[i]], [(100, 0)], f"whole-{i}") for i in range(7)])  # only GPU 7 (40 GB) left
    cluster.create(on("a800", [(50, 60 * GIB_BLOCKS)], "big"))
    message = cluster.wait_unschedulable("big")
    assert "61440 MiB on one GPU: no GPU has 61440 MiB free" in message, message
    small = cluster.create(on("a800", [(50, 30 * GIB_BLOCKS)], "small"))
    assert cluster.wait_phase("small")["metadata"]["annotations"][f"{PREFIX}0"] == "7"
    assert visible_devices(cluster, "a800", small) == uuids("a800-nvlink-pairs-x8")[7]
    cluster.create(plain_pod(on("a800", [(50, 60 * GIB_BLOCKS)], "big-plain")))
    assert "61440 MiB" in refusal_of(cluster, "big-plain")


def test_whole_gpus_on_an_nvlink_pair(cluster: MultiNodeCluster) -> None:
    run_all(cluster, [pinned("a800", [[0]], [(10, 4)], "a800-share"), pinned("v100", [[0]], [(10, 4)], "v100-share")])
    pod = cluster.create(pending_pod("pair", [(200, 0)]))
    running = cluster.wait_phase("pair")
    assert running["spec"]["nodeName"] == "a800"  # NVLink beats PCIe
    assert running["metadata"]["annotations"][f"{PREFIX}0"] == "2,3"  # the intact pair, not 1 and another
    assert visible_devices(cluster, "a800", pod) == ",".join(uuids("a800-nvlink-pairs-x8")[2:4])


def test_concurrent_pods_never_over_commit(cluster: MultiNodeCluster) -> None:
    sizes = [(30, 2), (45, 4), (70, 8), (25, 2), (100, 0), (55, 6), (35, 2), (200, 0), (20, 1), (65, 4)] * 4
    pods = [pending_pod(f"c{i}", [(cores, blocks * GIB_BLOCKS // 4)]) for i, (cores, blocks) in enumerate(sizes)]
    threads = [threading.Thread(target=cluster.create, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_for(lambda: cluster.scheduler is not None and cluster.scheduler.idle(), timeout=60, what="scheduler idle")
    wait_for(
        lambda: all(
            cluster.pod(p["metadata"]["name"])["status"].get("phase") == "Running"
            or not cluster.pod(p["metadata"]["name"])["spec"].get("nodeName")
            for p in pods
        ),
        timeout=60,
        what="bound pods running",
    )
    running = [p for p in pods if cluster.pod(p["metadata"]["name"])["status"].get("phase") == "Running"]
    assert len(running) >= 15
    assert refused(cluster, pods) == []
    assert cluster.over_committed() == {}


def test_bind_conflict_and_failed_binding_are_retried(cluster: MultiNodeCluster) -> None:
    """Counted from this test's start: the extender is the module's, and a test before it on the same worker (the
    concurrent pods) may have had conflicts of its own."""
    before = samples(extender(cluster).metrics())
    cluster.api.fail_next("PATCH", r"/pods/conflicted$", 409)
    cluster.api.fail_next("POST", r"/pods/requeued/binding$", 500, message="the binding was lost")
    cluster.create(pending_pod("conflicted", [(40, 4)]))
    cluster.create(pending_pod("requeued", [(40, 4)]))
    for name in ("conflicted", "requeued"):
        cluster.wait_phase(name)
    metrics = extender(cluster).metrics()
    after = samples(metrics)
    conflicts = "gpu_extender_bind_conflicts_total"
    assert value(after, conflicts, absent=0.0) - value(before, conflicts, absent=0.0) >= 1, metrics
    errors = {"outcome": "error", "verb": "bind"}
    failed = value(after, "gpu_extender_decisions_total", absent=0.0, **errors)
    assert failed - value(before, "gpu_extender_decisions_total", absent=0.0, **errors) >= 1, metrics
    assert (
        cluster.scheduler is not None and "the binding was lost" in cluster.scheduler.stats.messages["default/requeued"]
    )
    assert refused(cluster, ["conflicted", "requeued"]) == []


def test_extender_restart_rebuilds_its_view(cluster: MultiNodeCluster) -> None:
    run_all(cluster, [pinned("v100", [[i]], [(80, 8)], f"v-full-{i}") for i in range(4)])  # 20 cores left on each
    ext = extender(cluster)
    ext.kill()
    cluster.create(on("v100", [(30, 4)], "while-down"))  # the node totals (80 cores free) let it through
    cluster.create(on("t4", [(30, 4)], "also-while-down"))
    time.sleep(1.0)  # the scheduler cannot reach the extender: the pods wait
    assert cluster.pod("also-while-down")["status"]["phase"] == "Pending"
    cluster.start_extender()
    cluster.wait_phase("also-while-down")
    message = cluster.wait_unschedulable("while-down")
    assert "no GPU has 30 free cores" in message, message  # the running pods are counted after the restart
    assert refused(cluster, ["while-down", "also-while-down"]) == []


def test_unhealthy_gpus_are_skipped(cluster: MultiNodeCluster, plain: SchedulerStandIn) -> None:
    v100 = cluster.nodes["v100"]
    v100.agent.wait_for_log("watching XID events on 4 of 4 GPUs")
    gpusim(v100.agent, "xid", "--gpu", "3", "--xid", "79")  # GPU 3 unhealthy for the agent's quiet period (5 min)
    wait_for(lambda: gpu_health(cluster, "v100")[3] == names.UNHEALTHY, what="GPU 3 published unhealthy")
    run_all(cluster, [pinned("v100", [[i]], [(60, 4)], f"v-busy-{i}") for i in range(3)])
    cluster.create(on("v100", [(60, 4)], "share-on-v100"))
    message = cluster.wait_unschedulable("share-on-v100")
    assert "no GPU has 60 free cores (the node has unhealthy GPUs)" in message, message
    # The node totals still show 120 cores free on healthy devices: without the extender it is refused.
    cluster.create(plain_pod(on("v100", [(60, 4)], "share-plain")))
    assert "no GPU has 60 cores" in refusal_of(cluster, "share-plain")


def test_a_deleted_pods_gpu_goes_to_the_next_pod(cluster: MultiNodeCluster) -> None:
    first = cluster.create(on("t4", [(100, 0)], "first"))
    cluster.wait_phase("first")
    second = cluster.create(on("t4", [(100, 0)], "second"))
    message = cluster.wait_unschedulable("second")
    assert "Insufficient tencent.com/vcuda-core" in message, message  # the node total is taken
    cluster.delete("first")  # graceful: the node stops it, reports it Succeeded, then deletes it
    wait_for(lambda: cluster.api.get_pod("default", "first") is None, what="first gone")
    cluster.wait_phase("second")
    assert refused(cluster, [first, second]) == []
    t4 = cluster.nodes["t4"].kubelet
    assert [r.pod_uid for r in t4.allocations()] == [second["metadata"]["uid"]]


def test_the_node_reports_a_start_late_and_finishes_a_deleted_pod(cluster: MultiNodeCluster) -> None:
    t4 = cluster.nodes["t4"]
    t4.status_lag = 30.0  # the status update naming the started containers is far away
    try:
        pod = cluster.create(pinned("t4", [[0]], [(50, 4)], "late"))
        uid = pod["metadata"]["uid"]
        wait_for(lambda: (t4.cgroup_root / "kubepods" / f"pod{uid}").exists(), what="containers started")
        assert cluster.pod("late")["status"]["phase"] == "Pending"
    finally:
        t4.status_lag = cluster.nodes["v100"].status_lag
    cluster.delete("late")  # the containers stop now; the last status and the final DELETE follow the lag
    wait_for(lambda: not t4.kubelet.allocations(uid), what="the devices given back")
    assert cluster.pod("late")["metadata"]["deletionTimestamp"]
    wait_for(lambda: cluster.api.get_pod("default", "late") is None, what="the pod gone")
    assert not (t4.cgroup_root / "kubepods" / f"pod{uid}").exists()
