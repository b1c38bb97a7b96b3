"""What a tenant's container can make the node agent do through what the agent reads of it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import pytest

from gpumanager import names
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from gpumanager.vmanager import files, manager
from tests.test_pod_sockets import POD, Sockets, pod_sockets
from tests.test_vmanager_register import GIB, alloc, pod_object
from tests.test_vmanager_register import Node as VmNode
from tests.test_vmanager_register import node as vm_node
from tests.test_volume_mirror import MountingChild, Node, _can_unshare, node
from tests.volume_fixtures import V1, V2, driver_store, install_driver, remove_driver

__all__ = ["driver_store", "node", "pod_sockets", "vm_node"]

_DEVICE = "254:0"  # the host file system holding /etc/gpu-manager and /var/lib/kubelet alike


def _agent_mounts(node: Node) -> None:
    """The agent's own mount table: the host's /etc/gpu-manager/vdriver bind-mounted where the test keeps it."""
    (node.proc / "self").mkdir()
    (node.proc / "self" / "mountinfo").write_text(
        f"20 1 0:30 / / rw - overlay overlay rw\n"
        f"21 20 {_DEVICE} /etc/gpu-manager/vdriver {node.base.resolve()} rw - ext4 /dev/vda rw\n"
    )


def _container(node: Node, pid: int, *mounts: tuple[str, str, str]) -> None:
    """A container's process whose mount namespace has these (device, root, mount point) mounts."""
    (node.proc / str(pid)).mkdir()
    (node.proc / str(pid) / "maps").write_text("")
    lines = "".join(
        f"{i} 1 {dev} {root} {point} ro - ext4 /dev/vda rw\n" for i, (dev, root, point) in enumerate(mounts)
    )
    (node.proc / str(pid) / "mountinfo").write_text(lines)


def test_a_mount_whose_path_only_names_an_old_driver_tree_does_not_keep_it(node: Node) -> None:
    """A pod reads the current tree's name in its own mountinfo (the root of /usr/local/nvidia), then mounts
    an emptyDir with that name as its subPath: the old tree is not mounted by anyone, and goes."""
    _agent_mounts(node)
    first = node.run()
    old = first.volumes[0].tree
    empty_dir = (
        f"/var/lib/kubelet/pods/4b1e0c4e-0d7a-4a51-9d0e-3f1c2b7d9a10/volumes/kubernetes.io~empty-dir/x/{old.name}"
    )
    _container(node, 77, (_DEVICE, empty_dir, "/scratch"), ("0:50", f"/{old.name}", "/tmp/also"))
    remove_driver(node.root, V1)
    install_driver(node.store, node.root, V2)
    result = node.run()
    assert old in result.removed_trees, result.kept_trees
    assert not old.exists()


def test_an_old_driver_tree_a_container_mounts_is_kept(node: Node) -> None:
    """The container started while the tree was current: its mount's root is the tree on the agent's device."""
    _agent_mounts(node)
    first = node.run()
    old_nvidia, old_origin = first.volumes[0].tree, first.volumes[1].tree
    _container(
        node,
        78,
        (_DEVICE, f"/etc/gpu-manager/vdriver/.trees/{old_nvidia.name}", "/usr/local/nvidia"),
        (_DEVICE, f"/etc/gpu-manager/vdriver/.trees/{old_origin.name}/lib64", "/opt/lib64"),
    )
    remove_driver(node.root, V1)
    install_driver(node.store, node.root, V2)
    result = node.run()
    kept = {tree: why for tree, why in result.kept_trees}
    assert f"mounted by a container (/etc/gpu-manager/vdriver/.trees/{old_nvidia.name})" == kept[old_nvidia]
    assert old_origin in kept and old_origin.is_dir()


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m (CAP_SYS_ADMIN)")
def test_real_mount_namespaces_keep_the_mounted_tree_and_not_a_namesake(node: Node, tmp_path: Path) -> None:
    """With the real mount tables (the agent's own and a 'container's): a directory named after the old tree,
    bind-mounted, does not keep it; a bind mount of the tree itself does."""
    (node.proc / "self").symlink_to("/proc/self")
    first = node.run()
    old_nvidia, old_origin = first.volumes[0].tree, first.volumes[1].tree
    namesake = tmp_path / "emptydir" / old_nvidia.name
    namesake.mkdir(parents=True)
    with (
        MountingChild(namesake, tmp_path / "c1") as tenant,
        MountingChild(old_origin, tmp_path / "c2") as user,
    ):
        node.watch(tenant.proc.pid)
        node.watch(user.proc.pid)
        remove_driver(node.root, V1)
        install_driver(node.store, node.root, V2)
        result = node.run()
    assert old_nvidia in result.removed_trees
    assert [tree for tree, _ in result.kept_trees] == [old_origin]


