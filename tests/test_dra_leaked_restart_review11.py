"""A claim whose pod was force-deleted while the kubelet was down, its containers still running, and the agent
restarted meanwhile: the agent no longer knows which pods used the claim, but the claim's pids.config names their
processes. The claim is kept while one of them lives, and freed once they are gone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.dra_cluster import DRACluster
from tests.test_dra_followups_review11 import (
    bound_pod,
    delete_claim,
    healthz,
    prepared,
    share,
    spec_gone,
    wait_for,
)
from tests.test_dra_review11 import make_claim


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=0) as c:
        yield c


def test_after_an_agent_restart_a_claim_whose_processes_run_is_kept(cluster: DRACluster) -> None:
    ref = make_claim(cluster, "forced", [share("gpu-0", "50")])
    prepared(cluster, ref)
    pod = bound_pod(cluster, "forced-pod", "forced")
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        running = {"running": {"startedAt": "2026-11-21T10:00:00Z"}}
        status = {"name": "main", "containerID": "containerd://c1", "ready": True, "restartCount": 0}
        cluster.core.patch_namespaced_pod_status(
            "forced-pod",
            "default",
            {
                "status": {
                    "qosClass": "BestEffort",
                    "containerStatuses": [{**status, "image": "cuda:12", "imageID": "", "state": running}],
                }
            },
            _content_type="application/merge-patch+json",
        )
        cgroup = cluster.cgroup_root / "kubepods" / f"pod{pod['metadata']['uid']}" / "c1"
        cgroup.mkdir(parents=True)
        (cgroup / "cgroup.procs").write_text(f"{sleeper.pid}\n")
        pids = cluster.vm_path / ref[2] / names.PIDS_CONFIG_FILE

        def listed() -> bool:
            try:
                return sleeper.pid in files.read_pids(pids)
            except OSError:
                return False

        wait_for("the claim's pids.config names the container's process", listed)
        cluster.core.delete_namespaced_pod("forced-pod", "default", grace_period_seconds=0)
        delete_claim(cluster, "forced")
        assert cluster.agent is not None
        cluster.agent.stop()
        cluster.start_agent()
        time.sleep(6)  # several checks past the two-period grace
        assert not spec_gone(cluster, ref[2]), "freed while a process of a container using it runs"
        assert healthz(cluster)["claims"] == 1
    finally:
        sleeper.kill()
        sleeper.wait()
    wait_for("the claim freed once its processes are gone", lambda: spec_gone(cluster, ref[2]), timeout=30)
