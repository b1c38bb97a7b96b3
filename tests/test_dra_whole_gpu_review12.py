"""A whole-GPU claim whose pod was force-deleted while the kubelet was down, its containers still running, and the
agent restarted meanwhile: the agent no longer knows which pods used the claim, and a whole-GPU claim has no
pids.config naming their processes. Its GPU is the claim's alone, so every process NVML lists on it is the claim's
tenant: the claim is kept while NVML lists one (whatever PID NVML shows it under), or while NVML cannot tell, and
freed once none runs there. A share claim's GPU is shared: what runs on it keeps nothing (its pids.config does)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from simnode.dra_cluster import DRIVER, NODE, DRACluster
from simnode.gpusim_state import GpuSimState, sim_env, spec_dir
from tests.test_dra_followups_review11 import bound_pod, delete_claim, healthz, prepared, share, spec_gone, wait_for
from tests.test_dra_review11 import make_claim

#: A process that takes a CUDA context on GPU argv[1] (so NVML lists it there) and runs until it is killed.
TENANT = r"""
import ctypes, sys, time
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert cu.cuInit(0) == 0
assert cu.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])) == 0
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    # A check period of 1 s: a claim unused for two periods (2 s) is looked at.
    with DRACluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"], status_lag=0) as c:
        yield c


def whole(device: str) -> dict[str, str]:
    """A result of a whole GPU (no share, no capacity)."""
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}


def tenant(env: dict[str, str], gpu: int) -> subprocess.Popen[str]:
    """A process with a CUDA context on GPU ``gpu`` of the simulated node (NVML lists it there)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TENANT, str(gpu)], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"the tenant did not start: {line!r}, rc {proc.poll()}"
    return proc


def end(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()


def nvml_lists(c: DRACluster, pid: int, gpu: int) -> bool:
    assert c.agent is not None
    with GpuSimState(c.agent.state) as st:
        return any(p.pid == pid and p.gpu == gpu for p in st.snapshot().processes)


def kept_lines(c: DRACluster, uid: str) -> list[str]:
    assert c.agent is not None
    return [ln for ln in c.agent.log_text().splitlines() if uid in ln and "kept" in ln]


# -- the simulated NVML ----------------------------------------------------------------------------

LISTS = r"""
import json, os, pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
print(json.dumps({"compute": sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
                  "graphics": sorted(p.pid for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(h)),
                  "compute_v2": sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)),
                  "graphics_v2": sorted(p.pid for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses_v2(h))}))
"""


def test_the_simulated_nvml_lists_graphics_processes_and_hides_the_pids_of_other_namespaces(
    tmp_path: Path, sim_built: Path
) -> None:
    """Graphics processes are listed by nvmlDeviceGetGraphicsRunningProcesses (not among the compute ones); a caller
    in a PID namespace of its own (GPUSIM_OWN_PID_NAMESPACE=1, a pod without hostPID) is shown the processes of other
    namespaces with PID 0, as a driver that translates PIDs into the caller's namespace shows them."""
    env = sim_env(spec_dir() / "t4-x1.json", tmp_path / "state")
    with GpuSimState(tmp_path / "state") as st:
        st.set_process(0, 4242, 1 << 30)
        st.set_process(0, 4343, 1 << 20, graphics=True)

    def lists(extra: dict[str, str]) -> dict[str, list[int]]:
        out = subprocess.run(
            [sys.executable, "-c", LISTS], env={**env, **extra}, capture_output=True, text=True, check=True, timeout=60
        )
        answer: dict[str, list[int]] = json.loads(out.stdout)
        return answer

    assert lists({}) == {"compute": [4242], "graphics": [4343], "compute_v2": [4242], "graphics_v2": [4343]}
    hidden = lists({"GPUSIM_OWN_PID_NAMESPACE": "1"})
    assert hidden == {"compute": [0], "graphics": [0], "compute_v2": [0], "graphics_v2": [0]}


# -- whole-GPU claims --------------------------------------------------------------------------------


