"""DRA mode end to end on the simulated node: the agent (``--mode=dra``) with the API-server simulator,
the claim controller and scheduler stand-ins and the kubelet DRA stand-in, through real gRPC and the
real kubernetes client."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager.vmanager import files
from simnode.dra_cluster import DRIVER, NODE, DRACluster, claim_pod, claim_template
from simnode.gpusim_state import GpuSimState, repo_root
from simnode.simhost import install_sim_driver, volume_conf
from tests.make_lock import run_make
from tests.vcuda_fixtures import PRELUDE

GiB = 1 << 30


@pytest.fixture
def t4(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        yield cluster


def http_json(cluster: DRACluster, path: str) -> Any:
    assert cluster.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}{path}", timeout=5) as resp:
        return json.loads(resp.read())


def test_slice_publishes_each_gpu_once_with_consumable_capacity(t4: DRACluster) -> None:
    s = t4.slice()
    assert s is not None
    spec = s["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE and spec["pool"]["name"] == NODE
    [dev] = spec["devices"]
    assert dev["name"] == "gpu-0" and dev["allowMultipleAllocations"] is True
    cores = dev["capacity"]["cores"]
    assert cores["value"] == "100" and cores["requestPolicy"]["validRange"] == {"min": "1", "max": "100", "step": "1"}
    memory = dev["capacity"]["memory"]
    assert memory["value"] == "15Gi"  # 15360 MiB, canonical form
    assert memory["requestPolicy"]["validRange"]["step"] == "256Mi"
    attrs = dev["attributes"]
    assert attrs["productName"] == {"string": "Tesla T4"} and attrs["index"] == {"int": 0}
    assert attrs["uuid"]["string"].startswith("GPU-")
    assert "resource.kubernetes.io/numaNode" in attrs


def test_shares_fill_one_gpu_and_a_third_waits_until_one_ends(t4: DRACluster) -> None:
    t4.add_template(claim_template("c30", cores=30, memory="4Gi"))
    t4.add_template(claim_template("c60", cores=60, memory="8Gi"))
    t4.add_template(claim_template("c20", cores=20, memory="1Gi"))
    t4.create_pod(claim_pod("p30", "c30"))
    t4.create_pod(claim_pod("p60", "c60"))
    t4.settle()
    t4.create_pod(claim_pod("p20", "c20"))
    t4.settle()
    assert t4.pod("p30")["status"]["phase"] == "Running"
    assert t4.pod("p60")["status"]["phase"] == "Running"
    assert not t4.pod("p20")["spec"].get("nodeName"), "20 more cores do not fit next to 30 + 60"
    assert t4.scheduler is not None and "cannot allocate" in t4.scheduler.pending["default/p20"]

    claim30 = t4.claim_of("p30")
    [result] = claim30["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0" and result["consumedCapacity"] == {"cores": "30", "memory": "4Gi"}
    config = files.unpack((t4.vm_path / claim30["metadata"]["uid"] / "vcuda.config").read_bytes())
    assert (config.gpu_memory, config.utilization, config.enable) == (4 * GiB, 30, 1)
    spec_file = t4.cdi_root / f"{DRIVER}-{claim30['metadata']['uid']}.json"
    spec = json.loads(spec_file.read_text())
    assert spec["kind"] == f"{DRIVER}/gpu"
    env = dict(e.split("=", 1) for e in spec["containerEdits"]["env"])
    assert env["VCUDA_CONFIG_PATH"] == "/etc/vcuda/vcuda.config"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    mounts = {m["containerPath"]: m for m in spec["containerEdits"]["mounts"]}
    assert mounts["/etc/vcuda"]["hostPath"] == str(t4.vm_path / claim30["metadata"]["uid"])
    assert "ro" in mounts["/usr/local/nvidia"]["options"] and "bind" in mounts["/usr/local/nvidia"]["options"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"][0]["path"] == "/dev/nvidia0"

    health = http_json(t4, "/healthz")
    assert health["mode"] == "dra" and health["claims"] == 2 and health["registered"] is True
    assert http_json(t4, "/readyz")["slice_published"] is True
    # One view of the node: the tree's free capacity, /usage, the metrics.
    assert t4.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{t4.agent.query_port}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    lines = metrics.splitlines()
    assert any(
        ln.startswith('gpu_manager_gpu_core_allocated_ratio{gpu="0",uuid="') and ln.endswith("} 0.9") for ln in lines
    )
    name30, uid30 = claim30["metadata"]["name"], claim30["metadata"]["uid"]
    uuid0 = json.loads(t4.spec.read_text())["gpus"][0]["uuid"]
    claim_line = (
        f'gpu_manager_claim_gpu_core_ratio{{claim="{name30}",claim_uid="{uid30}",gpu="0",namespace="default",'
        f'share="true",uuid="{uuid0}"}} 0.3'
    )
    assert claim_line in metrics
    users = f'gpu_manager_claim_containers{{claim="{name30}",claim_uid="{uid30}",namespace="default",pod="p30"}} 1.0'
    assert users in metrics
    assert any(
        ln.startswith(
            'gpu_manager_container_gpu_core_limit_ratio{namespace="default",pod="p30",container="main",gpu="0",'
        )
        and ln.endswith("} 0.3")
        for ln in lines
    )
    usage = http_json(t4, "/usage")["usage"]
    p30_uid = t4.pod("p30")["metadata"]["uid"]
    assert usage[p30_uid]["spec"]["main"] == {"gpu": 0.3, "mem": 4096.0}
    assert usage[p30_uid]["stat"]["main"]["dev"][0]["card_idx"] == "0"
    graph = http_json(t4, "/graph")["graph"]
    assert "allocatableCores: 10, allocatableMemory: 3221225472" in graph  # 15 GiB - 4 GiB - 8 GiB

    t4.end_pod("p60")
    t4.settle()
    assert t4.pod("p20")["spec"].get("nodeName") == NODE
    assert t4.pod("p20")["status"]["phase"] == "Running"
    # p60's claim is unprepared: its CDI spec and directory are gone, p20's are there.
    uid20 = t4.claim_of("p20")["metadata"]["uid"]
    specs = sorted(p.name for p in t4.cdi_root.iterdir())
    assert len(specs) == 2 and f"{DRIVER}-{uid20}.json" in specs
    assert len([d for d in t4.vm_path.iterdir() if d.is_dir()]) == 2


MIB = 1 << 20
CLIENT = (
    PRELUDE
    + r"""