# -- vcuda.sock -----------------------------------------------------------------------------------


def test_a_container_registering_in_a_loop_does_not_fill_the_log(
    vm_node: VmNode, caplog: pytest.LogCaptureFixture
) -> None:
    """Every registration is served, but one container calling RegisterVDevice without pause gets a few
    lines a minute in the agent's log, the rest counted, as its refusals are."""
    uid = str(uuid.uuid4())
    cid = "3" * 64
    vm_node.pods[uid] = pod_object(uid, ["main"], ids={"main": cid})
    vm_node.allocs[(uid, "main")] = alloc(uid, "main", 30, GIB)
    vm_node.v.prepare(vm_node.allocs[(uid, "main")])
    vm_node.cgroup(uid, cid)
    calls = 4 * manager.REGISTRATION_LOGS_PER_WINDOW
    with caplog.at_level(logging.INFO, logger=manager.__name__):
        for _ in range(calls):
            vm_node.register(uid, pod_uid=uid, container_id=cid)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("registered pod")]
    assert len(lines) == manager.REGISTRATION_LOGS_PER_WINDOW
    assert files.read_pids(vm_node.vm / uid / cid / names.PIDS_CONFIG_FILE) == [os.getpid()]


_SOFT_LIMIT_PROGRAM = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 4096))
from gpumanager import cli
cli.main(["--version"])
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], file=sys.stderr)
"""


def test_the_agent_takes_its_whole_open_files_allowance() -> None:
    """containerd 2 starts containers with 1024 open files (soft) of 524288 (hard). Each pod's vcuda.sock
    lets its containers hold up to 64 of the agent's descriptors (16 relayed calls of 3, 16 waiting):
    sixteen pods' tenants, or one tenant's sixteen pods, would take every descriptor of a soft 1024 and
    the agent could no longer answer the kubelet. Go programs (upstream's agent) raise the soft limit
    to the hard one at start; so does ours."""
    done = subprocess.run(
        [sys.executable, "-c", _SOFT_LIMIT_PROGRAM], capture_output=True, text=True, timeout=60, check=True
    )
    assert int(done.stderr.strip().splitlines()[-1]) == 4096


# -- pids.config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("forged", ["../{victim}/main", "{vm}/{victim}/main", ".."])
def test_a_container_id_that_is_no_plain_name_never_becomes_a_path(vm_node: VmNode, forged: str) -> None:
    """A pod status is the kubelet's, but whoever may patch pods/status can write any containerID there.
    The pids.config refresh joins the ID to the pod's directory: an ID that climbs out of it must not
    make the agent (root) write the attacker's PIDs into another pod's pids.config, or anywhere else."""
    victim, attacker = str(uuid.uuid4()), str(uuid.uuid4())
    victim_cid, attacker_cid = "4" * 64, "5" * 64
    vm_node.pods[victim] = pod_object(victim, ["main"], ids={"main": victim_cid})
    vm_node.pods[attacker] = pod_object(attacker, ["main"], ids={"main": attacker_cid})
    for uid in (victim, attacker):
        vm_node.allocs[(uid, "main")] = alloc(uid, "main", 30, GIB)
        vm_node.v.prepare(vm_node.allocs[(uid, "main")])
    vm_node.cgroup(victim, victim_cid, pid=1000)
    vm_node.cgroup(attacker, attacker_cid, pid=2000)
    vm_node.v.refresh_pids(list(vm_node.allocs.values()))
    victim_pids = vm_node.vm / names.VCUDA_CONFIGS_DIR / victim / "main" / names.PIDS_CONFIG_FILE
    assert files.read_pids(victim_pids) == [1000]
    forged_id = forged.format(victim=victim, vm=vm_node.vm)
    status = vm_node.pods[attacker]["status"]["containerStatuses"][0]
    vm_node.pods[attacker] = {**vm_node.pods[attacker]}  # a new pod object, as the cache gives one
    status["containerID"] = f"containerd://{forged_id}"
    vm_node.v.refresh_pids(list(vm_node.allocs.values()))
    assert files.read_pids(victim_pids) == [1000]
    assert not (vm_node.vm / names.PIDS_CONFIG_FILE).exists()
    for planted in (
        vm_node.vm / victim / "main" / names.PIDS_CONFIG_FILE,
        vm_node.vm / victim / names.PIDS_CONFIG_FILE,
    ):
        assert not planted.exists() or 2000 not in files.read_pids(planted), planted
    assert sorted(p.name for p in vm_node.vm.iterdir()) == sorted([victim, attacker, names.VCUDA_CONFIGS_DIR])
    assert sorted(p.name for p in (vm_node.vm / names.VCUDA_CONFIGS_DIR).iterdir()) == sorted([victim, attacker])
    for uid in (victim, attacker):  # nothing but the container's own directory in each
        assert [p.name for p in (vm_node.vm / names.VCUDA_CONFIGS_DIR / uid).iterdir()] == ["main"]


def test_malformed_requests_are_refused_without_a_traceback_each(
    pod_sockets: Sockets, caplog: pytest.LogCaptureFixture
) -> None:
    """A container can send any bytes as a RegisterVDevice request: each one that is no VDeviceRequest is
    answered INVALID_ARGUMENT, and the agent's log gets a line now and then, not a traceback per call;
    a well-formed call that follows is served."""
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    corrupt = [b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x12" + b"\x80" * 10]
    with (
        caplog.at_level(logging.DEBUG),
        grpc.insecure_channel(f"unix://{pod_sockets.path}") as channel,
    ):
        call = channel.unary_unary(
            "/vcuda.VCUDAService/RegisterVDevice", request_serializer=None, response_deserializer=None
        )
        codes = []
        for body in corrupt * 10:
            with pytest.raises(grpc.RpcError) as refused:
                call(body, timeout=20)
            codes.append(refused.value.code())
        assert set(codes) == {grpc.StatusCode.INVALID_ARGUMENT}
        call(pb.VDeviceRequest(pod_uid=POD, container_id="c1").SerializeToString(), timeout=20)
    assert pod_sockets.calls == [(POD, "c1")]
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "VDeviceRequest" in r.getMessage()]
    assert len(warned) == 1 and POD in warned[0].getMessage()


def test_calls_from_the_host_network_straight_to_the_server_are_refused_without_a_line_each(
    pod_sockets: Sockets, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that reaches the server's own socket (root on the host) may call it in a loop: each
    call is refused, and the agent's log says so now and then (with the count), not once per call.

    Each call on a connection of its own: the server takes one call at a time per connection
    (CALLS_PER_CONNECTION), so a call sent on the same connection before the server has closed the last
    one's stream is refused by HTTP/2 itself (REFUSED_STREAM, seen as UNAVAILABLE) before any handler runs."""
    pod_sockets.sockets.serve(POD, pod_sockets.path)
    calls = 30
    with caplog.at_level(logging.INFO):
        for _ in range(calls):
            with grpc.insecure_channel(f"unix:{pod_sockets.sockets._address}") as channel:
                stub = pb_grpc.VCUDAServiceStub(channel)
                with pytest.raises(grpc.RpcError) as refused:
                    stub.RegisterVDevice(pb.VDeviceRequest(pod_uid=POD, container_id="c1"), timeout=20)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert pod_sockets.calls == []
    lines = [r.getMessage() for r in caplog.records if "did not come in on a pod's vcuda.sock" in r.getMessage()]
    assert len(lines) == 1
