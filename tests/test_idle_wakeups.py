"""The agent's threads sleep while there is nothing to do, and still notice what they must.

A thread blocked without a timeout makes no voluntary context switch; a loop that polls makes
one per period. Each test counts the switches of one thread over an idle second and a half
(the kernel's own count, ``/proc/self/task/<tid>/status``: load on the machine does not add to
it), then shows that the event the thread waits for is still seen.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
from google.protobuf import empty_pb2

from gpumanager import names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import display_pb2, display_pb2_grpc
from gpumanager.metrics.display import DisplayServer, DisplayServicer
from gpumanager.metrics.http import QueryServer
from gpumanager.signals import SignalPipe
from gpumanager.vmanager import files
from gpumanager.vmanager.manager import VirtualManager
from gpumanager.vmanager.refresh import PidsRefresher
from simnode.kubelet import KubeletSimulator
from tests.agent_fixtures import StartAgent
from tests.wakeups import ASLEEP, IDLE_SECONDS, idle_switches, named_thread, voluntary_switches, wait_until


def _query_server() -> QueryServer:
    return QueryServer(
        "127.0.0.1",
        0,
        routes={},
        metrics=lambda: b"up 1\n",
        health=lambda: (True, {}),
    )


def test_http_server_sleeps_until_a_request_comes() -> None:
    server = _query_server()
    server.start()
    try:
        assert idle_switches(named_thread("http")) <= ASLEEP
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as resp:
            assert resp.read() == b"up 1\n"
    finally:
        server.stop()


def test_http_server_stops_while_asleep() -> None:
    server = _query_server()
    server.start()
    thread = named_thread("http")
    time.sleep(0.2)
    server.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_main_thread_sleeps_until_a_signal_comes() -> None:
    main = threading.main_thread()
    pipe = SignalPipe().install()
    counted: list[int] = []

    def later() -> None:
        counted.append(idle_switches(main))
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        helper = threading.Thread(target=later)
        helper.start()
        got = [pipe.next(), pipe.next()]
        helper.join()
    finally:
        pipe.close()
    assert sorted(got) == [signal.SIGHUP, signal.SIGTERM]  # two signals at once come in either order
    assert counted[0] <= ASLEEP


def test_a_signal_before_the_wait_is_kept() -> None:
    # Whatever handled SIGINT before (Python's default, or SIG_IGN in a pytest-xdist worker) is
    # given back after.
    before = signal.getsignal(signal.SIGINT)
    pipe = SignalPipe().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert pipe.next() == signal.SIGINT
    finally:
        pipe.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_agent_main_thread_sleeps_and_obeys_sighup_then_sigterm(
    kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    agent = start_agent("t4-x1")
    kubelet.wait_for_registration(names.VCORE_RESOURCE, timeout=20, with_devices=True)
    agent.wait_for_log("devices in ")
    time.sleep(0.2)
    before = voluntary_switches(agent.pid, agent.pid)  # the main thread's ID is the process's
    time.sleep(IDLE_SECONDS)
    assert voluntary_switches(agent.pid, agent.pid) - before <= ASLEEP
    agent.signal(signal.SIGHUP)
    agent.wait_for_log("re-checking allocations")
    agent.signal(signal.SIGTERM)
    assert agent.wait(10) == 0
    assert "received SIGTERM; stopping" in agent.log_text()


POD = "0b7f7e39-3f7c-4cd8-a7a7-5e0d0c1e9f01"
CID = "c0ffee" * 10 + "beef"


def test_pids_refresh_sleeps_until_a_shared_container_is_prepared(tmp_path: Path) -> None:
    vm_path = Path(tempfile.mkdtemp(prefix="gm-vm-"))  # short: <vm>/<uid>/vcuda.sock < 108 bytes
    pod = {
        "metadata": {"uid": POD, "name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "main"}]},
        "status": {
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": "main", "containerID": f"containerd://{CID}"}],
        },
    }
    procs = tmp_path / "cgroup" / "kubepods" / f"pod{POD}" / CID / "cgroup.procs"
    procs.parent.mkdir(parents=True)
    procs.write_text("4242\n")
    alloc = ContainerAllocation(POD, "main", (0,), 30, 4 << 28)
    allocations: list[ContainerAllocation] = []
    vm = VirtualManager(
        vm_path=vm_path,
        cgroup_root=tmp_path / "cgroup",
        allocation=lambda uid, name: alloc,
        pod=lambda uid: pod if uid == POD else None,
        driver_version="550.54.15",
    )
    refresher = PidsRefresher(vm, lambda: list(allocations), period=0.1)
    refresher.start()
    pids = vm_path / "configs" / POD / "main" / names.PIDS_CONFIG_FILE
    try:
        assert idle_switches(named_thread("pids-refresh")) <= ASLEEP  # no shared container: nothing to do
        allocations.append(alloc)
        vm.prepare(alloc)
        wait_until(lambda: pids.exists() and files.read_pids(pids) == [4242], "pids.config after PreStartContainer")
        procs.write_text("4242\n4343\n")  # from now on kept current every period
        wait_until(lambda: files.read_pids(pids) == [4242, 4343], "pids.config follows the container's processes")
    finally:
        refresher.stop()
        vm.stop()
        shutil.rmtree(vm_path, ignore_errors=True)


def test_display_server_sleeps_until_a_call_comes() -> None:
    socket_path = Path(tempfile.mkdtemp(prefix="gm-display-")) / "gpu-manager.sock"
    servicer = DisplayServicer(graph=lambda: "ROOT:1", usages=display_pb2.UsageResponse, version="v")
    server = DisplayServer(servicer, socket_path)
    existing = set(threading.enumerate())
    server.start()
    try:
        started = [t for t in threading.enumerate() if t not in existing]
        assert started
        time.sleep(0.2)
        before = {t: voluntary_switches(t) for t in started}
        time.sleep(IDLE_SECONDS)
        woke = {t.name: voluntary_switches(t) - n for t, n in before.items()}
        assert sum(woke.values()) <= ASLEEP, woke
        with grpc.insecure_channel(f"unix://{socket_path}") as channel:
            stub = display_pb2_grpc.GPUDisplayStub(channel)
            assert stub.PrintGraph(empty_pb2.Empty(), timeout=5).graph == "ROOT:1"
            assert stub.Version(empty_pb2.Empty(), timeout=5).version == "v"
    finally:
        server.stop()
    assert not socket_path.exists()
    shutil.rmtree(socket_path.parent, ignore_errors=True)
