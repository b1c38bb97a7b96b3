"""pids.config of a container that restarted, before its pod's status names the new container ID.

A restarted container has a new ID and a new cgroup; the kubelet's status update naming the new ID
reaches the API server a second or two later. Until then the status names the old ID, whose cgroup is
gone: the refresh must find the new cgroup below the pod's (a container directory no status names,
which was not there before), and only where no other container of the pod can own it. The pod's
sandbox (the pause container) has a cgroup there too, which no status names either.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.vmanager import files
from gpumanager.vmanager.manager import RegistrationRefused, VirtualManager
from simnode.cgroup_files import V1_MEMORY_FILES, V2_FILES, make_cgroup
from simnode.cluster import SimCluster, gpu_pod
from simnode.dra_cluster import DRACluster
from tests.gpu_client_fixtures import client_built
from tests.test_dra_followups_review11 import bound_pod, prepared, share, wait_for
from tests.test_dra_review11 import make_claim
from tests.test_vcuda_registration import gpu_client

__all__ = ["client_built"]

UID = "7d1c2b3a-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
SANDBOX = "5a" * 32


def cid(tag: str) -> str:
    """A 64-hex container ID."""
    return (tag.encode().hex() * 64)[:64]


@dataclass(frozen=True)
class Layout:
    """Where a runtime and a cgroup driver put a pod's and its containers' cgroups."""

    name: str
    qos: str
    v1: bool
    systemd: bool
    prefix: str  # "" for the bare ID (cgroupfs containerd and docker)

    def pod_dirs(self, root: Path) -> list[Path]:
        q = "" if self.qos == "Guaranteed" else self.qos.lower()
        if self.systemd:
            under = UID.replace("-", "_")
            qos_slice = f"/kubepods-{q}.slice" if q else ""
            rel = f"kubepods.slice{qos_slice}/kubepods{'-' + q if q else ''}-pod{under}.slice"
        else:
            rel = "kubepods" + (f"/{q}" if q else "") + f"/pod{UID}"
        tops = [root / "memory", root / "pids"] if self.v1 else [root]
        return [top / rel for top in tops]

    def dir_name(self, container_id: str) -> str:
        if not self.prefix:
            return container_id
        return f"{self.prefix}-{container_id}" + (".scope" if self.systemd else "")


LAYOUTS = [
    Layout("containerd-cgroupfs-v2", "Guaranteed", False, False, ""),
    Layout("containerd-systemd-v2", "Burstable", False, True, "cri-containerd"),
    Layout("crio-systemd-v2", "Guaranteed", False, True, "crio"),
    Layout("crio-cgroupfs-v1", "Burstable", True, False, "crio"),
    Layout("docker-systemd-v1", "BestEffort", True, True, "docker"),
    Layout("docker-cgroupfs-v1", "Guaranteed", True, False, ""),
]


@dataclass
class Node:
    """A pod with GPU containers ``main`` and ``aux`` and a container ``side`` without a GPU."""

    layout: Layout
    root: Path
    vm_path: Path
    ids: dict[str, str] = field(default_factory=dict)  # container -> the ID the status names
    running: dict[str, str] = field(default_factory=dict)  # container -> the ID of its cgroup
    extra_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    spec_extra: dict[str, Any] = field(default_factory=dict)
    vm: VirtualManager | None = None
    allocs: list[ContainerAllocation] = field(default_factory=list)
    _pid: int = 50000

    def pod(self) -> dict[str, Any]:
        statuses = []
        for n in ("main", "aux", "side"):
            entry: dict[str, Any] = {"name": n, "state": {"running": {}}}
            if n in self.ids:
                entry["containerID"] = f"containerd://{self.ids[n]}"
            entry.update(self.extra_status.get(n, {}))
            statuses.append(entry)
        gpu = {"limits": {"tencent.com/vcuda-core": "30", "tencent.com/vcuda-memory": "4"}}
        return {
            "metadata": {"uid": UID, "name": "p", "namespace": "ns"},
            "spec": {
                "containers": [
                    {"name": "main", "resources": gpu},
                    {"name": "aux", "resources": gpu},
                    {"name": "side"},
                ],
                **self.spec_extra,
            },
            "status": {"qosClass": self.layout.qos, "phase": "Running", "containerStatuses": statuses},
        }

    def _make(self, container_id: str, pids: list[int]) -> None:
        files_of = V1_MEMORY_FILES if self.layout.v1 else V2_FILES
        for pod_dir in self.layout.pod_dirs(self.root):
            make_cgroup(pod_dir / self.layout.dir_name(container_id), pids, files_of)
            if self.layout.prefix == "crio" and self.layout.systemd:  # conmon's scope beside it
                make_cgroup(pod_dir / f"crio-conmon-{container_id}.scope", [pids[0] + 5000], files_of)

    def _remove(self, container_id: str) -> None:
        for pod_dir in self.layout.pod_dirs(self.root):
            shutil.rmtree(pod_dir / self.layout.dir_name(container_id), ignore_errors=True)
            shutil.rmtree(pod_dir / f"crio-conmon-{container_id}.scope", ignore_errors=True)

    def next_pid(self) -> int:
        self._pid += 1
        return self._pid

    def start(self, name: str, container_id: str, *, published: bool = True) -> int:
        pid = self.next_pid()
        self._make(container_id, [pid])
        self.running[name] = container_id
        if published:
            self.ids[name] = container_id
        return pid

    def stop(self, name: str) -> None:
        """The container's process exits: its cgroup goes (its status still names its ID)."""
        self._remove(self.running.pop(name))

    def restart(self, name: str, new_id: str) -> int:
        """Exit and start again under a new ID; the status still names the old one."""
        self.stop(name)
        return self.start(name, new_id, published=False)

    def publish(self) -> None:
        self.ids.update(self.running)

    def agent(self) -> VirtualManager:
        """The virtual manager (a new one: an agent that started now)."""
        if self.vm is not None:
            self.vm.stop()
        allocs = {
            n: ContainerAllocation(UID, n, (0,), 30, 1 << 30, namespace="ns", started=True) for n in ("main", "aux")
        }
        self.allocs = list(allocs.values())
        self.vm = VirtualManager(
            vm_path=self.vm_path,
            cgroup_root=self.root,
            allocation=lambda uid, name: allocs.get(name) if uid == UID else None,
            pod=lambda uid: self.pod() if uid == UID else None,
            driver_version="550.54.15",
        )
        for alloc in self.allocs:
            self.vm.prepare(alloc)
        return self.vm

    def refresh(self) -> None:
        assert self.vm is not None
        self.vm.refresh_pids(self.allocs)

    def pids(self, name: str) -> list[int]:
        """What the container's pids.config (the one its answer mounts) holds."""
        assert self.vm is not None
        return files.read_pids(self.vm.own_dir(UID, name) / names.PIDS_CONFIG_FILE)


