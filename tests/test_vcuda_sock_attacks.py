"""Every pod's vcuda.sock is served by one gRPC server through a relay: what one pod (or a process
beside the pods) does to it must not reach another pod, and the agent's restarts must not fail a
registration in flight.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpumanager import names
from gpumanager.api import vcuda_pb2 as pb
from gpumanager.api import vcuda_pb2_grpc as pb_grpc
from simnode.cluster import PodRun, SimCluster, gpu_pod
from tests.gpu_client_fixtures import CLIENT, client_built

__all__ = ["client_built"]

#: A container ID of the right shape that is no container of the pod: its registration waits.
NO_SUCH_CONTAINER = "0" * 64


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path, client_built: Path) -> Iterator[SimCluster]:
    with SimCluster(tmp_path / "node", "v100-pcie-x4", agent_flags=[f"--gpu-client={client_built}"]) as c:
        yield c


def _socket(cluster: SimCluster, run: PodRun) -> Path:
    return cluster.vm_path / run.uid / names.VCUDA_SOCKET


def _gpu_client(cluster: SimCluster, run: PodRun, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(CLIENT), "--addr", str(_socket(cluster, run)), "--bus-id", "", "--pod-uid", run.uid, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _register(channel: grpc.Channel, pod_uid: str, container_id: str, timeout: float) -> grpc.StatusCode:
    try:
        pb_grpc.VCUDAServiceStub(channel).RegisterVDevice(
            pb.VDeviceRequest(pod_uid=pod_uid, container_id=container_id), timeout=timeout
        )
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _share_pod(cluster: SimCluster, name: str) -> PodRun:
    run = cluster.run_pod(gpu_pod(name, [("main", 30, 4)]))
    cluster.wait_status(run)
    return run


def _abstract_names(pid: int) -> list[str]:
    """Abstract unix socket names of the agent's vcuda server in this network namespace."""
    text = Path("/proc/net/unix").read_text()
    return sorted(set(re.findall(rf"@(gpu-manager-vcuda\.{pid}\.[0-9a-f]+(?:\.\S+)?)", text)))


def test_one_pods_waiting_calls_do_not_starve_another_pods_registration(cluster: SimCluster) -> None:
    attacker = _share_pod(cluster, "attacker")
    victim = _share_pod(cluster, "victim")
    channels = [grpc.insecure_channel(f"unix://{_socket(cluster, attacker)}") for _ in range(16)]
    try:
        with futures.ThreadPoolExecutor(64) as pool:
            waiting = [
                pool.submit(_register, ch, attacker.uid, NO_SUCH_CONTAINER, 60.0) for ch in channels for _ in range(4)
            ]
            time.sleep(1.0)  # every call of the attacker is in the agent now, waiting for a container
            client = _gpu_client(cluster, victim, "--cont-name", "main", "--timeout", "8")
            _out, err = client.communicate(timeout=30)
            assert client.returncode == 0, err
            assert (cluster.vm_path / "configs" / victim.uid / "main" / names.PIDS_CONFIG_FILE).exists()
            for ch in channels:
                ch.close()
            for f in waiting:
                f.result(timeout=90)
    finally:
        for ch in channels:
            ch.close()


def test_relay_connections_cannot_be_impersonated_or_blocked_from_the_host_network(cluster: SimCluster) -> None:
    victim = _share_pod(cluster, "victim")
    assert cluster.agent is not None
    # One registration, so a relayed connection has been made and its name can be seen.
    client = _gpu_client(cluster, victim, "--cont-name", "main", "--timeout", "8")
    assert client.wait(30) == 0, client.stderr.read() if client.stderr else ""
    # A process in the host network namespace (a hostNetwork pod) sees abstract names in /proc/net/unix:
    # the server behind the pod sockets has none (its socket is in a directory only the agent reaches).
    server = [n for n in _abstract_names(cluster.agent.pid) if n.count(".") == 2]
    assert server == [], _abstract_names(cluster.agent.pid)
    prefix = f"gpu-manager-vcuda.{cluster.agent.pid}"
    # It takes names like those of the relayed connections...
    taken = []
    for n in range(1, 300):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(f"\0{prefix}.{n}")
        except OSError:
            s.close()
            continue
        taken.append(s)
    try:
        # ... and cannot call the server as the victim pod: no address of the agent's answers it.
        for name in _abstract_names(cluster.agent.pid):
            direct = grpc.insecure_channel(f"unix-abstract:{name}")
            assert _register(direct, victim.uid, NO_SUCH_CONTAINER, 3.0) == grpc.StatusCode.UNAVAILABLE
            direct.close()
        # The victim still registers through its own socket.
        client = _gpu_client(cluster, victim, "--cont-name", "main", "--timeout", "8")
        _out, err = client.communicate(timeout=30)
        assert client.returncode == 0, err
    finally:
        for s in taken:
            s.close()


