"""Recovery after restarts of the agent and the kubelet, checked through the agent's own surfaces.

Each test drives the real agent process on the simulated node (SimCluster) and compares what the
kubelet gave each container (its stored Allocate answer) with what the agent says it holds (/usage,
the per-GPU metrics) after the restart.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod

pytestmark = pytest.mark.usefixtures("sim_built")


def _get(cluster: SimCluster, path: str) -> str:
    assert cluster.agent is not None
    url = f"http://127.0.0.1:{cluster.agent.query_port}{path}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return str(answer.read().decode())


def _usage(cluster: SimCluster) -> dict[tuple[str, str], tuple[tuple[int, ...], float, float]]:
    """(pod uid, container) -> (GPU indexes, GPUs' worth of cores, MiB) as /usage says."""
    out = {}
    for uid, pod in json.loads(_get(cluster, "/usage")).get("usage", {}).items():
        for container, spec in pod["spec"].items():
            cards = tuple(sorted(int(d["card_idx"]) for d in pod["stat"][container]["dev"]))
            out[(uid, container)] = (cards, float(spec["gpu"]), float(spec["mem"]))
    return out


def _answers(cluster: SimCluster) -> dict[tuple[str, str], tuple[tuple[int, ...], float, float]]:
    """The same, as the kubelet's stored Allocate answers (vcuda-core) say."""
    out = {}
    for rec in cluster.kubelet.allocations():
        if rec.resource != names.VCORE_RESOURCE:
            continue
        ann = dict(rec.response.annotations)
        devices = [d for d in ann[names.VDEVICE_ANNOTATION].split(",") if d]
        cards = tuple(sorted(int(d.removeprefix("/dev/nvidia")) for d in devices))
        out[(rec.pod_uid, rec.container_name)] = (
            cards,
            int(ann[names.VCORE_RESOURCE]) / 100,
            int(ann[names.VMEMORY_RESOURCE]) / 2**20,
        )
    return out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[SimCluster]:
    sim = SimCluster(tmp_path, "h100-nvlink-x8", seed=11, status_lag=0, fill="sorted")
    sim.start()
    try:
        yield sim
    finally:
        sim.stop()


def test_restart_with_another_virtual_manager_path_names_the_pods_answered_with_the_old_one(
    cluster: SimCluster,
) -> None:
    """A share container mounts <old vm>/<pod uid> at /etc/vcuda (its answer, stored by the kubelet, is
    used again at each restart of the container). An agent started again with another
    --virtual-manager-path serves vcuda.sock and writes limit files where that container does not look:
    the upstream library ends a process whose registration finds no one. The allocations are kept; the
    agent says which pods were answered with which directory, and what to do."""
    cluster.run_pod(gpu_pod("share", [("main", 40, 8)], annotations=admission_annotations([[2]], 1)))
    cluster.run_pod(gpu_pod("whole", [("main", 100, 8)]))
    before = _usage(cluster)
    assert before == _answers(cluster)
    old_vm = cluster.vm_path
    assert cluster.agent is not None
    cluster.agent.stop()
    cluster.vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-moved-"))
    try:
        mark = len(cluster.agent.log_text())
        cluster.start_agent()
        log = cluster.agent.log_text()[mark:]
        assert _usage(cluster) == before  # nothing lost, nothing moved
        errors = [line for line in log.splitlines() if " ERROR " in line and "--virtual-manager-path" in line]
        assert errors, log[-3000:]
        text = "\n".join(errors)
        assert f"--virtual-manager-path={cluster.vm_path}" in text
        assert str(old_vm) in text
        assert "default/share" in text
        assert "default/whole" not in text  # a whole GPU's container does not load the library
        assert "Traceback" not in log
    finally:
        cluster.agent.stop()
        shutil.rmtree(cluster.vm_path, ignore_errors=True)
        cluster.vm_path = old_vm
        cluster.start_agent()


def test_restart_with_the_same_virtual_manager_path_says_nothing_of_it(cluster: SimCluster) -> None:
    cluster.run_pod(gpu_pod("share", [("main", 40, 8)]))
    assert cluster.agent is not None
    cluster.agent.stop()
    mark = len(cluster.agent.log_text())
    cluster.start_agent()
    log = cluster.agent.log_text()[mark:]
    assert "--virtual-manager-path" not in log


def test_a_snapshot_of_a_layout_this_agent_does_not_read_is_set_aside_and_named(cluster: SimCluster) -> None:
    """A snapshot without PodGPUMapping but with keys this agent does not know (a newer version's layout,
    left by a downgrade) used to be read as "no allocations", silently, and was then overwritten by the
    first snapshot written: what only it held was gone without a copy or a word. It is now refused like
    a damaged one: named with the keys it holds, kept aside as <name>.corrupt-<time>, and the allocations
    are rebuilt from the kubelet's records."""
    running = cluster.run_pod(gpu_pod("running", [("main", 40, 8)]))
    cluster.admit(gpu_pod("waiting", [("main", 30, 8)]))
    before = _usage(cluster)
    assert len(before) == 2 and running.uid in {uid for uid, _ in before}
    assert cluster.agent is not None
    cluster.agent.stop()
    snapshot = cluster.checkpoint_dir / names.OWN_CHECKPOINT
    newer = {"Version": 7, "Allocations": json.loads(snapshot.read_text())["PodGPUMapping"]}
    snapshot.write_text(json.dumps(newer))
    for segment in cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}.journal-*"):
        segment.unlink()
    mark = len(cluster.agent.log_text())
    cluster.start_agent()
    log = cluster.agent.log_text()[mark:]
    assert _usage(cluster) == before  # rebuilt from the kubelet's records
    unusable = [line for line in log.splitlines() if "our checkpoint" in line and "unusable" in line]
    assert unusable, log[-3000:]
    assert str(snapshot) in unusable[0]
    assert "'Allocations'" in unusable[0] and "'Version'" in unusable[0]
    kept = list(cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}.corrupt-*"))
    assert [json.loads(p.read_text()) for p in kept] == [newer]
    assert "Traceback" not in log