def _node(tmp_path: Path, layout: Layout) -> Iterator[Node]:
    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))
    n = Node(layout, tmp_path / "cgroup", vm_path)
    # The sandbox first (the pause container), then the containers.
    n._make(SANDBOX, [n.next_pid()])
    n.start("main", cid("m0"))
    n.start("aux", cid("a0"))
    n.start("side", cid("s0"))
    n.agent()
    try:
        yield n
    finally:
        if n.vm is not None:
            n.vm.stop()
        shutil.rmtree(vm_path, ignore_errors=True)


@pytest.fixture(params=LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    yield from _node(tmp_path, request.param)


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Node]:
    yield from _node(tmp_path, LAYOUTS[0])


def test_a_restarted_containers_new_processes_are_in_its_pids_config_before_the_status_names_them(
    node: Node,
) -> None:
    node.refresh()
    main_pid = node.pids("main")
    assert len(main_pid) == 1
    new = node.restart("main", cid("m1"))
    node.refresh()
    assert node.pids("main") == [new]
    assert node.pids("aux") != [new]
    node.publish()  # the status catches up: nothing changes
    node.refresh()
    assert node.pids("main") == [new]
    # And again: a container that crash-loops is followed at each restart.
    again = node.restart("main", cid("m2"))
    node.refresh()
    assert node.pids("main") == [again]


def test_the_sandboxs_cgroup_is_never_taken_for_a_container(node: Node) -> None:
    """Between the old container's exit and the new one's start, the pod's cgroup holds the sandbox's
    (which no status names) beside the other containers': it is nobody's restarted container."""
    node.refresh()
    node.stop("main")
    node.refresh()
    assert node.pids("main") == []


def test_two_gpu_containers_restarting_at_once_get_nothing_of_each_others(plain: Node) -> None:
    plain.refresh()
    plain.stop("main")
    new_aux = plain.restart("aux", cid("a1"))
    plain.refresh()  # one new cgroup, two containers that may own it: nobody's
    assert plain.pids("main") == []
    assert plain.pids("aux") == []
    plain.start("main", cid("m1"), published=False)
    plain.refresh()  # two new cgroups, two containers: which is whose cannot be told
    assert new_aux not in plain.pids("main")
    assert plain.pids("aux") == []
    plain.publish()
    plain.refresh()
    assert plain.pids("aux") == [new_aux]


def test_a_container_without_a_gpu_restarting_at_the_same_time_makes_it_ambiguous(plain: Node) -> None:
    plain.refresh()
    plain.stop("main")
    side = plain.restart("side", cid("s1"))
    plain.refresh()
    assert side not in plain.pids("main")
    assert plain.pids("main") == []


