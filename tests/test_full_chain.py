"""The whole chain on the simulated node: the agent mirrors the driver with the interceptor, allocates a
share, writes its vcuda.config; a CUDA client in that "container" (NVIDIA's cuda-bindings and pynvml,
loading the mirror) is capped at the pod's vcuda-memory."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import GpuSimState, repo_root, sim_env
from simnode.mounts import host_path
from simnode.simhost import install_sim_driver, volume_conf
from tests.make_lock import run_make
from tests.vcuda_fixtures import PRELUDE

MIB = 1 << 20

CLIENT = (
    PRELUDE
    + r"""
import pynvml
total = 0
ptrs = []
while True:
    err, ptr = d.cuMemAlloc(128 << 20)
    if err != R.CUDA_SUCCESS:
        break
    ptrs.append(ptr)
    total += 128 << 20
free, cap = ok(d.cuMemGetInfo())
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
held = sum(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid())
print(json.dumps({"error": err.name, "allocated": total, "free": free, "total": cap, "nvml_total": mem.total,
                  "held": held}))
"""
)


def test_pod_memory_cap_holds_for_a_cuda_client(tmp_path: Path, sim_built: Path) -> None:
    interceptor = repo_root() / "vcuda/build/libcuda-control.so"
    assert interceptor.exists(), "make -C vcuda builds the interceptor"
    root = tmp_path / "host"
    install_sim_driver(root)
    flags = [
        f"--volume-config={volume_conf(tmp_path / 'vdriver', tmp_path / 'volume.conf')}",
        f"--driver-root={root}",
        f"--vcuda-library={interceptor}",
    ]
    with SimCluster(tmp_path / "node", "t4-x1", agent_flags=flags) as c:
        run = c.run_pod(gpu_pod("capped", [("main", 50, 4)]))  # 4 x 256 MiB
        resp = run.core["main"].response
        mounts = {m.container_path: m.host_path for m in resp.mounts}
        config_in_container = resp.envs["VCUDA_CONFIG_PATH"]
        host_config = host_path(resp.mounts, config_in_container)
        assert c.agent is not None
        env = sim_env(c.spec, c.agent.state)
        env["LD_LIBRARY_PATH"] = str(Path(mounts["/usr/local/nvidia"]) / "lib64")
        env["VCUDA_CONFIG_PATH"] = str(host_config)
        env["VCUDA_BUDGET_DIR"] = str(tmp_path / "shm")
        done = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout.strip().splitlines()[-1])
    cap = 4 * names.MEMORY_BLOCK_BYTES
    assert out["error"] == "CUDA_ERROR_OUT_OF_MEMORY"
    # The cap holds for what the GPU holds for the process: its allocations and its context.
    assert cap - 128 * MIB < out["held"] <= cap and out["held"] > out["allocated"]
    assert out["total"] == cap and out["free"] == cap - out["held"]
    assert out["nvml_total"] == cap


def test_two_processes_of_a_shared_pod_stay_within_its_vcuda_core_together(tmp_path: Path, sim_built: Path) -> None:
    """The agent keeps pids.config current, so the container's processes are limited as one."""
    done = run_make(
        ["make", "-s", "-C", str(repo_root() / "vcuda"), "bench", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loop = repo_root() / "vcuda/build/bench/launch_loop"
    root = tmp_path / "host"
    install_sim_driver(root)
    interceptor = repo_root() / "vcuda/build/libcuda-control.so"
    flags = [
        f"--volume-config={volume_conf(tmp_path / 'vdriver', tmp_path / 'volume.conf')}",
        f"--driver-root={root}",
        f"--vcuda-library={interceptor}",
    ]
    with SimCluster(tmp_path / "node", "t4-x1", agent_flags=flags) as c:
        run = c.run_pod(gpu_pod("shared", [("main", 30, 4)]))
        resp = run.core["main"].response
        mounts = {m.container_path: m.host_path for m in resp.mounts}
        host_config = host_path(resp.mounts, resp.envs["VCUDA_CONFIG_PATH"])
        assert c.agent is not None
        env = sim_env(c.spec, c.agent.state)
        env.update(
            LD_LIBRARY_PATH=str(Path(mounts["/usr/local/nvidia"]) / "lib64"),
            VCUDA_CONFIG_PATH=str(host_config),
            VCUDA_BUDGET_DIR=str(tmp_path / "shm"),
        )
        procs = [
            subprocess.Popen(
                [str(loop), "kernel", "spin_1ms", "6.0", "64", "256", "0"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        # The container's processes, as its cgroup shows them: the agent writes them to pids.config.
        cid = f"{run.uid[:8]}main".replace("-", "")
        procs_file = c.cgroup_root / "kubepods" / f"pod{run.uid}" / cid / "cgroup.procs"
        procs_file.write_text("".join(f"{p.pid}\n" for p in procs))
        time.sleep(3.0)
        with GpuSimState(c.agent.state) as st:
            before = st.timeline(0)
            time.sleep(2.0)
            after = st.timeline(0)
        for p in procs:
            _out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
        assert files.read_pids(host_config.parent / "pids.config") == sorted(p.pid for p in procs)
    assert before is not None and after is not None
    pids = {p.pid for p in procs}
    share = 100.0 * (after.busy_of(pids) - before.busy_of(pids)) / (after.now_ns - before.now_ns)
    assert 15.0 <= share <= 42.0, f"the two processes together used {share:.1f}% of a 30% share"
