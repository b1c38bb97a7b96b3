"""RegisterVDevice against the virtual manager itself (no agent, no gpu-client): which container a
request is taken for, whose directory gets the files, and what a refusal costs."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import cgroups, files
from gpumanager.vmanager.manager import RegistrationRefused, VirtualManager

GIB = 1 << 30


@dataclass
class Node:
    vm: Path
    cgroups: Path
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    allocs: dict[tuple[str, str], ContainerAllocation] = field(default_factory=dict)
    manager: VirtualManager | None = None

    @property
    def v(self) -> VirtualManager:
        assert self.manager is not None
        return self.manager

    def cgroup(self, pod_uid: str, leaf: str, pid: int | None = None) -> Path:
        """A cgroupfs container cgroup ``kubepods/pod<uid>/<leaf>`` holding ``pid`` (ours by default)."""
        d = self.cgroups / "kubepods" / f"pod{pod_uid}" / leaf
        d.mkdir(parents=True, exist_ok=True)
        (d / "cgroup.procs").write_text(f"{os.getpid() if pid is None else pid}\n")
        return d

    def register(self, socket_pod: str, *, time_left: float = 1.0, **fields: str) -> Path:
        return self.v.register(socket_pod, pb.VDeviceRequest(**fields), time_left=time_left)


def pod_object(
    uid: str, containers: list[str], inits: list[str] | None = None, ids: dict[str, str] | None = None
) -> dict[str, Any]:
    inits, ids = inits or [], ids or {}
    status: dict[str, Any] = {"phase": "Pending", "qosClass": "Guaranteed"}
    status["containerStatuses"] = [{"name": n, "containerID": f"containerd://{ids[n]}"} for n in containers if n in ids]
    status["initContainerStatuses"] = [{"name": n, "containerID": f"containerd://{ids[n]}"} for n in inits if n in ids]
    return {
        "metadata": {"uid": uid, "name": f"p-{uid[:4]}", "namespace": "default"},
        "spec": {"initContainers": [{"name": n} for n in inits], "containers": [{"name": n} for n in containers]},
        "status": status,
    }


def alloc(uid: str, name: str, cores: int, memory: int, answered: tuple[str, str] = ("", "")) -> ContainerAllocation:
    return ContainerAllocation(
        pod_uid=uid, container=name, minors=(0,), cores=cores, memory=memory, answered_as=answered
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    # A short directory: a pod's vcuda.sock path must fit a unix address (pytest's do not always).
    short = Path(tempfile.mkdtemp(prefix="vmr", dir="/tmp"))
    n = Node(short / "vm", tmp_path / "cg")
    n.cgroups.mkdir()
    n.manager = VirtualManager(
        vm_path=n.vm,
        cgroup_root=n.cgroups,
        allocation=lambda u, c: n.allocs.get((u, c)),
        pod=n.pods.get,
        driver_version="550.54.15",
    )
    yield n
    n.v.stop()
    shutil.rmtree(short, ignore_errors=True)


# -- init containers ------------------------------------------------------------------------------


def _init_pod(node: Node, ids: dict[str, str] | None = None) -> str:
    uid = str(uuid.uuid4())
    node.pods[uid] = pod_object(uid, ["main"], ["init"], ids)
    node.allocs[(uid, "init")] = alloc(uid, "init", 20, GIB)
    node.allocs[(uid, "main")] = alloc(uid, "main", 80, 12 * GIB)
    for a in node.allocs.values():
        node.v.prepare(a)
    return uid


def test_an_init_container_is_not_taken_for_the_main_container_before_the_status(node: Node) -> None:
    uid = _init_pod(node)
    init_cid = "1" * 64
    node.cgroup(uid, init_cid)
    with pytest.raises(RegistrationRefused):
        node.register(uid, pod_uid=uid, container_id=init_cid, time_left=1.2)
    assert not (node.vm / uid / init_cid / names.VCUDA_CONFIG_FILE).exists()


def test_an_init_container_is_recognised_when_it_is_the_only_candidate(node: Node) -> None:
    main_cid, init_cid = "2" * 64, "1" * 64
    uid = _init_pod(node, {"main": main_cid})
    node.cgroup(uid, main_cid)
    node.cgroup(uid, init_cid)
    directory = node.register(uid, pod_uid=uid, container_id=init_cid)
    config = files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes())
    assert (config.container_name, config.gpu_memory, config.utilization) == ("init", GIB, 20)


def test_an_init_container_registers_by_its_name(node: Node) -> None:
    init_cid = "1" * 64
    uid = _init_pod(node, {"init": init_cid})
    node.cgroup(uid, init_cid)
    directory = node.register(uid, pod_uid=uid, container_name="init")
    assert directory == node.vm / "configs" / uid / "init"
    assert files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes()).gpu_memory == GIB
    assert (directory / names.PIDS_CONFIG_FILE).exists()


def test_an_unknown_container_name_is_still_refused(node: Node) -> None:
    uid = _init_pod(node)
    with pytest.raises(RegistrationRefused) as refused:
        node.register(uid, pod_uid=uid, container_name="nobody")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_a_completed_init_container_leaves_the_main_container_recognised(node: Node) -> None:
    init_cid, main_cid = "1" * 64, "2" * 64
    uid = _init_pod(node, {"init": init_cid})
    node.pods[uid]["status"]["initContainerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    node.cgroup(uid, main_cid)  # the init container's cgroup is gone
    directory = node.register(uid, pod_uid=uid, container_id=main_cid)
    config = files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes())
    assert (config.container_name, config.gpu_memory) == ("main", 12 * GIB)


# -- a PreStartContainer swap: pod B's container runs with pod A's directory ----------------------

POD_A, POD_B = "aaaaaaaa-0000-4000-8000-000000000001", "bbbbbbbb-0000-4000-8000-000000000002"
CID_A, CID_B = "a" * 64, "b" * 64


@pytest.fixture
def swapped(node: Node) -> Node:
    for uid, cid, other in ((POD_A, CID_A, POD_B), (POD_B, CID_B, POD_A)):
        node.pods[uid] = pod_object(uid, ["main"], ids={"main": cid})
        node.allocs[(uid, "main")] = alloc(uid, "main", 50, GIB, answered=(other, "main"))
        node.cgroup(uid, cid)
    for a in node.allocs.values():
        node.v.prepare(a)
    return node


def test_a_swapped_container_registers_on_the_socket_of_the_directory_it_was_given(swapped: Node) -> None:
    directory = swapped.register(POD_A, pod_uid=POD_B, container_id=CID_B)
    assert directory == swapped.vm / POD_A / CID_B
    assert files.read_pids(directory / names.PIDS_CONFIG_FILE) == [os.getpid()]
    assert not (swapped.vm / POD_B / CID_B).exists()


def test_the_refresh_writes_a_swapped_registration_where_it_was_made(swapped: Node) -> None:
    swapped.register(POD_A, pod_uid=POD_B, container_id=CID_B)
    (swapped.cgroups / "kubepods" / f"pod{POD_B}" / CID_B / "cgroup.procs").write_text("4242\n")
    swapped.v.refresh_pids(list(swapped.allocs.values()))
    assert files.read_pids(swapped.vm / POD_A / CID_B / names.PIDS_CONFIG_FILE) == [4242]
    assert files.read_pids(swapped.vm / "configs" / POD_A / "main" / names.PIDS_CONFIG_FILE) == [4242]
    assert not (swapped.vm / POD_B / CID_B).exists()


def test_a_pod_whose_answer_is_not_this_sockets_directory_is_refused(swapped: Node) -> None:
    other = "cccccccc-0000-4000-8000-000000000003"
    swapped.pods[other] = pod_object(other, ["main"], ids={"main": "c" * 64})
    swapped.allocs[(other, "main")] = alloc(other, "main", 50, GIB)
    swapped.cgroup(other, "c" * 64)
    with pytest.raises(RegistrationRefused) as refused:
        swapped.register(POD_A, pod_uid=other, container_id="c" * 64)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not (swapped.vm / POD_A / ("c" * 64)).exists()


# -- what a refusal costs: the agent's log stays small --------------------------------------------


def _call(sock: Path, req: pb.VDeviceRequest) -> grpc.StatusCode:
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        try:
            pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(req, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_an_overlong_field_is_refused_before_anything_else(node: Node) -> None:
    uid = _init_pod(node)
    with pytest.raises(RegistrationRefused) as refused:
        node.register(uid, pod_uid=uid, container_name="x" * 300)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "container_name" in str(refused.value) and len(str(refused.value)) < 200


def test_refusals_do_not_flood_the_log(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    uid = _init_pod(node)
    sock = node.vm / uid / names.VCUDA_SOCKET
    caplog.set_level(logging.INFO, logger="gpumanager.vmanager")
    # A message over the server's limit never reaches the handler.
    assert _call(sock, pb.VDeviceRequest(pod_uid=uid, container_name="y" * (1 << 20))) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    for i in range(40):
        code = _call(sock, pb.VDeviceRequest(pod_uid=uid, container_name=f"{i:03d}" + "z" * 250))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 10
    assert sum(len(r.getMessage()) for r in caplog.records) < 5000


# -- container IDs the pod's status does not name: looked for below the pod's cgroup only ----------


def test_unknown_container_ids_do_not_walk_the_whole_cgroup_tree(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    uid = _init_pod(node, {"main": "2" * 64, "init": "1" * 64})
    node.cgroup(uid, "2" * 64)
    for i in range(200):  # the rest of the node
        (node.cgroups / "kubepods" / f"pod{i:08d}-0000-4000-8000-000000000000" / f"{i:064x}").mkdir(parents=True)
    walked: list[str] = []
    real_walk = os.walk

    def counted(top: Any, *args: Any, **kwargs: Any) -> Any:
        walked.append(str(top))
        return real_walk(top, *args, **kwargs)

    monkeypatch.setattr(cgroups.os, "walk", counted)
    for bogus in ("e" * 64, "f" * 64, "d" * 64):
        with pytest.raises(RegistrationRefused):
            node.register(uid, pod_uid=uid, container_id=bogus, time_left=2.7)
    assert str(node.cgroups) not in walked and str(node.cgroups / "kubepods") not in walked
    assert len(walked) <= 8  # the pod's own directory, at most once a second


def test_an_unknown_id_in_an_unusual_place_below_the_pod_is_still_recognised(node: Node) -> None:
    uid = _init_pod(node, {"init": "1" * 64})
    node.pods[uid]["status"]["initContainerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    main_cid = "2" * 64
    node.cgroup(uid, f"nested/{main_cid}")
    directory = node.register(uid, pod_uid=uid, container_id=main_cid)
    assert files.read_pids(directory / names.PIDS_CONFIG_FILE) == [os.getpid()]


# -- a swap and registration by name: the files written are those of the directory the caller mounts --

POD_P = "cccccccc-0000-4000-8000-000000000003"
PID_A, PID_B = 1111, 2222


def _pids(node: Node, pod_uid: str, subdir: str) -> list[int]:
    # A container's own directory (by its name: 63 characters at most), or the pod's (by a container ID).
    directory = node.vm / "configs" / pod_uid / subdir if len(subdir) <= 63 else node.vm / pod_uid / subdir
    return files.read_pids(directory / names.PIDS_CONFIG_FILE)


def _refresh_twice(node: Node) -> None:
    for _ in range(2):
        node.v.refresh_pids(list(node.allocs.values()))


@pytest.fixture
def swapped_in_pod(node: Node) -> Node:
    """Containers a (10 cores) and b (90) of one pod, answered with each other's directory."""
    node.pods[POD_P] = pod_object(POD_P, ["a", "b"], ids={"a": CID_A, "b": CID_B})
    node.allocs[(POD_P, "a")] = alloc(POD_P, "a", 10, GIB, answered=(POD_P, "b"))
    node.allocs[(POD_P, "b")] = alloc(POD_P, "b", 90, GIB, answered=(POD_P, "a"))
    node.cgroup(POD_P, CID_A, PID_A)
    node.cgroup(POD_P, CID_B, PID_B)
    for a in node.allocs.values():
        node.v.prepare(a)
    node.v.refresh_pids(list(node.allocs.values()))
    return node