def test_a_container_that_has_not_started_yet_may_own_the_new_cgroup(plain: Node) -> None:
    """A container whose status names no ID yet (still waiting for its first start) may be the one
    whose cgroup appears: nothing is guessed."""
    plain.refresh()
    del plain.ids["side"]
    plain.stop("side")
    plain.stop("main")
    new = plain.start("side", cid("s1"), published=False)
    plain.refresh()
    assert new not in plain.pids("main")


def test_a_container_that_ended_for_good_does_not_make_it_ambiguous(plain: Node) -> None:
    """restartPolicy OnFailure: a container whose status says it ended with success is not started again,
    its cgroup gone is no restart."""
    plain.spec_extra = {"restartPolicy": "OnFailure"}
    plain.refresh()
    plain.stop("side")
    plain.extra_status["side"] = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    new = plain.restart("main", cid("m1"))
    plain.refresh()
    assert plain.pids("main") == [new]


def test_an_agent_that_starts_during_the_restart_guesses_nothing(plain: Node) -> None:
    """Only a cgroup that was not there before is a new container's: an agent that never saw the pod's
    cgroup before the restart cannot tell the new container's from the sandbox's."""
    plain.restart("main", cid("m1"))
    plain.agent()
    plain.refresh()
    assert plain.pids("main") == []
    plain.publish()
    plain.refresh()
    assert len(plain.pids("main")) == 1


def test_a_pod_whose_cgroup_is_gone_costs_nothing_and_gets_nothing(plain: Node) -> None:
    plain.refresh()
    for pod_dir in plain.layout.pod_dirs(plain.root):
        shutil.rmtree(pod_dir)
    plain.refresh()
    plain.refresh()
    assert plain.pids("main") == []


def _read(path: Path) -> list[int] | None:
    try:
        return files.read_pids(path)
    except FileNotFoundError:
        return None


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path, client_built: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=1.0) as c:
        yield c


def test_on_the_simulated_node_a_restart_keeps_the_container_held_to_its_share(cluster: SimCluster) -> None:
    run = cluster.run_pod(gpu_pod("shared", [("main", 30, 4)]))
    cluster.wait_status(run)
    own = cluster.vm_path / names.VCUDA_CONFIGS_DIR / run.uid / "main" / names.PIDS_CONFIG_FILE
    deadline = time.monotonic() + 10
    while _read(own) != [run.pids["main"]] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _read(own) == [run.pids["main"]], sorted(str(p) for p in cluster.vm_path.rglob("*"))
    cluster.restart_container(run, "main", publish_status=False)  # the status update is late
    deadline = time.monotonic() + 4  # the refresh runs each second
    while _read(own) != [run.pids["main"]] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _read(own) == [run.pids["main"]], "the restarted container's processes are not its own"
    # gpu-client registering by the container's name meanwhile is answered, with the new processes.
    registered = gpu_client(cluster, run, "--cont-name", "main")
    assert registered.returncode == 0, registered.stderr
    assert _read(own) == [run.pids["main"]]
    cluster.publish_status(run)
    time.sleep(1.5)
    assert _read(own) == [run.pids["main"]]
    # The simulator's restart as the kubelet's: the status names the old ID until its update comes late.
    before = cluster.pod(run)["status"]["containerStatuses"][0]["containerID"]
    new_id = cluster.restart_container(run, "main")
    assert cluster.pod(run)["status"]["containerStatuses"][0]["containerID"] == before
    deadline = time.monotonic() + 10
    while cluster.pod(run)["status"]["containerStatuses"][0]["containerID"] != f"containerd://{new_id}":
        assert time.monotonic() < deadline, "the status never named the new container ID"
        time.sleep(0.05)
    assert cluster.pod(run)["status"]["containerStatuses"][0]["restartCount"] == 2
    assert not (cluster.cgroup_root / "kubepods" / f"pod{run.uid}" / before.split("://")[1]).exists()


def test_a_registration_by_name_during_the_gap_is_written_with_the_new_processes(plain: Node) -> None:
    """gpu-client registers by the container's name: the status's ID (the old one) has no cgroup, and the
    registration was refused for empty PIDs (the library ends the process when its registration fails)."""
    plain.refresh()
    new = plain.restart("main", cid("m1"))
    assert plain.vm is not None
    written = plain.vm.register(UID, pb.VDeviceRequest(pod_uid=UID, container_name="main"), time_left=3.0)
    assert written == plain.vm.own_dir(UID, "main")
    assert plain.pids("main") == [new]


