"""The whole agent on the simulated node while one GPU's NVML calls hang (a GPU stuck in reset)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from gpumanager import names
from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import GpuSimState
from tests.battery_fixtures import answered, gpu, write_spec


def _get(port: int, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
        return response.status, response.read().decode()


def test_kubelet_calls_metrics_and_probes_are_served_while_a_gpu_hangs(tmp_path: Path) -> None:
    spec = write_spec(tmp_path / "four.json", [gpu(i) for i in range(4)], lambda i, j: "PHB")
    cluster = SimCluster(tmp_path / "node", spec)
    with cluster:
        agent = cluster.agent
        assert agent is not None
        state = GpuSimState(agent.state)
        try:
            state.set_hung(1, True)
            # The health thread gives the hung GPU's call 5 s, then lists its devices Unhealthy.
            deadline = time.monotonic() + 60
            gpu1 = {f"{names.VCORE_ID_PREFIX}{n}" for n in range(100, 200)}
            while time.monotonic() < deadline:
                devices = cluster.kubelet.devices(names.VCORE_RESOURCE)
                if all(not devices[i].healthy for i in gpu1):
                    break
                time.sleep(0.1)
            devices = cluster.kubelet.devices(names.VCORE_RESOURCE)
            assert all(not devices[i].healthy for i in gpu1)
            assert all(d.healthy for i, d in devices.items() if i not in gpu1)
            run = cluster.run_pod(gpu_pod("whole", [("main", 100, 0)]))
            assert answered(run)["main"][0][0] != 1  # placed on a GPU that answers
            status, body = _get(agent.query_port, "/metrics")
            assert status == 200
            assert 'gpu_manager_gpu_healthy{gpu="1"' in body
            used = [line for line in body.splitlines() if line.startswith("gpu_manager_gpu_memory_used_bytes{")]
            assert used and not any('gpu="1"' in line for line in used)  # only the hung GPU's figures are left out
            assert _get(agent.query_port, "/healthz")[0] == 200
        finally:
            state.set_hung(1, False)
            state.close()
