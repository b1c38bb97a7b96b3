"""The agent process against the kubelet simulator on simulated GPU nodes, over real gRPC."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from gpumanager import names
from gpumanager.api import deviceplugin_v1beta1_pb2 as dp_pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as dp_grpc
from gpumanager.api import display_pb2_grpc
from gpumanager.cli import LOCK_FILE, hold_node_lock
from gpumanager.signals import SignalPipe
from simnode.kubelet import KubeletSimulator, PluginRPCError
from tests.agent_fixtures import StartAgent, gpusim, spec_path

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


def expected_counts(spec: str) -> tuple[int, int, list[int | None]]:
    data = json.loads(spec_path(spec).read_text())
    gpus = data["gpus"]
    return 100 * len(gpus), sum(g["memory_mib"] // 256 for g in gpus), [g.get("numa_node") for g in gpus]


def registered(kubelet: KubeletSimulator, timeout: float = 20.0) -> None:
    for resource in (CORE, MEM):
        kubelet.wait_for_registration(resource, timeout=timeout, with_devices=True)


@pytest.mark.parametrize("spec", ["t4-x1", "v100-pcie-x4", "h100-nvlink-x8", "h200-x16"])
def test_registers_both_resources_with_every_device(
    spec: str, kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    start_agent(spec)
    registered(kubelet)
    cores, blocks, numa = expected_counts(spec)
    core_devices = kubelet.wait_for_devices(CORE, cores)
    mem_devices = kubelet.wait_for_devices(MEM, blocks)
    assert len(core_devices) == cores and len(mem_devices) == blocks
    for gpu, node in enumerate(numa):
        device = core_devices[f"tencent.com/vcuda-core-{gpu * 100 + 42}"]
        assert device.numa_nodes == ((node,) if node is not None else ())
    for resource, endpoint in ((CORE, "vcore.sock"), (MEM, "vmemory.sock")):
        record = kubelet.wait_for_registration(resource)
        assert record.endpoint == endpoint
        assert record.version == "v1beta1"
        assert record.options.pre_start_required
        # vcuda-core's IDs say which GPU a container gets; vcuda-memory's only count blocks, and a
        # call would offer every free block of the node.
        assert record.options.get_preferred_allocation_available is (resource == CORE)
        assert record.request_options.pre_start_required


def test_numa_nodes_of_h100_devices(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    start_agent("h100-nvlink-x8")
    registered(kubelet)
    devices = kubelet.wait_for_devices(MEM, expected_counts("h100-nvlink-x8")[1])
    per_gpu = 81559 // 256
    assert devices[f"tencent.com/vcuda-memory-268435456-{per_gpu * 4 - 1}"].numa_nodes == (0,)
    assert devices[f"tencent.com/vcuda-memory-268435456-{per_gpu * 4}"].numa_nodes == (1,)


def gpu_health(kubelet: KubeletSimulator, resource: str, gpu: int) -> set[str]:
    start = gpu * 100
    return {d.health for i, d in kubelet.devices(resource).items() if start <= int(i.rsplit("-", 1)[1]) < start + 100}


def test_xid_takes_gpu_out_and_quiet_period_brings_it_back(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("h100-nvlink-x8", "--health-quiet-period=2s", "--health-probe-period=200ms")
    registered(kubelet)
    cores = expected_counts("h100-nvlink-x8")[0]
    kubelet.wait_for_devices(CORE, cores)
    mem_blocks = sum(1 for _ in kubelet.devices(MEM))
    agent.wait_for_log("watching XID events on 8 of 8 GPUs")
    gpusim(agent, "xid", "--gpu", "3", "--xid", "79")
    assert "GPU 3 (" in agent.wait_for_log("is unhealthy: XID 79")
    # Back after the quiet period without another error (the kubelet may not have seen the change to
    # unhealthy yet when the log says so: wait for the agent's word, then for the kubelet's lists).
    agent.wait_for_log("is healthy again", timeout=15)
    kubelet.wait_for_devices(CORE, cores, timeout=15)
    kubelet.wait_for_devices(MEM, mem_blocks, timeout=15)

    # Both resources went through a ListAndWatch message with exactly GPU 3's devices Unhealthy and then
    # one with all of them Healthy again. Read from the kubelet's history, so a loaded machine that only
    # looks after the quiet period has ended still sees what was sent.
    def unhealthy_sets(resource: str) -> list[list[int]]:
        return [
            sorted(int(i.rsplit("-", 1)[1]) for i, d in u.devices.items() if not d.healthy)
            for u in kubelet.updates(resource)
            if u.kind == "list_and_watch"
        ]

    for resource, gpu3 in ((CORE, list(range(300, 400))), (MEM, list(range(3 * 318, 4 * 318)))):
        seen = unhealthy_sets(resource)
        assert gpu3 in seen, f"{resource}: no message with GPU 3 unhealthy in {[len(s) for s in seen]}"
        assert seen[-1] == [], f"{resource}: still unhealthy at the end: {seen[-1][:5]}"
        assert all(s in ([], gpu3) for s in seen), f"{resource}: other devices went unhealthy"
        assert all(len(u.devices) == len(kubelet.devices(resource)) for u in kubelet.updates(resource))


def test_ignored_xid_keeps_gpu_healthy(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("v100-pcie-x4", "--health-probe-period=200ms")
    registered(kubelet)
    kubelet.wait_for_devices(CORE, 400)
    agent.wait_for_log("watching XID events")
    gpusim(agent, "xid", "--gpu", "1", "--xid", "13")
    agent.wait_for_log("XID 13 ignored")
    gpusim(agent, "xid", "--gpu", "2", "--xid", "48")
    kubelet.wait_for_devices(CORE, 300, timeout=10)
    assert gpu_health(kubelet, CORE, 1) == {"Healthy"}
    assert gpu_health(kubelet, CORE, 2) == {"Unhealthy"}


def test_ignored_xid_list_is_configurable(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("t4-x1", "--ignored-xids=79", "--health-probe-period=200ms")
    registered(kubelet)
    agent.wait_for_log("watching XID events")
    gpusim(agent, "xid", "--gpu", "0", "--xid", "79")
    agent.wait_for_log("XID 79 ignored")
    gpusim(agent, "xid", "--gpu", "0", "--xid", "13")
    kubelet.wait_for_devices(CORE, 0, timeout=10)


def test_lost_gpu_is_unhealthy_until_restored(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("v100-pcie-x4", "--health-quiet-period=1s", "--health-probe-period=200ms")
    registered(kubelet)
    kubelet.wait_for_devices(CORE, 400)
    gpusim(agent, "lost", "--gpu", "2")
    kubelet.wait_for_devices(CORE, 300, timeout=10)
    assert gpu_health(kubelet, CORE, 2) == {"Unhealthy"}
    agent.wait_for_log("is unhealthy: lost")
    time.sleep(1.5)  # longer than the quiet period: a lost GPU stays out while it is lost
    assert gpu_health(kubelet, CORE, 2) == {"Unhealthy"}
    gpusim(agent, "restore", "--gpu", "2")
    kubelet.wait_for_devices(CORE, 400, timeout=10)


def test_kubelet_restart_re_registers_in_process(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("h100-nvlink-x8")
    registered(kubelet)
    for _ in range(3):
        before = {r: kubelet.registration_count(r) for r in (CORE, MEM)}
        created = kubelet.restart()
        for resource in (CORE, MEM):
            record = kubelet.wait_for_registration(resource, after=before[resource], timeout=10, with_devices=True)
            assert record.registered_at - created < 5.0
        assert (agent.plugin_dir / "vcore.sock").exists()
        kubelet.wait_for_devices(CORE, 800)
    assert agent.proc is not None and agent.proc.poll() is None, "the agent must not exit to recover"


def test_deleted_plugin_socket_is_recreated_and_re_registered(
    kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    agent = start_agent("t4-x1")
    registered(kubelet)
    before = kubelet.registration_count(MEM)
    (agent.plugin_dir / "vmemory.sock").unlink()
    kubelet.wait_for_registration(MEM, after=before, timeout=10)
    assert (agent.plugin_dir / "vmemory.sock").exists()


def test_agent_restart_registers_again(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    first = start_agent("v100-pcie-x4")
    registered(kubelet)
    assert first.stop() == 0
    before = kubelet.registration_count(CORE)
    start_agent("v100-pcie-x4")
    kubelet.wait_for_registration(CORE, after=before, timeout=20, with_devices=True)
    kubelet.wait_for_devices(CORE, 400)


def test_sigterm_stops_cleanly_and_removes_sockets(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("t4-x1")
    registered(kubelet)
    agent.wait_for_log("display service on")  # started in the background after registration
    assert agent.display_socket.exists()
    agent.signal(signal.SIGTERM)
    assert agent.wait(20) == 0
    assert not (agent.plugin_dir / "vcore.sock").exists()
    assert not (agent.plugin_dir / "vmemory.sock").exists()
    assert not agent.display_socket.exists()
    assert (agent.plugin_dir / "kubelet.sock").exists(), "the kubelet's socket is not ours to remove"
    assert "stopped" in agent.log_text()


def test_malformed_spec_fails_with_the_field_named(tmp_path: Path, start_agent: StartAgent) -> None:
    bad = json.loads(spec_path("t4-x1").read_text())
    bad["gpus"][0]["memory_mib"] = "lots"
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps(bad))
    agent = start_agent("t4-x1")
    agent.stop()
    from simnode.agent_process import AgentProcess

    broken = AgentProcess(tmp_path / "broken", spec).start()
    assert broken.wait(30) == 3
    text = broken.log_text()
    assert "memory_mib" in text
    assert "NVML initialisation failed" in text


def test_missing_kubelet_then_kubelet_arrives(tmp_path: Path, start_agent: StartAgent) -> None:
    agent = start_agent("t4-x1")
    agent.wait_for_log("not registered with the kubelet")
    time.sleep(1.0)
    assert agent.proc is not None and agent.proc.poll() is None
    assert agent.log_text().count("not registered with the kubelet") == 1, "log once per state change"
    sim = KubeletSimulator(agent.plugin_dir, fill="sorted")
    sim.start()
    try:
        sim.wait_for_registration(CORE, timeout=10, with_devices=True)
        sim.wait_for_registration(MEM, timeout=10, with_devices=True)
    finally:
        sim.stop()


def test_dead_kubelet_socket_is_retried(tmp_path: Path, start_agent: StartAgent) -> None:
    import socket

    plugin_dir = tmp_path / "device-plugins"
    plugin_dir.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(plugin_dir / "kubelet.sock"))  # bound, never listening: a dead kubelet
    stale.close()
    agent = start_agent("t4-x1")
    agent.wait_for_log("not registered with the kubelet")
    sim = KubeletSimulator(plugin_dir, fill="sorted")
    sim.start()  # removes the stale socket and serves a new one
    try:
        sim.wait_for_registration(CORE, timeout=15, with_devices=True)
    finally:
        sim.stop()


def test_preferred_allocation_and_allocate_without_api_server(
    kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    agent = start_agent("v100-pcie-x4")
    registered(kubelet)
    kubelet.wait_for_devices(CORE, 400)
    with pytest.raises(PluginRPCError) as err:
        kubelet.allocate(CORE, 200, pod_uid="pod-a", container_name="main")
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "API server cannot be asked" in err.value.details
    assert "no-kubeconfig" in err.value.details
    assert kubelet.allocations() == []
    assert "no-kubeconfig: no such file" in agent.log_text()
    # Ask the plugin directly what it prefers: two whole GPUs of one PIX pair.
    with grpc.insecure_channel(f"unix://{kubelet.socket_path.parent / 'vcore.sock'}") as ch:
        stub = dp_grpc.DevicePluginStub(ch)
        available = [f"tencent.com/vcuda-core-{n}" for n in range(400) if not 0 <= n < 5]
        reply = stub.GetPreferredAllocation(
            dp_pb.PreferredAllocationRequest(
                container_requests=[
                    dp_pb.ContainerPreferredAllocationRequest(available_deviceIDs=available, allocation_size=200)
                ]
            ),
            timeout=5,
        )
    chosen = reply.container_responses[0].deviceIDs
    assert len(chosen) == 200
    assert {int(i.rsplit("-", 1)[1]) // 100 for i in chosen} == {2, 3}


def test_http_and_display_endpoints(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("h100-nvlink-x8")
    registered(kubelet)
    agent.wait_for_log("HTTP on")  # started in the background after registration
    base = f"http://127.0.0.1:{agent.query_port}"

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(base + path, timeout=5) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    deadline = time.monotonic() + 10
    while True:
        status, body = get("/healthz")
        if json.loads(body).get("registered") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status == 200 and json.loads(body)["registered"] is True
    graph = json.loads(get("/graph")[1])["graph"]
    assert graph.startswith("ROOT:8\n")
    assert "|   |   |---GPU6 (pids: [], usedMemory: 0," in graph
    gpusim(agent, "proc", "--gpu", "6", "--pid", "4321", "--used-mib", "100")
    gpusim(agent, "proc", "--gpu", "6", "--pid", "1234", "--used-mib", "28")
    graph = json.loads(get("/graph")[1])["graph"]
    assert f"|   |   |---GPU6 (pids: [1234 4321], usedMemory: {128 << 20}," in graph
    assert graph.count("|---NVL ") == 2 and "|---SYS " in graph
    assert json.loads(get("/version")[1])["version"]
    assert get("/usage") == (200, b"{}")
    status, metrics = get("/metrics")
    assert status == 200
    assert b'gpu_manager_gpu_healthy{gpu="7",uuid="' in metrics
    assert b"gpu_manager_kubelet_registered 1.0" in metrics
    assert get("/metric")[0] == 200
    assert get("/nope")[0] == 404
    with grpc.insecure_channel(f"unix://{agent.display_socket}") as ch:
        stub = display_pb2_grpc.GPUDisplayStub(ch)
        assert stub.PrintGraph(empty_pb2.Empty(), timeout=5).graph == graph
        assert stub.Version(empty_pb2.Empty(), timeout=5).version == json.loads(get("/version")[1])["version"]


def test_a_second_agent_on_the_node_waits_for_the_first(
    tmp_path: Path, kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    """Two agents with one checkpoint directory (a rolling update with surge): the second waits for the
    first's lock without touching the sockets, stops at once on SIGTERM while it waits, and takes over when
    the first has gone."""
    shared = f"--checkpoint-path={tmp_path / 'shared-checkpoint'}"
    plugins = f"--device-plugin-path={kubelet.plugin_dir}"
    first = start_agent("t4-x1", shared, plugins, workdir=tmp_path / "a")
    registered(kubelet)
    count = kubelet.registration_count()
    core = kubelet.registration_count(CORE)
    second = start_agent("t4-x1", shared, plugins, workdir=tmp_path / "b")
    second.wait_for_log("holds the node", timeout=20)
    time.sleep(1.0)
    assert kubelet.registration_count() == count
    assert "holds the node" not in first.log_text()
    second.signal(signal.SIGTERM)
    assert second.wait(5) == 0
    third = start_agent("t4-x1", shared, plugins, workdir=tmp_path / "c")
    third.wait_for_log("holds the node", timeout=20)
    assert first.stop() == 0
    kubelet.wait_for_registration(CORE, after=core, timeout=20)
    assert "another gpu-manager" not in first.log_text()


@pytest.fixture
def signal_pipe() -> Iterator[SignalPipe]:
    pipe = SignalPipe()  # not installed: the lock below is never waited for
    yield pipe
    pipe.close()


def test_a_symlink_at_the_lock_path_is_not_followed(
    tmp_path: Path, signal_pipe: SignalPipe, caplog: pytest.LogCaptureFixture
) -> None:
    """A symbolic link planted at gpu-manager.lock: its target is neither truncated nor written, and the
    agent says so and locks the checkpoint directory itself instead, as for any lock file it cannot use."""
    victim = tmp_path / "victim"
    victim.write_text("important data\n")
    (tmp_path / LOCK_FILE).symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="gpumanager.cli"):
        fd, stopped = hold_node_lock(tmp_path, signal_pipe)
    assert fd is not None and stopped is None
    os.close(fd)
    assert victim.read_text() == "important data\n"
    assert str(tmp_path / LOCK_FILE) in caplog.text and "symbolic link" in caplog.text


def test_the_lock_file_names_its_holder_and_a_directory_there_still_locks(
    tmp_path: Path, signal_pipe: SignalPipe
) -> None:
    fd, stopped = hold_node_lock(tmp_path, signal_pipe)
    assert fd is not None and stopped is None
    try:
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
    finally:
        os.close(fd)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / LOCK_FILE).mkdir()
    fd, stopped = hold_node_lock(tmp_path / "d", signal_pipe)
    assert fd is not None and stopped is None
    other = os.open(tmp_path / "d" / LOCK_FILE, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(other)
        os.close(fd)
