"""A claim whose pod was force-deleted while the kubelet was down, its containers still running, and the agent
restarted meanwhile: the agent no longer knows which pods used the claim, but the claim's pids.config names their
processes. The claim is kept while one of them lives, and freed once they are gone."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from simnode.dra_cluster import DRACluster
from tests.test_dra_doubt_running_review12 import share_with_process
from tests.test_dra_followups_review11 import (
    delete_claim,
    healthz,
    spec_gone,
    wait_for,
)


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=0) as c:
        yield c


def test_after_an_agent_restart_a_claim_whose_processes_run_is_kept(cluster: DRACluster) -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        ref = share_with_process(cluster, "forced", sleeper)
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