def test_a_snapshot_with_no_entries_at_all_is_an_empty_one(cluster: SimCluster) -> None:
    """``{}`` and upstream's ``{"PodGPUMapping": null}`` hold no allocation: nothing is set aside."""
    assert cluster.agent is not None
    for empty in ("{}", '{"PodGPUMapping":null}'):
        cluster.agent.stop()
        snapshot = cluster.checkpoint_dir / names.OWN_CHECKPOINT
        snapshot.write_text(empty)
        for segment in cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}.journal-*"):
            segment.unlink()
        mark = len(cluster.agent.log_text())
        cluster.start_agent()
        log = cluster.agent.log_text()[mark:]
        assert "unusable" not in log, log[-2000:]
        assert not list(cluster.checkpoint_dir.glob(f"{names.OWN_CHECKPOINT}.corrupt-*"))


def _over_committed(cluster: SimCluster) -> dict[int, float]:
    """GPUs whose shares (from /usage) add up to more than the whole GPU."""
    per_gpu: dict[int, float] = {}
    for cards, gpus, _ in _usage(cluster).values():
        for card in cards:
            per_gpu[card] = per_gpu.get(card, 0.0) + gpus / len(cards)
    return {card: share for card, share in per_gpu.items() if share > 1.0001}


def test_sigkill_at_each_stage_and_a_kubelet_restart_keep_every_container_on_its_answer(cluster: SimCluster) -> None:
    """SIGKILL with containers answered but not started, a kubelet restart while the agent is down, a pod
    deleted while it is down and a new pod placed on the GPU it freed: after each restart the agent holds
    exactly what the kubelet's stored answers say (GPUs, cores, memory), no more, and no GPU is
    over-committed."""
    assert cluster.agent is not None
    a = cluster.run_pod(gpu_pod("a", [("main", 50, 16)], annotations=admission_annotations([[0]], 1)))
    cluster.run_pod(gpu_pod("b", [("main", 100, 32), ("side", 30, 4)]))
    waiting = [
        cluster.admit(gpu_pod("x", [("main", 40, 8)])),
        cluster.admit(gpu_pod("y", [("main", 200, 8)])),
    ]
    assert _usage(cluster) == _answers(cluster)

    cluster.agent.signal(9)
    cluster.agent.wait()
    cluster.start_agent()
    assert _usage(cluster) == _answers(cluster)
    for run in waiting:
        cluster.start_containers(run)
    assert _usage(cluster) == _answers(cluster)

    cluster.agent.signal(9)
    cluster.agent.wait()
    cluster.restart_kubelet()
    cluster.start_agent()
    assert _usage(cluster) == _answers(cluster)

    cluster.agent.signal(9)
    cluster.agent.wait()
    cluster.delete(a, wait=True)
    cluster.start_agent()
    cluster.run_pod(gpu_pod("n", [("main", 60, 16)], annotations=admission_annotations([[0]], 2)))
    assert _usage(cluster) == _answers(cluster)
    assert a.uid not in {uid for uid, _ in _usage(cluster)}
    assert not _over_committed(cluster)


def test_a_virtual_manager_path_reaching_the_same_directory_by_a_link_is_no_move(cluster: SimCluster) -> None:
    cluster.run_pod(gpu_pod("share", [("main", 40, 8)]))
    old_vm = cluster.vm_path
    link = Path(tempfile.mkdtemp(prefix="gm-ln-")) / "vm"
    link.symlink_to(old_vm)
    assert cluster.agent is not None
    cluster.agent.stop()
    cluster.vm_path = link
    try:
        mark = len(cluster.agent.log_text())
        cluster.start_agent()
        assert "--virtual-manager-path" not in cluster.agent.log_text()[mark:]
    finally:
        cluster.agent.stop()
        cluster.vm_path = old_vm
        shutil.rmtree(link.parent, ignore_errors=True)
        cluster.start_agent()