def test_gpu_client_registers_across_an_agent_restart_mid_call(cluster: SimCluster) -> None:
    run = cluster.admit(gpu_pod("restarted", [("main", 30, 4)]))
    # The status (with the container's ID) is late: the call waits in the agent...
    cluster.start_containers(run, publish_status=False)
    client = _gpu_client(cluster, run, "--cont-name", "main", "--timeout", "60")
    time.sleep(1.0)
    assert client.poll() is None, "the call did not wait for the pod's status"
    # ... when the agent restarts under it.
    assert cluster.agent is not None
    cluster.agent.stop()
    cluster.start_agent()
    cluster.publish_status(run)
    _out, err = client.communicate(timeout=60)
    assert client.returncode == 0, err
    assert (cluster.vm_path / "configs" / run.uid / "main" / names.PIDS_CONFIG_FILE).exists()


def test_connections_to_a_pods_socket_end_with_the_pod(cluster: SimCluster) -> None:
    run = _share_pod(cluster, "ending")
    sock_path = _socket(cluster, run)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(sock_path))
    try:
        cluster.delete(run)
        deadline = time.monotonic() + 30
        while sock_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not sock_path.exists(), "the socket of a pod that ended is still there"
        # The server's first bytes (its HTTP/2 settings) may be there; then the connection must end.
        conn.settimeout(15)
        ended = False
        try:
            while conn.recv(4096):
                pass
            ended = True
        except ConnectionResetError:
            ended = True
        except TimeoutError:
            pass
        assert ended, "a connection to the socket of a pod that ended is still relayed"
    finally:
        conn.close()


def test_a_short_prefix_of_an_id_cannot_write_into_another_containers_directory(cluster: SimCluster) -> None:
    """A container may name itself by a prefix of its ID, and its files go into a directory of that
    name; a prefix that is another container's name ("b") wrote the PIDs of one container into the
    other's pids.config."""
    from simnode import cluster as sim

    run = cluster.admit(gpu_pod("two", [("main", 30, 4), ("b", 30, 4)]))
    for name in run.core:
        for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
            cluster.kubelet.pre_start(resource, pod_uid=run.uid, container_name=name)
    ids = {"main": "b" + "1" * 63, "b": "c" + "2" * 63}
    statuses = []
    for name, cid in ids.items():
        pid = next(sim._pid_counter)
        run.pids[name] = pid
        sim.make_cgroup(cluster.cgroup_root / "kubepods" / f"pod{run.uid}" / cid, [pid])
        statuses.append(
            {"name": name, "containerID": f"containerd://{cid}", "ready": True, "restartCount": 0,
             "image": "cuda", "imageID": "", "state": {"running": {"startedAt": "2026-11-21T10:00:00Z"}}}
        )  # fmt: skip
    run.statuses = statuses
    cluster.publish_status(run)
    cluster.wait_status(run)
    with grpc.insecure_channel(f"unix://{_socket(cluster, run)}") as channel:
        for short in ("b", "b111", "b11111111111"[:11]):
            assert _register(channel, run.uid, short, 3.0) != grpc.StatusCode.OK, short
        assert _register(channel, run.uid, ids["main"][:12], 10.0) == grpc.StatusCode.OK  # a short ID
        assert _register(channel, run.uid, ids["main"], 10.0) == grpc.StatusCode.OK
    from gpumanager.vmanager.files import read_pids

    written = cluster.vm_path / "configs" / run.uid / "b" / "pids.config"  # container b's own (by its name)
    assert run.pids["main"] not in (read_pids(written) if written.exists() else []), "main's PIDs in b's file"
    assert sorted(p.name for p in (cluster.vm_path / run.uid).iterdir() if p.is_dir()) == sorted(
        ["b", "main", ids["main"][:12], ids["main"]]
    ), "a directory for a prefix that names no container"
