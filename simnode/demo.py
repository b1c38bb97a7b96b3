"""A short, narrated run of the agent on a simulated 8 x H100 node, with a simulated kubelet and API server.

``python -m simnode.demo`` (or ``make demo``) shows: discovery and
the topology tree, registration of both resources, pods being allocated (a
share placed by gpu-admission's annotation, whole GPUs chosen by the topology
evaluators), their limit files and annotations, an XID error taking a GPU out
of service and the quiet period bringing it back, a kubelet restart and an
agent restart survived with every allocation kept, a finished pod released,
and a clean stop.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any

from gpumanager import names
from gpumanager.allocation.journal import read_document
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import repo_root, sim_env, spec_dir
from simnode.mounts import host_path
from simnode.simhost import install_sim_driver, volume_conf

CORE = names.VCORE_RESOURCE
MEMORY = names.VMEMORY_RESOURCE
MEM = names.VMEMORY_RESOURCE


def say(text: str = "") -> None:
    print(text, flush=True)


def gpu_of_core(device_id: str) -> int:
    return int(device_id.rsplit("-", 1)[1]) // 100


def health_line(c: SimCluster) -> str:
    devices = c.kubelet.devices(CORE)
    bad = sorted({gpu_of_core(i) for i, d in devices.items() if not d.healthy})
    healthy = sum(d.healthy for d in devices.values())
    return f"{healthy}/{len(devices)} vcuda-core devices healthy" + (f", GPUs out: {bad}" if bad else "")


def http_json(c: SimCluster, path: str) -> dict[str, object]:
    assert c.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}{path}", timeout=5) as resp:
        return dict(json.loads(resp.read()))


def checkpoint(c: SimCluster) -> dict[str, dict[str, dict[str, object]]]:
    return (read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {})["PodGPUMapping"]  # type: ignore[no-any-return]


CLIENT = r"""
import json, os, pynvml
from cuda.bindings import driver as d
R = d.CUresult
assert d.cuInit(0)[0] == R.CUDA_SUCCESS
ctx = d.cuDevicePrimaryCtxRetain(d.cuDeviceGet(0)[1])[1]
d.cuCtxSetCurrent(ctx)
total, ptrs = 0, []
while True:
    err, ptr = d.cuMemAlloc(256 << 20)
    if err != R.CUDA_SUCCESS:
        break
    ptrs.append(ptr)
    total += 256 << 20
free, cap = d.cuMemGetInfo()[1:]
pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
nvml = pynvml.nvmlDeviceGetMemoryInfo(handle).total
held = sum(p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == os.getpid())
print(json.dumps({"err": err.name, "total": total, "cap": cap, "nvml": nvml, "held": held}))
"""


def capped_client(c: SimCluster, run: PodRun) -> str:
    """Run a CUDA program as the pod's container would: the mirror's interceptor and the pod's config."""
    resp = run.core["jupyter"].response
    mounts = {m.container_path: m.host_path for m in resp.mounts}
    assert c.agent is not None
    env = sim_env(c.spec, c.agent.state)
    env["LD_LIBRARY_PATH"] = str(Path(mounts["/usr/local/nvidia"]) / "lib64")
    env["VCUDA_CONFIG_PATH"] = str(host_path(resp.mounts, resp.envs["VCUDA_CONFIG_PATH"]))
    env["VCUDA_BUDGET_DIR"] = str(c.workdir / "shm")
    done = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return f"failed: {done.stderr.strip()[-300:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return (
        f"allocated {out['total'] >> 20} MiB, then {out['err']}: with its CUDA context the GPU holds "
        f"{out['held'] >> 20} MiB for it, within the pod's {out['cap'] >> 20} MiB (cuMemGetInfo total "
        f"{out['cap'] >> 20} MiB, NVML total {out['nvml'] >> 20} MiB)"
    )


def vcuda_config_file(resp: Any) -> Path:
    """Where the host holds the vcuda.config an Allocate answer gives its container: the file its
    VCUDA_CONFIG_PATH names, under the mount that puts it there (the container's own directory)."""
    in_container = PurePosixPath(resp.envs["VCUDA_CONFIG_PATH"])
    for mount in resp.mounts:
        if in_container.parent == PurePosixPath(mount.container_path):
            return Path(mount.host_path) / in_container.name
    raise RuntimeError(f"no mount of the answer holds {in_container}")


