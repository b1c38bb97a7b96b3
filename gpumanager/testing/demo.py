"""A short, narrated run of the agent on a simulated 8 x H100 node with a simulated kubelet.

``python -m gpumanager.testing.demo`` (or ``make demo``) shows: discovery and
the topology tree, registration of both resources, the devices the kubelet
sees, the GPUs the agent steers pods to, an XID error taking a GPU out of
service and the quiet period bringing it back, a kubelet restart survived in
process, and a clean stop.
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
from pathlib import Path

import grpc

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.testing.agent_process import SPEC_DIR, AgentProcess
from gpumanager.testing.gpusim_state import sim_env
from gpumanager.testing.kubelet import KubeletSimulator, PluginRPCError

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


def say(text: str = "") -> None:
    print(text, flush=True)


def gpu_of_core(device_id: str) -> int:
    return int(device_id.rsplit("-", 1)[1]) // 100


def health_line(kubelet: KubeletSimulator) -> str:
    devices = kubelet.devices(CORE)
    bad = sorted({gpu_of_core(i) for i, d in devices.items() if not d.healthy})
    healthy = sum(d.healthy for d in devices.values())
    return f"{healthy}/{len(devices)} vcuda-core devices healthy" + (f", GPUs out: {bad}" if bad else "")


def preferred_gpus(plugin_socket: Path, available: list[str], size: int) -> list[int]:
    with grpc.insecure_channel(f"unix://{plugin_socket}") as channel:
        reply = pb_grpc.DevicePluginStub(channel).GetPreferredAllocation(
            pb.PreferredAllocationRequest(
                container_requests=[
                    pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=size)
                ]
            ),
            timeout=5,
        )
    return sorted({gpu_of_core(i) for i in reply.container_responses[0].deviceIDs})


def run(workdir: Path, spec: Path) -> int:
    """Run the demo in ``workdir``; returns the agent's exit code."""
    say(f"== Simulated node: {spec.name}; work directory {workdir}")
    kubelet = KubeletSimulator(workdir / "device-plugins", fill="sorted")
    kubelet.start()
    agent = AgentProcess(workdir, spec, extra_args=["--health-quiet-period=3s", "--health-probe-period=200ms"])
    t0 = time.monotonic()
    agent.start()
    say(f"== Started gpu-manager (pid {agent.pid}); log: {agent.log_path}")
    try:
        for resource in (CORE, MEM):
            record = kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
            first = (record.first_list_and_watch_at or record.registered_at) - record.registered_at
            say(
                f"   registered {resource} on {record.endpoint} {record.version} "
                f"(pre_start_required={record.options.pre_start_required}, "
                f"get_preferred_allocation_available={record.options.get_preferred_allocation_available}); "
                f"{record.registered_at - t0:.2f} s after start, first device list {first * 1000:.1f} ms later"
            )
        cores = kubelet.wait_for_devices(CORE, lambda d: len(d) > 0)
        memory = kubelet.wait_for_devices(MEM, lambda d: len(d) > 0)
        say(f"== The kubelet sees {len(cores)} vcuda-core and {len(memory)} vcuda-memory devices (256 MiB each)")
        numa = Counter(d.numa_nodes for d in cores.values())
        for nodes, count in sorted(numa.items()):
            say(f"   NUMA {list(nodes)}: {count} vcuda-core devices")

        with urllib.request.urlopen(f"http://127.0.0.1:{agent.query_port}/graph", timeout=5) as resp:
            graph = json.loads(resp.read())["graph"]
        say("== Topology tree (GET /graph)")
        for line in graph.splitlines():
            say("   " + line)

        say("== Where the agent steers pods (GetPreferredAllocation, as the kubelet asks it)")
        plugin = agent.plugin_dir / names.VCORE_SOCKET
        free = sorted(cores, key=lambda i: int(i.rsplit("-", 1)[1]))
        for size, label in ((400, "4 whole GPUs"), (200, "2 whole GPUs"), (30, "a 30% share")):
            say(f"   {label:13s} ({size} vcuda-core) -> GPUs {preferred_gpus(plugin, free, size)}")
        busy = [i for i in free if gpu_of_core(i) != 1]
        say(f"   with GPU 1 busy, 2 whole GPUs -> GPUs {preferred_gpus(plugin, busy, 200)} (same socket, NVLink)")
        try:
            kubelet.allocate(CORE, 200, pod_uid="demo-pod", container_name="main")
        except PluginRPCError as exc:
            say(f"   Allocate -> {exc.code.name if exc.code else '?'}: {exc.details}")
            say("   (Allocate and PreStartContainer are not implemented yet in this version.)")

        say("== XID 79 (GPU fell off the bus) on GPU 5")
        subprocess.run(
            [sys.executable, "-m", "gpumanager.testing.gpusim", "xid", "--gpu", "5", "--xid", "79"],
            env=sim_env(agent.spec, agent.state),
            check=True,
        )
        t_xid = time.monotonic()
        kubelet.wait_for_devices(CORE, len(cores) - 100, timeout=10)
        say(f"   after {time.monotonic() - t_xid:.2f} s: {health_line(kubelet)}")
        kubelet.wait_for_devices(CORE, len(cores), timeout=30)
        say(f"   after {time.monotonic() - t_xid:.2f} s (3 s quiet period): {health_line(kubelet)}")

        say("== Kubelet restart (every socket in the device-plugin directory removed)")
        before = kubelet.registration_count(CORE)
        created = kubelet.restart()
        record = kubelet.wait_for_registration(CORE, after=before, timeout=10)
        kubelet.wait_for_devices(CORE, len(cores), timeout=10)
        say(
            f"   re-registered in {(record.registered_at - created) * 1000:.0f} ms, same process "
            f"(pid {agent.pid}); {health_line(kubelet)}"
        )
    finally:
        say("== SIGTERM")
        code = agent.stop()
        kubelet.stop()
    left = sorted(p.name for p in agent.plugin_dir.glob("*.sock"))
    say(f"   exit code {code}; sockets left in the device-plugin directory: {left or 'none'}")
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", type=Path, default=SPEC_DIR / "h100-nvlink-x8.json", help="node spec JSON")
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