def test_a_registration_by_name_waits_for_the_status_when_the_new_cgroup_is_not_told_apart(plain: Node) -> None:
    plain.refresh()
    plain.stop("aux")
    new = plain.restart("main", cid("m1"))
    assert plain.vm is not None
    vm = plain.vm
    got: dict[str, Any] = {}

    def call() -> None:
        try:
            got["dir"] = vm.register(UID, pb.VDeviceRequest(pod_uid=UID, container_name="main"), time_left=10.0)
        except RegistrationRefused as exc:
            got["refused"] = str(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)
    assert caller.is_alive(), got  # waiting, not refused, not written
    assert plain.pids("main") != [new] or "dir" not in got
    plain.publish()  # the status names both new IDs (aux's: none, it has not started again)
    caller.join(10)
    assert got.get("dir") == vm.own_dir(UID, "main"), got
    assert plain.pids("main") == [new]


def test_a_registration_by_name_of_a_container_whose_cgroup_stays_gone_is_refused_after_the_wait(
    plain: Node,
) -> None:
    plain.refresh()
    plain.stop("main")
    plain.refresh()
    assert plain.vm is not None
    with pytest.raises(RegistrationRefused, match=f"container main of pod ns/p: the cgroup of its ID {cid('m0')[:12]}"):
        plain.vm.register(UID, pb.VDeviceRequest(pod_uid=UID, container_name="main"), time_left=1.5)
    assert plain.pids("main") == []


@pytest.fixture
def dra(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        yield c


def test_dra_a_restarted_containers_new_processes_are_in_its_claims_pids_config_before_the_status(
    dra: DRACluster,
) -> None:
    ref = make_claim(dra, "restarts", [share("gpu-0", "50")])
    prepared(dra, ref)
    pod = bound_pod(dra, "restarts-pod", "restarts")
    pod_cgroup = dra.cgroup_root / "kubepods" / f"pod{pod['metadata']['uid']}"
    make_cgroup(pod_cgroup / SANDBOX, [61000])  # the sandbox's, then the container's
    make_cgroup(pod_cgroup / cid("d0"), [61001])
    status = {"name": "main", "containerID": f"containerd://{cid('d0')}", "ready": True, "restartCount": 0}
    running = {"running": {"startedAt": "2026-11-21T10:00:00Z"}}
    dra.core.patch_namespaced_pod_status(
        "restarts-pod",
        "default",
        {
            "status": {
                "qosClass": "BestEffort",
                "containerStatuses": [{**status, "image": "cuda", "imageID": "", "state": running}],
            }
        },
        _content_type="application/merge-patch+json",
    )
    path = dra.vm_path / ref[2] / names.PIDS_CONFIG_FILE
    wait_for("the claim's pids.config names the container's process", lambda: _read(path) == [61001])
    shutil.rmtree(pod_cgroup / cid("d0"))  # it restarts; the status still names the old ID
    make_cgroup(pod_cgroup / cid("d1"), [61002])
    wait_for("the claim's pids.config names the new process", lambda: _read(path) == [61002], timeout=4)
    time.sleep(1.5)
    assert _read(path) == [61002]


def test_an_ephemeral_container_started_while_a_gpu_container_waits_to_restart_is_not_taken_for_it(
    plain: Node,
) -> None:
    """kubectl debug adds an ephemeral container: its cgroup appears below the pod's, named by no status
    for a second or two, while the GPU container whose cgroup is gone waits for its back-off."""
    plain.refresh()
    plain.stop("main")
    plain.spec_extra = {"ephemeralContainers": [{"name": "debug", "image": "busybox"}]}
    debug = plain.start("debug", cid("e0"), published=False)
    plain.refresh()
    assert debug not in plain.pids("main")


def test_a_new_sandbox_is_not_taken_for_the_container_and_restarts_are_followed_again_after(plain: Node) -> None:
    """The pod's sandbox died: the kubelet makes a new one (its cgroup first) and starts every container
    again. The new sandbox's cgroup is one new cgroup no status names, while the GPU container (the only
    one left to run) has none: it is not the container's."""
    plain.spec_extra = {"restartPolicy": "OnFailure"}
    for done in ("aux", "side"):
        plain.stop(done)
        plain.extra_status[done] = {"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    plain.refresh()
    plain.stop("main")
    plain._remove(SANDBOX)
    pause = plain.next_pid()
    plain._make("5b" * 32, [pause])
    plain.refresh()
    assert pause not in plain.pids("main")
    new = plain.start("main", cid("m1"), published=False)
    plain.refresh()
    assert pause not in plain.pids("main")
    plain.publish()
    plain.refresh()
    assert plain.pids("main") == [new]
    again = plain.restart("main", cid("m2"))  # the new sandbox stays: told apart again
    plain.refresh()
    assert plain.pids("main") == [again]
