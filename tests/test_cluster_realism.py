"""What a real cluster does to the agent: reused device IDs, a hanging API server, broken checkpoints,
signals, a GPU lost at start, operator mistakes, readiness."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpumanager import names
from gpumanager.allocation.journal import read_document
from simnode.agent_process import AgentProcess
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.gpusim_state import sim_env
from simnode.kubelet import KubeletSimulator, PluginRPCError
from tests.agent_fixtures import StartAgent, gpusim, spec_path

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = SimCluster(tmp_path, "v100-pcie-x4", agent_flags=["--allocation-check-period=1"])
    c.start()
    yield c
    c.stop()


def ours(c: SimCluster) -> dict[tuple[str, str], dict[str, object]]:
    data = (read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {})["PodGPUMapping"]
    return {(uid, name): entry for uid, per in data.items() for name, entry in per.items()}


def wait_until(predicate: object, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def http(agent: AgentProcess, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.query_port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- allocation state ----------------------------------------------------------------------------


def test_reused_device_ids_go_to_the_new_pod_and_it_starts(cluster: SimCluster) -> None:
    old = cluster.run_pod(gpu_pod("old", [("c", 100, 0)]))
    for i in range(3):
        cluster.run_pod(gpu_pod(f"busy{i}", [("c", 100, 0)]))
    # The kubelet frees a deleted pod's IDs at once; the deletion reaches the agent later.
    cluster.kubelet.remove_pod(old.uid)
    new = cluster.admit(gpu_pod("new", [("c", 100, 0)]))
    assert set(new.core["c"].device_ids) == set(old.core["c"].device_ids), "the simulator reuses freed IDs"
    mounts = {m.container_path: m.host_path for m in new.core["c"].response.mounts}
    assert mounts["/etc/vcuda"] == str(cluster.vm_path / new.uid)
    cluster.api.delete_pod(old.namespace, old.name)
    wait_until(lambda: (old.uid, "c") not in ours(cluster), what="the old pod's release")
    cluster.start_containers(new)  # PreStart is accepted: the IDs are the new pod's
    assert (new.uid, "c") in ours(cluster)
    assert (cluster.vm_path / "configs" / new.uid / "c" / "vcuda.config").exists()


def test_hanging_api_server_holds_up_only_calls_that_need_it(cluster: SimCluster) -> None:
    known = cluster.create(gpu_pod("known", [("c", 100, 0)]))
    assert cluster.agent is not None
    cluster.agent.stop()
    listed = cluster.agent.log_text().count("listed ")
    agent = cluster.start_agent()
    # Its first list holds the pod: the agent knows it.
    wait_until(lambda: agent.log_text().count("listed ") > listed, what="the restarted agent's first list")
    agent.wait_for_log("started in")
    cluster.api.set_down(True, "hang")
    try:
        order: list[str] = []
        errors: list[str] = []

        def unknown() -> None:
            try:
                cluster.kubelet.allocate(CORE, 30, pod_uid="f0f0f0f0-0000-4000-8000-000000000001", container_name="x")
            except PluginRPCError as exc:
                errors.append(exc.details)
            order.append("unknown")

        t = threading.Thread(target=unknown)
        t.start()
        time.sleep(0.5)  # let it reach the agent, which now waits on the API server for that pod
        run = cluster.admit(known, create=False)  # a pod the agent knows: never waits on the API server
        order.append("known")
        t.join(30)
        assert order == ["known", "unknown"]
        assert errors and "did not answer" in errors[0]
        assert run.core["c"].response.annotations[names.VDEVICE_ANNOTATION]
    finally:
        cluster.api.set_down(False)


@pytest.mark.parametrize("damage", ["null", "bad-cores", "unknown-gpu"])
def test_untrusted_checkpoint_content_is_rebuilt_and_never_overcommits(cluster: SimCluster, damage: str) -> None:
    first = cluster.run_pod(gpu_pod("first", [("c", 30, 4)], annotations=admission_annotations([[0]], 1)))
    cluster.run_pod(gpu_pod("second", [("c", 60, 4)], annotations=admission_annotations([[0]], 2)))
    assert cluster.agent is not None
    cluster.agent.stop()
    path = cluster.checkpoint_dir / names.OWN_CHECKPOINT
    data = json.loads(path.read_text())
    if damage == "null":
        path.write_text("null")
    else:
        entry = data["PodGPUMapping"][first.uid]["c"]
        if damage == "bad-cores":
            entry["Cores"] = "thirty"
        else:
            entry["Devices"] = ["/dev/nvidia9"]
        path.write_text(json.dumps(data))
    cluster.start_agent()
    # GPU 0 carries 90 cores: a 40-core share must go elsewhere (it is the tightest fit otherwise).
    third = cluster.run_pod(gpu_pod("third", [("c", 40, 4)]))
    assert third.core["c"].response.annotations[names.VDEVICE_ANNOTATION] != "/dev/nvidia0"
    entries = ours(cluster)
    assert entries[(first.uid, "c")]["Cores"] == 30 and entries[(first.uid, "c")]["Devices"] == ["/dev/nvidia0"]
    per_gpu: dict[str, int] = {}
    for entry in entries.values():
        for dev in entry["Devices"]:  # type: ignore[attr-defined]
            per_gpu[dev] = per_gpu.get(dev, 0) + int(entry["Cores"])  # type: ignore[call-overload]
    assert max(per_gpu.values()) <= 100


def test_checkpoint_path_that_is_a_file_is_reported_and_new_allocations_refused(
    tmp_path: Path, sim_built: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with SimCluster(tmp_path / "node", "t4-x1", agent_flags=[f"--checkpoint-path={blocker}"]) as c:
        assert c.agent is not None
        c.agent.wait_for_log("HTTP on")
        status, body = http(c.agent, "/readyz")
        assert status == 503
        missing = body["missing"]
        assert isinstance(missing, dict) and str(blocker) in missing["checkpoint"]
        assert "[Errno 17] File exists (EEXIST)" in missing["checkpoint"]
        with pytest.raises(PluginRPCError) as err:
            c.admit(gpu_pod("p", [("c", 100, 0)]))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert str(blocker) in err.value.details
        assert "Traceback" not in c.agent.log_text()
        assert http(c.agent, "/healthz")[0] == 200


# -- GPUs ------------------------------------------------------------------------------------------


def test_gpu_lost_at_start_is_served_unhealthy_and_comes_back(
    tmp_path: Path, kubelet: KubeletSimulator, sim_built: Path
) -> None:
    agent = AgentProcess(tmp_path, spec_path("v100-pcie-x4"), extra_args=["--health-quiet-period=1s"])
    subprocess.run(
        [sys.executable, "-m", "simnode.gpusim", "lost", "--gpu", "2"],
        env=sim_env(agent.spec, agent.state),
        check=True,
        capture_output=True,
    )
    agent.start()
    try:
        kubelet.wait_for_registration(CORE, timeout=20, with_devices=True)
        devices = kubelet.wait_for_devices(CORE, 300)
        assert len(devices) == 400, "the lost GPU's device IDs are kept"
        assert sorted(int(i.rsplit("-", 1)[1]) for i, d in devices.items() if not d.healthy) == list(range(200, 300))
        kubelet.wait_for_registration(MEM, timeout=20, with_devices=True)
        assert len(kubelet.devices(MEM)) == 4 * (32768 // 256)
        gpusim(agent, "restore", "--gpu", "2")
        kubelet.wait_for_devices(CORE, 400, timeout=20)
        assert agent.proc is not None and agent.proc.poll() is None
    finally:
        agent.stop()


# -- lifecycle -------------------------------------------------------------------------------------


def test_sigterm_with_an_idle_pod_watch_exits_at_once(cluster: SimCluster) -> None:
    assert cluster.agent is not None
    agent = cluster.agent
    wait_until(lambda: cluster.api.watch_count() >= 1, what="the pod watch")
    time.sleep(0.5)  # idle: the API-server simulator sends a bookmark once a minute, as a real one
    agent.signal(signal.SIGTERM)
    assert agent.wait(10) == 0
    assert not (cluster.kubelet.plugin_dir / names.VCORE_SOCKET).exists()
    assert not (cluster.kubelet.plugin_dir / names.VMEMORY_SOCKET).exists()


def test_sighup_rechecks_and_keeps_serving(kubelet: KubeletSimulator, start_agent: StartAgent) -> None:
    agent = start_agent("t4-x1")
    kubelet.wait_for_registration(CORE, timeout=20, with_devices=True)
    agent.wait_for_log("HTTP on")
    count = kubelet.registration_count(CORE)
    agent.signal(signal.SIGHUP)
    agent.wait_for_log("re-checking allocations")
    assert agent.proc is not None and agent.proc.poll() is None
    assert kubelet.registration_count(CORE) == count
    assert http(agent, "/healthz")[0] == 200


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--device-plugin-path=device-plugins"], "--device-plugin-path=device-plugins"),
        (["--virtual-manager-path={file}/vm"], "--virtual-manager-path={file}/vm"),
        (["--virtual-manager-path={file}"], "--virtual-manager-path={file}"),
        (["--log-dir={file}/logs"], "--log-dir={file}/logs"),
        (["--display-socket=relative.sock"], "--display-socket=relative.sock"),
    ],
)
def test_operator_errors_exit_2_naming_the_flag(tmp_path: Path, sim_built: Path, flags: list[str], named: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    agent = AgentProcess(tmp_path, spec_path("t4-x1"), extra_args=[f.format(file=blocker) for f in flags])
    agent.start()
    assert agent.wait(30) == 2
    text = agent.log_text()
    assert named.format(file=blocker) in text
    assert "Traceback" not in text


def test_display_socket_in_a_missing_directory_is_created(
    tmp_path: Path, kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    sock = tmp_path / "run" / "new" / "gpu-manager.sock"
    agent = start_agent("t4-x1", f"--display-socket={sock}")
    agent.wait_for_log("display service on")
    assert sock.exists()


# -- readiness -------------------------------------------------------------------------------------


def test_readyz_names_what_is_missing_while_healthz_says_alive(
    kubelet: KubeletSimulator, start_agent: StartAgent
) -> None:
    agent = start_agent("t4-x1", "--share-mode=true")
    kubelet.wait_for_registration(CORE, timeout=20, with_devices=True)
    agent.wait_for_log("serving without it")  # the background start has tried the API server
    assert http(agent, "/healthz")[0] == 200
    status, body = http(agent, "/readyz")
    assert status == 503 and body["ready"] is False
    missing = body["missing"]
    assert isinstance(missing, dict)
    assert "no-kubeconfig" in missing["pod_cache"]
    assert "--volume-config is not set" in missing["interceptor"]
    assert "registered" not in missing and "nvml" not in missing and "checkpoint" not in missing


def test_share_mode_without_the_interceptor_refuses_shares_with_the_reason(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", driver_mirror=False) as c:
        with pytest.raises(PluginRPCError) as err:
            c.admit(gpu_pod("share", [("c", 50, 4)]))
        assert "share mode has no interceptor" in err.value.details
        whole = c.run_pod(gpu_pod("whole", [("c", 100, 0)]))
        assert whole.core["c"].response.annotations[names.VDEVICE_ANNOTATION].startswith("/dev/nvidia")
        assert c.agent is not None
        status, body = http(c.agent, "/readyz")
        assert status == 503 and "interceptor" in body["missing"]  # type: ignore[operator]


def test_ready_when_everything_is_there(cluster: SimCluster) -> None:
    assert cluster.agent is not None
    wait_until(lambda: http(cluster.agent, "/readyz")[0] == 200, what="/readyz")  # type: ignore[union-attr]
    _, body = http(cluster.agent, "/readyz")
    assert body["missing"] == {}