@pytest.mark.parametrize("pid_namespace", ["host", "own"])
def test_after_an_agent_restart_a_whole_gpu_claim_whose_process_runs_is_kept(
    cluster: DRACluster, pid_namespace: str
) -> None:
    """The pod of a whole-GPU claim is force-deleted while the kubelet is down (its container goes on), the claim
    deleted, the agent restarted. The claim is kept while its container's process runs on its GPU, whether the agent
    sees host PIDs (hostPID) or NVML shows it PID 0 (the agent in a PID namespace of its own): a claim needing all of
    that GPU is not prepared meanwhile. Why it is kept is said once. It is freed once the process is gone, and the
    next claim is prepared then."""
    ref = make_claim(cluster, "whole", [whole("gpu-1")])
    prepared(cluster, ref)
    pod = bound_pod(cluster, "whole-pod", "whole")
    proc = tenant(cluster.base_env, 1)
    try:
        cgroup = cluster.cgroup_root / "kubepods" / f"pod{pod['metadata']['uid']}" / "c1"
        cgroup.mkdir(parents=True)
        (cgroup / "cgroup.procs").write_text(f"{proc.pid}\n")
        assert nvml_lists(cluster, proc.pid, 1)
        time.sleep(3)  # the agent's checks see the pod use the claim
        cluster.core.delete_namespaced_pod("whole-pod", "default", grace_period_seconds=0)
        delete_claim(cluster, "whole")
        assert cluster.agent is not None
        cluster.agent.stop()
        cluster.start_agent(env={"GPUSIM_OWN_PID_NAMESPACE": "1"} if pid_namespace == "own" else {})
        time.sleep(7)  # several checks past the two-period grace
        assert not spec_gone(cluster, ref[2]), "freed while a process of the container using its GPU runs"
        assert healthz(cluster)["claims"] == 1
        lines = kept_lines(cluster, ref[2])
        assert len(lines) == 1, lines  # said once while the reason stays
        assert "GPU 1" in lines[0], lines[0]
        if pid_namespace == "host":
            assert f"process {proc.pid}" in lines[0], lines[0]
        else:
            assert "no PID" in lines[0], lines[0]
        after = make_claim(cluster, "after", [whole("gpu-1")])
        assert cluster.kubelet is not None
        assert cluster.kubelet.prepare(DRIVER, [after])[after[2]]["error"] != "", "two tenants on one whole GPU"
    finally:
        end(proc)
    wait_for("the claim freed once its process is gone", lambda: spec_gone(cluster, ref[2]), timeout=30)
    prepared(cluster, after)


def test_a_multi_gpu_claim_is_kept_by_a_process_on_any_of_its_gpus(cluster: DRACluster) -> None:
    """A claim of two whole GPUs, deleted and never unprepared: a process on its second GPU keeps it."""
    ref = make_claim(cluster, "pair", [whole("gpu-0"), whole("gpu-2")])
    prepared(cluster, ref)
    proc = tenant(cluster.base_env, 2)
    try:
        delete_claim(cluster, "pair")
        time.sleep(6)
        assert not spec_gone(cluster, ref[2]) and healthz(cluster)["claims"] == 1
        assert any("GPU 2" in ln for ln in kept_lines(cluster, ref[2]))
    finally:
        end(proc)
    wait_for("the claim freed once its process is gone", lambda: spec_gone(cluster, ref[2]), timeout=30)


def test_processes_on_other_gpus_or_on_a_share_claims_gpu_keep_no_claim(cluster: DRACluster) -> None:
    """What must not keep a claim: a process on another GPU than a whole-GPU claim's, and a process on a share
    claim's GPU that its pids.config does not list (the GPU is shared: another claim's, or the host's). Both claims,
    deleted and never unprepared, are freed."""
    idle = make_claim(cluster, "idle", [whole("gpu-1")])
    shared = make_claim(cluster, "shared", [share("gpu-3", "50")])
    prepared(cluster, idle)
    prepared(cluster, shared)
    others = [tenant(cluster.base_env, 2), tenant(cluster.base_env, 3)]
    try:
        delete_claim(cluster, "idle")
        delete_claim(cluster, "shared")
        wait_for("the whole-GPU claim freed", lambda: spec_gone(cluster, idle[2]))
        wait_for("the share claim freed", lambda: spec_gone(cluster, shared[2]))
        assert kept_lines(cluster, idle[2]) == [] and kept_lines(cluster, shared[2]) == []
    finally:
        for proc in others:
            end(proc)


def test_a_whole_gpu_claim_is_kept_while_nvml_cannot_tell_what_runs_on_its_gpu(cluster: DRACluster) -> None:
    """NVML does not answer for the claim's GPU (stuck in a reset): whether a tenant still runs there cannot be
    told, so the claim is kept (said once), and freed once NVML answers that nothing runs there."""
    ref = make_claim(cluster, "stuck", [whole("gpu-1")])
    prepared(cluster, ref)
    assert cluster.agent is not None
    with GpuSimState(cluster.agent.state) as st:
        st.set_hung(1)
    try:
        delete_claim(cluster, "stuck")
        wait_for("the claim said kept", lambda: bool(kept_lines(cluster, ref[2])), timeout=30)
        time.sleep(3)
        assert not spec_gone(cluster, ref[2])
        lines = kept_lines(cluster, ref[2])
        assert len(lines) == 1 and "GPU 1" in lines[0] and "NVML" in lines[0], lines
    finally:
        with GpuSimState(cluster.agent.state) as st:
            st.set_hung(1, False)
    wait_for("the claim freed once NVML answers", lambda: spec_gone(cluster, ref[2]), timeout=30)


def test_a_lost_gpu_keeps_no_claim(cluster: DRACluster) -> None:
    """A lost GPU (fallen off the bus) runs nothing: its processes' contexts end with the reset or reboot that brings
    it back. A deleted whole-GPU claim on it is freed though NVML still listed a process there before."""
    ref = make_claim(cluster, "gone", [whole("gpu-1")])
    prepared(cluster, ref)
    proc = tenant(cluster.base_env, 1)
    assert cluster.agent is not None
    try:
        with GpuSimState(cluster.agent.state) as st:
            st.set_lost(1)
        delete_claim(cluster, "gone")
        wait_for("the claim on the lost GPU freed", lambda: spec_gone(cluster, ref[2]), timeout=30)
    finally:
        end(proc)