import pynvml
total = 0
while True:
    err, ptr = d.cuMemAlloc(128 << 20)
    if err != R.CUDA_SUCCESS:
        break
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


def test_status_lags_the_start_and_a_deleted_pod_is_finished_by_the_node(t4: DRACluster) -> None:
    t4.status_lag = 30.0  # the containers' status update is far away
    t4.add_template(claim_template("c40", cores=40, memory="2Gi"))
    events = t4.api.pod_events()
    pod = t4.create_pod(claim_pod("p", "c40"))
    uid = pod["metadata"]["uid"]
    t4.settle(wait_writes=False)
    assert t4.kubelet is not None and (uid, "main") in t4.kubelet.containers  # started
    assert t4.pod("p")["status"]["phase"] == "Pending" and not t4.pod("p")["status"].get("containerStatuses")
    claim = t4.claim_of("p")["metadata"]["uid"]
    assert claim in t4.kubelet.claims
    t4.core.delete_namespaced_pod("p", "default")  # graceful: the node stops it, then deletes it
    t4.settle()
    assert not any(k[0] == uid for k in t4.kubelet.containers) and claim not in t4.kubelet.claims
    t4.api.close_pod_events(events)
    phases = []
    while not events.empty():
        kind, seen = events.get_nowait()
        if seen["metadata"]["uid"] == uid:
            states = [next(iter(cs["state"])) for cs in seen["status"].get("containerStatuses") or []]
            phases.append((kind, seen["status"]["phase"], states))
    # Never Running: the containers had stopped before their status update was due.
    assert ("MODIFIED", "Succeeded", ["terminated"]) in phases and phases[-1][0] == "DELETED", phases
    assert all(phase != "Running" for _, phase, _ in phases), phases