def run(workdir: Path, spec: Path) -> int:
    """Run the demo in ``workdir``; returns the agent's exit code."""
    say(f"== Simulated node: {spec.name}; work directory {workdir}")
    install_sim_driver(workdir / "host")
    flags = [
        "--health-quiet-period=3s",
        "--health-probe-period=200ms",
        f"--volume-config={volume_conf(workdir / 'vdriver', workdir / 'volume.conf')}",
        f"--driver-root={workdir / 'host'}",
        f"--vcuda-library={repo_root() / 'vcuda' / 'build' / 'libcuda-control.so'}",
    ]
    c = SimCluster(workdir / "node", spec, agent_flags=flags)
    t0 = time.monotonic()
    c.start()
    assert c.agent is not None
    say(f"== gpu-manager running (pid {c.agent.pid}); log: {c.agent.log_path}")
    code = 1
    try:
        for resource in (CORE, MEM):
            record = c.kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
            say(
                f"   registered {resource} on {record.endpoint} ({record.version}, PreStart and "
                f"GetPreferredAllocation on) {record.registered_at - t0:.2f} s after start"
            )
        cores = c.kubelet.devices(CORE)
        say(f"== The kubelet sees {len(cores)} vcuda-core and {len(c.kubelet.devices(MEM))} vcuda-memory devices")
        for nodes, count in sorted(Counter(d.numa_nodes for d in cores.values()).items()):
            say(f"   NUMA {list(nodes)}: {count} vcuda-core devices")
        say("== Topology tree (GET /graph)")
        for line in str(http_json(c, "/graph")["graph"]).splitlines():
            say("   " + line)

        say("== Pods")
        share = c.run_pod(gpu_pod("notebook", [("jupyter", 30, 16)], annotations=admission_annotations([[6]], 1_000)))
        resp = share.core["jupyter"].response
        say(
            f"   notebook (30 cores, 4 GiB; gpu-admission chose GPU 6): {resp.annotations[names.VDEVICE_ANNOTATION]}, "
            f"mounts {resp.mounts[0].host_path} at /usr/local/nvidia"
        )
        cfg = files.unpack(vcuda_config_file(resp).read_bytes())
        say(
            f"   its vcuda.config: gpu_memory={cfg.gpu_memory >> 20} MiB utilization={cfg.utilization} "
            f"enable={cfg.enable}; env VCUDA_CONFIG_PATH={resp.envs['VCUDA_CONFIG_PATH']}"
        )
        train = c.run_pod(gpu_pod("trainer", [("worker", 400, 0)]))
        say(f"   trainer (4 whole GPUs): {train.core['worker'].response.annotations[names.VDEVICE_ANNOTATION]}")
        pair = c.run_pod(gpu_pod("finetune", [("worker", 200, 0)]))
        say(
            f"   finetune (2 whole GPUs): {pair.core['worker'].response.annotations[names.VDEVICE_ANNOTATION]} "
            "(same NVLink group, the partly used one)"
        )
        say(f"   a CUDA program in the notebook (cuda-bindings, loading the mirror): {capped_client(c, share)}")
        annotations = c.wait_annotations(share, {names.GPU_ASSIGNED: "true"})
        idx_key = names.PREDICATE_GPU_IDX_PREFIX + "0"
        say(
            f"   notebook annotations: {idx_key}={annotations[idx_key]}, "
            f"{names.GPU_ASSIGNED}={annotations[names.GPU_ASSIGNED]}"
        )
        try:
            c.admit(gpu_pod("toobig", [("x", 300, 0)]))
        except Exception as exc:
            say(f"   toobig (3 whole GPUs, only 1 free) is not admitted: {exc}")

        say("== XID 79 (GPU fell off the bus) on GPU 7")
        subprocess.run(
            [sys.executable, "-m", "simnode.gpusim", "xid", "--gpu", "7", "--xid", "79"],
            env=sim_env(c.agent.spec, c.agent.state),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        t_xid = time.monotonic()
        c.kubelet.wait_for_devices(CORE, lambda d: sum(x.healthy for x in d.values()) == len(cores) - 100, timeout=10)
        say(f"   after {time.monotonic() - t_xid:.2f} s: {health_line(c)}")
        c.kubelet.wait_for_devices(CORE, lambda d: all(x.healthy for x in d.values()), timeout=30)
        say(f"   after {time.monotonic() - t_xid:.2f} s (3 s quiet period): {health_line(c)}")

        say("== Kubelet restart (every socket in the device-plugin directory removed)")
        created = c.kubelet.restart()
        records = [
            c.kubelet.wait_for_registration(resource, since=created, timeout=10, with_devices=True)
            for resource in (CORE, MEMORY)
        ]
        took = (max(r.registered_at for r in records) - created) * 1000
        say(f"   both resources re-registered in {took:.0f} ms, same process (pid {c.agent.pid})")

        say("== Agent restart")
        kept = checkpoint(c)
        c.agent.stop()
        c.start_agent()
        same = checkpoint(c) == kept
        say(f"   new pid {c.agent.pid}; {len(kept)} pods' allocations recovered from the checkpoint: {same}")

        say("== The trainer finishes")
        c.delete(train)
        deadline = time.monotonic() + 10
        while train.uid in checkpoint(c) and time.monotonic() < deadline:
            time.sleep(0.1)
        free = [line for line in str(http_json(c, "/graph")["graph"]).splitlines() if "allocatableCores: 100" in line]
        say(f"   released: {train.uid not in checkpoint(c)}; GPUs entirely free again: {len(free)}")
    finally:
        say("== SIGTERM")
        code = c.agent.stop() if c.agent is not None else 1
        c.stop()
    left = sorted(p.name for p in (workdir / "node" / "device-plugins").glob("*.sock"))
    say(f"   exit code {code}; sockets left in the device-plugin directory: {left or 'none'}")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", type=Path, default=spec_dir() / "h100-nvlink-x8.json", help="node spec JSON")
    parser.add_argument("--workdir", type=Path, default=None, help="keep files here (default: a temp dir)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return run(args.workdir, args.spec)
    with tempfile.TemporaryDirectory(prefix="gpu-manager-demo-") as tmp:
        return run(Path(tmp), args.spec)


if __name__ == "__main__":
    sys.exit(main())