def test_a_registration_by_name_in_a_pod_swap_writes_the_directory_the_container_mounts(
    swapped_in_pod: Node,
) -> None:
    node = swapped_in_pod
    directory = node.register(POD_P, pod_uid=POD_P, container_name="a")
    assert directory == node.vm / "configs" / POD_P / "b"
    assert files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes()).utilization == 10
    assert (_pids(node, POD_P, "b"), _pids(node, POD_P, "a")) == ([PID_A], [PID_B])
    _refresh_twice(node)
    assert (_pids(node, POD_P, "b"), _pids(node, POD_P, "a")) == ([PID_A], [PID_B])
    assert node.register(POD_P, container_name="b") == node.vm / "configs" / POD_P / "a"
    _refresh_twice(node)
    assert (_pids(node, POD_P, "b"), _pids(node, POD_P, "a")) == ([PID_A], [PID_B])


@pytest.fixture
def swapped_pids(swapped: Node) -> Node:
    """``swapped`` with each container's own PID: A.main mounts B's directory, B.main A's."""
    swapped.cgroup(POD_A, CID_A, PID_A)
    swapped.cgroup(POD_B, CID_B, PID_B)
    swapped.v.refresh_pids(list(swapped.allocs.values()))
    return swapped


@pytest.mark.parametrize("pod_uid", [POD_A, POD_B, ""])
def test_a_registration_by_name_on_the_socket_of_a_swapped_directory_is_its_mounting_container(
    swapped_pids: Node, pod_uid: str
) -> None:
    node = swapped_pids
    assert (_pids(node, POD_B, "main"), _pids(node, POD_A, "main")) == ([PID_A], [PID_B])
    # Only A.main mounts B's directory: a call on B's socket is A.main's, whichever pod it names.
    directory = node.register(POD_B, pod_uid=pod_uid, container_name="main")
    assert directory == node.vm / "configs" / POD_B / "main"
    assert (_pids(node, POD_B, "main"), _pids(node, POD_A, "main")) == ([PID_A], [PID_B])
    _refresh_twice(node)
    assert (_pids(node, POD_B, "main"), _pids(node, POD_A, "main")) == ([PID_A], [PID_B])


