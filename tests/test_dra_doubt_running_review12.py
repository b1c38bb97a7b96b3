"""Claims that come back from a damaged checkpoint are in doubt: a release the damage lost may bring back a claim the
kubelet unprepared. The check at the start frees those the API server no longer has (or reserves for no pod), but
only once nothing of their containers runs, by the rule of the periodic leaked-claim check: a share claim is kept
while a process its pids.config lists is alive, a whole-GPU claim while NVML lists a process on its GPU (or cannot
tell). Freed while they ran, their GPU or room would go to the next claim under them (two tenants on a whole GPU).
A claim kept so stays prepared, its room counted, and in doubt (in the checkpoint too): it is looked at again, and
freed once nothing runs, by the running agent or at the next start."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.vmanager import files
from simnode.dra_cluster import DRIVER, DRACluster
from tests.test_dra_followups_review11 import bound_pod, delete_claim, healthz, prepared, share, spec_gone, wait_for
from tests.test_dra_review11 import make_claim
from tests.test_dra_whole_gpu_review12 import end, tenant, whole


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=0) as c:
        yield c


def restart_damaged(c: DRACluster) -> None:
    """Stop the agent, damage its checkpoint (an entry of a claim that can no longer be read: every claim that comes
    back from it is in doubt), start it again."""
    assert c.agent is not None
    c.agent.stop()
    path = c.checkpoint_dir / "gpumanager_internal_checkpoint"
    data: dict[str, Any] = json.loads(path.read_text())
    assert data.get("Claims"), "the stop wrote the claims into the snapshot"
    data["Claims"]["0badc1a1-0000-4000-8000-000000000000"] = {"Namespace": "default", "Name": "x", "Devices": "?"}
    path.write_text(json.dumps(data))
    c.start_agent()


def doubt_lines(c: DRACluster, uid: str) -> list[str]:
    assert c.agent is not None
    return [ln for ln in c.agent.log_text().splitlines() if uid in ln and "damaged checkpoint" in ln]


def in_doubt(c: DRACluster, uid: str) -> bool:
    """Whether the checkpoint (its snapshot with its journal) marks the claim in doubt."""
    claims = (read_document(c.checkpoint_dir / "gpumanager_internal_checkpoint") or {}).get("Claims") or {}
    return bool(claims.get(uid, {}).get("Doubt"))


def share_with_process(c: DRACluster, name: str, sleeper: subprocess.Popen[str]) -> tuple[str, str, str]:
    """A share claim on gpu-0 whose pod's container runs ``sleeper``, until the agent's pids.config names it; the pod
    is then force-deleted (the kubelet down: its container goes on)."""
    ref = make_claim(c, name, [share("gpu-0", "60")])
    prepared(c, ref)
    pod = bound_pod(c, f"{name}-pod", name)
    running = {"running": {"startedAt": "2026-11-21T10:00:00Z"}}
    status = {"name": "main", "containerID": "containerd://c1", "ready": True, "restartCount": 0}
    c.core.patch_namespaced_pod_status(
        f"{name}-pod",
        "default",
        {
            "status": {
                "qosClass": "BestEffort",
                "containerStatuses": [{**status, "image": "cuda:12", "imageID": "", "state": running}],
            }
        },
        _content_type="application/merge-patch+json",
    )
    cgroup = c.cgroup_root / "kubepods" / f"pod{pod['metadata']['uid']}" / "c1"
    cgroup.mkdir(parents=True)
    (cgroup / "cgroup.procs").write_text(f"{sleeper.pid}\n")
    pids = c.vm_path / ref[2] / names.PIDS_CONFIG_FILE

    def listed() -> bool:
        try:
            return sleeper.pid in files.read_pids(pids)
        except OSError:
            return False

    wait_for("the claim's pids.config names the container's process", listed)
    c.core.delete_namespaced_pod(f"{name}-pod", "default", grace_period_seconds=0)
    # The kubelet, once back, stops the container and removes its cgroup: the pids.config alone names the process.
    shutil.rmtree(cgroup.parent)
    return ref


@pytest.mark.parametrize("kind", ["whole", "share"])
def test_a_claim_in_doubt_whose_processes_run_is_kept_until_they_end(cluster: DRACluster, kind: str) -> None:
    """The agent restarts on a damaged checkpoint; the claim it had prepared is deleted meanwhile, its container
    still running. The check at the start keeps it (said once, naming the claim and what keeps it): a claim needing
    its room is not prepared. A deleted claim nothing runs for is freed at that start as before. Once the process
    ends, the kept claim is freed by the running agent, and its room given to the next claim."""
    if kind == "whole":
        ref = make_claim(cluster, "held", [whole("gpu-1")])
        prepared(cluster, ref)
        proc = tenant(cluster.base_env, 1)
        keeps = [f"process {proc.pid}", "GPU 1"]
        after = make_claim(cluster, "after", [whole("gpu-1")])
    else:
        proc = subprocess.Popen(["sleep", "300"], text=True)
        ref = share_with_process(cluster, "held", proc)
        keeps = [f"{proc.pid}", "pids.config"]
        after = make_claim(cluster, "after", [share("gpu-0", "50")])  # 60 + 50 cores: over the GPU's 100
    idle = make_claim(cluster, "idle", [whole("gpu-2")])
    prepared(cluster, idle)
    try:
        delete_claim(cluster, "held")
        delete_claim(cluster, "idle")
        restart_damaged(cluster)
        wait_for("the idle claim freed at the start", lambda: spec_gone(cluster, idle[2]))
        assert any("freeing it" in ln for ln in doubt_lines(cluster, idle[2]))
        time.sleep(4)  # the start's check, and several periodic checks
        assert not spec_gone(cluster, ref[2]), "freed while a process of the container using it runs"
        assert healthz(cluster)["claims"] == 1
        lines = doubt_lines(cluster, ref[2])
        assert len(lines) == 1, lines  # said once while the reason stays
        assert "kept" in lines[0] and "held" in lines[0], lines[0]
        for word in keeps:
            assert word in lines[0], lines[0]
        assert in_doubt(cluster, ref[2]), "kept in doubt: checked again (at the next start too)"
        assert cluster.kubelet is not None
        assert cluster.kubelet.prepare(DRIVER, [after])[after[2]]["error"] != "", "its room was given under it"
    finally:
        end(proc)
    wait_for("the claim freed once its process is gone", lambda: spec_gone(cluster, ref[2]), timeout=90)
    assert healthz(cluster)["claims"] == 0
    assert any("freeing it" in ln for ln in doubt_lines(cluster, ref[2]))
    prepared(cluster, after)


def test_a_claim_kept_in_doubt_is_freed_at_the_next_start_once_nothing_runs(cluster: DRACluster) -> None:
    """Kept at a start for its running process, the claim stays in doubt in the checkpoint: the agent restarted
    after the process ended (a clean checkpoint now) checks it again at its start and frees it."""
    ref = make_claim(cluster, "held", [whole("gpu-3")])
    prepared(cluster, ref)
    proc = tenant(cluster.base_env, 3)
    try:
        delete_claim(cluster, "held")
        restart_damaged(cluster)
        wait_for("the claim said kept", lambda: any("kept" in ln for ln in doubt_lines(cluster, ref[2])))
        assert not spec_gone(cluster, ref[2])
    finally:
        end(proc)
    assert cluster.agent is not None
    cluster.agent.stop()
    assert in_doubt(cluster, ref[2]), "the stop keeps the mark"
    cluster.start_agent()
    wait_for("the claim freed at the next start", lambda: spec_gone(cluster, ref[2]), timeout=20)
