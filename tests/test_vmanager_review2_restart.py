"""A pod's vcuda.sock across an agent restart while the API server does not answer (found by review).

The vcuda-controller library registers each process at its first CUDA call and kills the process
when gpu-client fails: a socket file nobody listens on (the agent restarting) costs the process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import SimCluster, gpu_pod
from tests.gpu_client_fixtures import client_built
from tests.test_vcuda_registration import container_id, gpu_client

__all__ = ["client_built"]

#: What the agent logs when its pod cache did not fill in time (the API server does not answer).
NOT_SYNCED = "the pod cache is not synced yet"


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path, client_built: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, "h100-nvlink-x8") as c:
        yield c


def _listening(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
        return True


def test_a_restarted_agent_listens_on_pod_sockets_before_the_api_server_answers(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("shared", [("main", 20, 4)]))
    cid = container_id(run, "main")
    assert gpu_client(cluster, run, "--cont-id", cid).returncode == 0
    sock = cluster.vm_path / run.uid / names.VCUDA_SOCKET
    assert cluster.agent is not None
    cluster.agent.stop()
    before = cluster.agent.log_text().count(NOT_SYNCED)

    cluster.api.set_down(True, "hang")
    try:
        agent = cluster.start_agent(wait=False)
        # Until the pod's socket listens (an agent that stopped early fails below).
        not_synced_first = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and agent.proc is not None and agent.proc.poll() is None:
            not_synced_first = agent.log_text().count(NOT_SYNCED) > before
            if _listening(sock):
                break
            time.sleep(0.02)
        assert _listening(sock), f"the pod's vcuda.sock never listened:\n{agent.log_text()[-3000:]}"
        assert not not_synced_first, "the pod's vcuda.sock listened only after the wait for the API server"
        # A process registering now waits for the pod instead of dying, and is answered once the API is back.
        result: dict[str, int] = {}
        caller = threading.Thread(
            target=lambda: result.update(rc=gpu_client(cluster, run, "--cont-id", cid).returncode)
        )
        caller.start()
    finally:
        cluster.api.set_down(False)
    caller.join(60)
    assert result.get("rc") == 0, agent.log_text()[-3000:]
    assert files.read_pids(cluster.vm_path / run.uid / cid / names.PIDS_CONFIG_FILE) == [run.pids["main"]]