def test_a_swapped_container_is_refused_on_its_own_pods_socket_by_id(swapped_pids: Node) -> None:
    with pytest.raises(RegistrationRefused) as refused:
        swapped_pids.register(POD_B, pod_uid=POD_B, container_id=CID_B)
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "directory of pod" in str(refused.value)
    assert not (swapped_pids.vm / POD_B / CID_B).exists()
    assert _pids(swapped_pids, POD_B, "main") == [PID_A]


def test_a_name_two_swapped_containers_could_be_is_refused(node: Node) -> None:
    pod_x, pod_y = "dddddddd-0000-4000-8000-000000000004", "eeeeeeee-0000-4000-8000-000000000005"
    node.pods[POD_P] = pod_object(POD_P, ["main"], ids={"main": CID_A})
    node.allocs[(POD_P, "main")] = alloc(POD_P, "main", 50, GIB, answered=(pod_x, "main"))
    for uid, cid in ((pod_x, "d" * 64), (pod_y, "e" * 64)):
        node.pods[uid] = pod_object(uid, ["main"], ids={"main": cid})
        node.allocs[(uid, "main")] = alloc(uid, "main", 50, GIB, answered=(POD_P, "main"))
        node.cgroup(uid, cid)
    for a in node.allocs.values():
        node.v.prepare(a)
    node.v.refresh_pids(list(node.allocs.values()))
    before = _pids(node, POD_P, "main")
    with pytest.raises(RegistrationRefused) as refused:
        node.register(POD_P, container_name="main")
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "more than one" in str(refused.value)
    assert _pids(node, POD_P, "main") == before
