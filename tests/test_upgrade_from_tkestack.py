"""In-place upgrade from tkestack gpu-manager 1.1 on a node with running GPU pods.

The node (simnode.tkestack): the old agent's allocations in the kubelet and in its checkpoint,
its mirror as plain directories held by running containers, per-pod /etc/vcuda directories
with container-ID subdirectories and dead vcuda.sock files, its gpu-client in the old mirror.
Our agent must adopt every allocation, keep every file an old container uses, serve the old
pods' vcuda.sock, and free the pods (and then the old trees) when they end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.vmanager import files
from simnode.cluster import PodRun, SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import load_spec
from simnode.kubelet import PluginRPCError
from simnode.tkestack import ContainerProcess, OldAgent, legacy_vdriver
from tests.gpu_client_fixtures import client_built
from tests.test_agent_volume import volume_conf
from tests.volume_fixtures import LIB64, V1, DriverStore, driver_store, install_driver

__all__ = ["client_built", "driver_store"]

CORE = names.VCORE_RESOURCE
SPEC = "v100-pcie-x4"


def cid(run: PodRun, container: str) -> str:
    return f"{run.uid[:8]}{container}".replace("-", "")


@dataclass
class OldNode:
    cluster: SimCluster
    base: Path
    proc: Path
    old: OldAgent
    runs: dict[str, PodRun] = field(default_factory=dict)
    holders: dict[tuple[str, str], ContainerProcess] = field(default_factory=dict)
    volumes: dict[tuple[str, str], str] = field(default_factory=dict)  # what each container mounted
    before: dict[Path, tuple[int, int, bytes]] = field(default_factory=dict)

    def container_dir(self, pod: str, container: str) -> Path:
        run = self.runs[pod]
        return self.cluster.vm_path / run.uid / cid(run, container)

    def end_pod(self, pod: str) -> None:
        """The pod ends: its containers stop, the API server and the kubelet forget it."""
        run = self.runs.pop(pod)
        for key in [k for k in self.holders if k[0] == pod]:
            self.holders.pop(key).end()
        self.cluster.delete(run)

    def restart_agent(self) -> None:
        assert self.cluster.agent is not None
        assert self.cluster.agent.stop() == 0
        self.cluster.start_agent()

    def checkpoint(self) -> dict[str, dict[str, dict[str, object]]]:
        data = json.loads((self.cluster.checkpoint_dir / names.OWN_CHECKPOINT).read_text())
        return data["PodGPUMapping"]  # type: ignore[no-any-return]


def identity(path: Path) -> tuple[int, int, bytes]:
    st = path.stat()
    return (st.st_ino, st.st_mtime_ns, path.read_bytes())


@pytest.fixture
def old_node(tmp_path: Path, sim_built: Path, client_built: Path, driver_store: DriverStore) -> Iterator[OldNode]:
    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    base = tmp_path / "vdriver"
    proc = tmp_path / "proc"  # what the agent sees of the node's processes: the old containers' only
    proc.mkdir()
    flags = [
        f"--volume-config={volume_conf(tmp_path)}",
        f"--driver-root={root}",
        f"--vcuda-library={driver_store.interceptor(0)}",
        f"--gpu-client={client_built}",
        f"--proc-root={proc}",
    ]
    cluster = SimCluster(tmp_path / "node", SPEC, agent_flags=flags)
    cluster.start(agent=False)
    old = OldAgent(
        load_spec(cluster.spec),
        plugin_dir=cluster.kubelet.plugin_dir,
        vm_path=cluster.vm_path,
        vdriver_base=base,
        checkpoint_dir=cluster.checkpoint_dir,
    )
    node = OldNode(cluster, base, proc, old)
    try:
        legacy_vdriver(
            base,
            driver_files={
                f"libcuda.so.{V1}": root / LIB64.lstrip("/") / f"libcuda.so.{V1}",
                f"libnvidia-ml.so.{V1}": root / LIB64.lstrip("/") / f"libnvidia-ml.so.{V1}",
            },
            interceptor=driver_store.interceptor(1),  # the old agent's libcuda-control.so
            gpu_client=client_built,  # standing in for its Go gpu-client
            driver=V1,
        )
        old.start(cluster.kubelet.socket_path)
        for resource in (CORE, names.VMEMORY_RESOURCE):
            cluster.kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
        # (pod, [(container, cores, blocks, GPU minor)]): a share, a whole GPU, two shares of one GPU.
        pods = {
            "share": [("main", 30, 8, 1)],
            "whole": [("main", 100, 0, 0)],
            "pair": [("a", 40, 4, 1), ("b", 20, 4, 2)],
        }
        for pod, containers in pods.items():
            manifest = gpu_pod(pod, [(c, cores, blocks) for c, cores, blocks, _ in containers])
            manifest["metadata"]["annotations"] = {
                **admission_annotations([[g] for *_, g in containers], 1000),
                names.GPU_ASSIGNED: "true",
            }
            created = cluster.create(manifest)
            for container, cores, blocks, gpu in containers:
                old.place(str(created["metadata"]["uid"]), container, [gpu], cores, blocks)
            run = cluster.admit(created, create=False)
            cluster.start_containers(run)
            node.runs[pod] = run
            for container, cores, _, _ in containers:
                volume = "nvidia" if cores < 100 else "origin"
                holder = ContainerProcess(base / volume)
                node.holders[(pod, container)] = holder
                node.volumes[(pod, container)] = volume
                (node.proc / str(holder.pid)).symlink_to(f"/proc/{holder.pid}")
                cgroup = cluster.cgroup_root / "kubepods" / f"pod{run.uid}" / cid(run, container)
                (cgroup / "cgroup.procs").write_text(f"{holder.pid}\n")
                if cores < 100:  # the old library registered this container
                    alloc = next(a for a in old.allocations if (a.pod_uid, a.container) == (run.uid, container))
                    old.registered(alloc, cid(run, container), [holder.pid], driver=V1)
        old.stop()
        for path in sorted(p for p in base.rglob("*") if p.is_file() and not p.is_symlink()):
            node.before[path.relative_to(base)] = identity(path)
        for pod, run in node.runs.items():
            for container in run.core:
                config = node.container_dir(pod, container) / names.VCUDA_CONFIG_FILE
                if config.exists():
                    node.before[config] = identity(config)
        cluster.start_agent()
        yield node
    finally:
        for holder in node.holders.values():
            holder.end()
        cluster.stop()


def eventually(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def legacy_trees(node: OldNode) -> dict[str, Path]:
    return {p.name.split("-legacy-")[0]: p for p in (node.base / ".trees").iterdir() if "-legacy-" in p.name}


def test_upgrade_keeps_every_allocation_file_and_socket(old_node: OldNode, tmp_path: Path) -> None:
    node, cluster = old_node, old_node.cluster
    # Every allocation adopted, as upstream recorded it.
    expected: dict[str, dict[str, object]] = {a.pod_uid: {} for a in node.old.allocations}
    for a in node.old.allocations:
        expected[a.pod_uid][a.container] = a.checkpoint_entry()
    adopted = {
        uid: {c: {k: e[k] for k in ("Devices", "Cores", "Memory")} for c, e in cs.items()}
        for uid, cs in node.checkpoint().items()
    }
    assert adopted == expected

    # The old mirror: moved aside, not a byte or an inode changed; the stable paths name new trees.
    legacy = legacy_trees(node)
    assert sorted(legacy) == ["nvidia", "origin"]
    for rel, before in node.before.items():
        if rel.is_absolute():
            continue
        volume, rest = rel.parts[0], Path(*rel.parts[1:])
        assert identity(legacy[volume] / rest) == before, rel
    assert (node.base / "nvidia").is_symlink() and (node.base / "origin").is_symlink()
    for key, holder in node.holders.items():
        assert holder.mount.resolve() == legacy[node.volumes[key]], key

    # The old pods' vcuda.sock: served again; the old library in an old container registers
    # through the old mirror's gpu-client; its vcuda.config is left as it was, pids.config is current.
    share = node.runs["share"]
    holder = node.holders[("share", "main")]
    cgroup_file = tmp_path / "cgroup"
    cgroup_file.write_text(f"9:memory:/kubepods/pod{share.uid}/{cid(share, 'main')}\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "simnode.upstream_library",
            f"--cgroup-file={cgroup_file}",
            f"--nvidia-root={holder.mount}",
            f"--vcuda-root={cluster.vm_path / share.uid}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert (seen["container_name"], seen["utilization"], seen["pids"]) == ("main", 30, [holder.pid])
    for path, before in node.before.items():
        if path.is_absolute():
            assert identity(path) == before, path  # vcuda.config of old containers: never rewritten

    # A container of an old pod restarts: the kubelet's PreStart finds the adopted allocation
    # (recorded without device IDs) and the new container gets its own vcuda.config beside the old, where
    # upstream's answer, which the kubelet keeps, mounts it: in the pod's directory (it mounts no other).
    pair = node.runs["pair"]
    assert cluster.kubelet.pre_start(CORE, pod_uid=pair.uid, container_name="a")
    restarted = files.unpack((cluster.vm_path / pair.uid / "a" / names.VCUDA_CONFIG_FILE).read_bytes())
    assert (restarted.container_name, restarted.utilization, restarted.gpu_memory) == ("a", 40, 4 << 28)
    assert (
        identity(node.container_dir("pair", "a") / names.VCUDA_CONFIG_FILE)
        == node.before[node.container_dir("pair", "a") / names.VCUDA_CONFIG_FILE]
    )

    # New pods see what the old ones hold: GPU 0 whole, GPU 1 at 70 cores, GPU 2 at 20.
    whole = cluster.run_pod(gpu_pod("new-whole", [("main", 100, 0)]))
    assert whole.core["main"].response.annotations[names.VDEVICE_ANNOTATION] == "/dev/nvidia3"
    # The scheduler's GPU is honoured or the request refused (RESOURCE_EXHAUSTED), never placed elsewhere.
    with pytest.raises(PluginRPCError, match=r"RESOURCE_EXHAUSTED .*predicated GPU 1 cannot hold 50 cores .* 30 cores"):
        cluster.admit(gpu_pod("on-gpu1", [("main", 50, 4)], annotations=admission_annotations([[1]], 2000)))
    share_new = cluster.run_pod(gpu_pod("new-share", [("main", 45, 4)]))
    assert share_new.core["main"].response.annotations[names.VDEVICE_ANNOTATION] == "/dev/nvidia2"
    mounts = {m.container_path: m.host_path for m in share_new.core["main"].response.mounts}
    assert Path(mounts["/usr/local/nvidia"]).resolve() != legacy["nvidia"]
    assert (Path(mounts["/usr/local/nvidia"]) / "bin" / "gpu-client").read_bytes() == (
        legacy["nvidia"] / "bin" / "gpu-client"
    ).read_bytes()


def test_old_pods_are_freed_when_they_end_and_old_trees_when_unused(old_node: OldNode) -> None:
    node, cluster = old_node, old_node.cluster
    share_uid = node.runs["share"].uid
    pair_dir = cluster.vm_path / node.runs["pair"].uid
    node.end_pod("share")
    eventually(
        lambda: share_uid not in node.checkpoint() and not (cluster.vm_path / share_uid).exists(),
        "the ended pod was not freed",
    )
    assert pair_dir.is_dir() and (pair_dir / names.VCUDA_SOCKET).exists()  # still running: kept
    # GPU 1 has room again for what the ended pod held.
    again = cluster.run_pod(gpu_pod("after", [("main", 60, 4)], annotations=admission_annotations([[1]], 3000)))
    assert again.core["main"].response.annotations[names.VDEVICE_ANNOTATION] == "/dev/nvidia1"

    # The old nvidia tree is still held by the "pair" containers: a new check keeps it.
    node.restart_agent()
    assert sorted(legacy_trees(node)) == ["nvidia", "origin"]
    node.end_pod("pair")
    node.end_pod("whole")
    node.restart_agent()
    eventually(lambda: legacy_trees(node) == {}, "old trees no longer used are removed")
    eventually(lambda: sorted(node.checkpoint()) == [again.uid], "ended pods are freed")
    eventually(
        lambda: (
            sorted(os.listdir(cluster.vm_path)) == sorted([again.uid, names.VCUDA_CONFIGS_DIR])
            and os.listdir(cluster.vm_path / names.VCUDA_CONFIGS_DIR) == [again.uid]
        ),
        "ended pods' directories are removed",
    )