@pytest.fixture
def t4_mirror(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    """A T4 node in DRA mode whose driver mirror holds the interceptor."""
    interceptor = repo_root() / "vcuda/build/libcuda-control.so"
    assert interceptor.exists(), "make -C vcuda builds the interceptor"
    root = tmp_path / "host"
    install_sim_driver(root)
    flags = [
        f"--volume-config={volume_conf(tmp_path / 'vdriver', tmp_path / 'volume.conf')}",
        f"--driver-root={root}",
        f"--vcuda-library={interceptor}",
    ]
    with DRACluster(tmp_path / "node", "t4-x1", agent_flags=flags) as cluster:
        cluster.base_env["VCUDA_BUDGET_DIR"] = str(tmp_path / "shm")
        yield cluster


def test_cuda_program_started_through_the_cdi_edits_is_held_to_its_claim(t4_mirror: DRACluster) -> None:
    c = t4_mirror
    c.add_template(claim_template("c30", cores=30, memory="4Gi"))
    pod = c.create_pod(claim_pod("cuda", "c30"), commands={"main": [sys.executable, "-c", CLIENT]})
    c.settle()
    assert c.kubelet is not None
    run = c.kubelet.containers[(pod["metadata"]["uid"], "main")]
    assert (
        run.mounts["/usr/local/nvidia"].endswith("nvidia") and run.env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    )
    assert run.proc is not None
    out, err = run.proc.communicate(timeout=120)
    assert run.proc.returncode == 0, err.decode()
    result = json.loads(out.decode().strip().splitlines()[-1])
    cap = 4 * GiB
    assert result["error"] == "CUDA_ERROR_OUT_OF_MEMORY"
    # The cap holds for what the GPU holds for the process: its allocations and its context.
    assert cap - 128 * MIB < result["held"] <= cap and result["held"] > result["allocated"]
    assert result["total"] == cap and result["free"] == cap - result["held"]
    assert result["nvml_total"] == cap


def test_sm_limit_of_a_30_core_claim_holds(t4_mirror: DRACluster) -> None:
    done = run_make(
        ["make", "-s", "-C", str(repo_root() / "vcuda"), "bench", f"PYTHON={sys.executable}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    loop = repo_root() / "vcuda/build/bench/launch_loop"
    c = t4_mirror
    c.add_template(claim_template("c30", cores=30, memory="2Gi"))
    pod = c.create_pod(
        claim_pod("spin", "c30"), commands={"main": [str(loop), "kernel", "spin_1ms", "9.0", "64", "256", "0"]}
    )
    c.settle()
    assert c.kubelet is not None and c.agent is not None
    run = c.kubelet.containers[(pod["metadata"]["uid"], "main")]
    assert run.proc is not None
    claim_dir = c.vm_path / c.claim_of("spin")["metadata"]["uid"]
    # The agent writes the container's processes (from its cgroup) into the claim's pids.config, once the
    # pod's status names the container (it may write the file empty before).
    deadline = time.monotonic() + 10
    pids = claim_dir / "pids.config"
    while time.monotonic() < deadline and not (pids.exists() and files.read_pids(pids)):
        time.sleep(0.1)
    assert files.read_pids(pids) == [run.proc.pid]
    time.sleep(2.0)
    with GpuSimState(c.agent.state) as st:
        before = st.timeline(0)
        time.sleep(2.0)
        after = st.timeline(0)
    _out, err = run.proc.communicate(timeout=60)
    assert run.proc.returncode == 0, err.decode()
    assert before is not None and after is not None
    share = 100.0 * (after.busy_of({run.proc.pid}) - before.busy_of({run.proc.pid})) / (after.now_ns - before.now_ns)
    assert 15.0 <= share <= 42.0, f"a 30-core claim used {share:.1f}% of the GPU"
