"""DRA mode: what a restart or an odd claim must not change (taint values, over-commit, files)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simnode.dra_cluster import DRIVER, NODE, DRACluster
from simnode.gpusim_state import GpuSimState

JSON = dict[str, Any]


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    with DRACluster(tmp_path, "v100-pcie-x4", health_quiet_period="1h", status_lag=0) as c:
        yield c


def make_claim(c: DRACluster, name: str, results: list[JSON]) -> tuple[str, str, str]:
    """A claim allocated ``results`` (as a scheduler would write them); (namespace, name, uid)."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    c.resource.create_namespaced_resource_claim("default", body)
    stored = json.loads(
        c.resource.patch_namespaced_resource_claim_status(
            name,
            "default",
            {"status": {"allocation": {"devices": {"results": results}}}},
            _content_type="application/merge-patch+json",
            _preload_content=False,
        ).data
    )
    return ("default", name, stored["metadata"]["uid"])


def share(device: str, cores: str, memory: str, **extra: Any) -> JSON:
    out = {
        "request": "gpu",
        "driver": DRIVER,
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"cores": cores, "memory": memory},
    }
    out.update(extra)
    return out


def taint_values(c: DRACluster, device: str) -> list[str]:
    s = c.slice()
    assert s is not None
    dev = next(d for d in s["spec"]["devices"] if d["name"] == device)
    return [t["value"] for t in dev.get("taints") or []]


def test_lost_gpu_keeps_its_taint_value_across_an_agent_restart(cluster: DRACluster) -> None:
    """A GPU lost while the agent runs is tainted ``lost``; the agent restarted finds it lost again at its
    start: the cause is the same, so is the taint's value, and a claim placed there tolerating
    ``lost`` (the value it was scheduled against) is still prepared."""
    assert cluster.agent is not None
    with GpuSimState(cluster.agent.state) as st:
        st.set_lost(2)
    cluster.wait_slice(lambda s: s is not None and taint_values(cluster, "gpu-2") == ["lost"])
    cluster.agent.stop()
    cluster.start_agent()
    cluster.wait_slice(lambda s: s is not None and bool(taint_values(cluster, "gpu-2")))
    assert taint_values(cluster, "gpu-2") == ["lost"]
    tolerates = {"key": f"{DRIVER}/unhealthy", "operator": "Equal", "value": "lost", "effect": "NoSchedule"}
    ref = make_claim(cluster, "diag", [share("gpu-2", "10", "1Gi", tolerations=[tolerates])])
    assert cluster.kubelet is not None
    answer = cluster.kubelet.prepare(DRIVER, [ref])
    assert answer[ref[2]]["error"] == ""


def test_prepare_whose_spec_cannot_be_written_leaves_no_claim_directory(cluster: DRACluster) -> None:
    """A Prepare whose CDI spec cannot be written (the CDI root is a file, not a directory) fails for that
    claim and leaves nothing behind: not its record, and not the directory with its vcuda.config (a directory
    without a record would, after a restart, hold every GPU until the API server is asked about it)."""
    assert cluster.kubelet is not None
    ref = make_claim(cluster, "a", [share("gpu-0", "50", "1Gi")])
    if cluster.cdi_root.exists():
        for p in cluster.cdi_root.iterdir():
            p.unlink()
        cluster.cdi_root.rmdir()
    cluster.cdi_root.write_text("not a directory\n")
    answer = cluster.kubelet.prepare(DRIVER, [ref])[ref[2]]
    assert "cannot write its files" in answer["error"] and ref[2] in answer["error"]
    assert not (cluster.vm_path / ref[2]).exists()
    cluster.cdi_root.unlink()
    other = make_claim(cluster, "b", [share("gpu-0", "100", "1Gi")])
    assert cluster.kubelet.prepare(DRIVER, [other])[other[2]]["error"] == ""  # nothing of "a" holds gpu-0


def test_a_cdi_root_that_is_a_file_stops_the_start_naming_the_flag(tmp_path: Path, start_agent: Any) -> None:
    """--cdi-root that is not a directory: no claim could ever be prepared, so the agent does not register
    and publish GPUs it cannot give; it exits 2 at start naming the flag, as for the other DRA paths."""
    root = tmp_path / "cdi-file"
    root.write_text("x\n")
    agent = start_agent("t4-x1", "--mode=dra", f"--cdi-root={root}")
    assert agent.wait(30) == 2
    assert f"--cdi-root={root}" in agent.log_text()


def test_a_missing_cdi_root_is_created_at_start(tmp_path: Path, start_agent: Any) -> None:
    root = tmp_path / "run" / "cdi"
    agent = start_agent("t4-x1", "--mode=dra", f"--cdi-root={root}")
    agent.wait_for_log("DRA driver vcuda.tencent.com", timeout=30)  # past the checks of its flags
    assert root.is_dir()


def _reboot_without_gpu(c: DRACluster, spec_file: Path, gone: int) -> None:
    """The node restarts and GPU ``gone`` is no longer enumerated: the driver numbers the GPUs after it one
    lower (minors follow the order in which the driver finds the GPUs). The agent starts again."""
    assert c.agent is not None
    c.agent.stop()
    spec = json.loads(spec_file.read_text())
    del spec["gpus"][gone]
    for i, gpu in enumerate(spec["gpus"]):
        gpu["minor"] = i
    spec["topology"] = [[0 if a == b else 30 for b in range(len(spec["gpus"]))] for a in range(len(spec["gpus"]))]
    spec_file.write_text(json.dumps(spec))
    Path(c.agent.state).unlink()  # the simulated driver's run-time state goes with the reboot
    c.start_agent()


def test_gpu_gone_at_reboot_with_the_minors_after_it_shifted(tmp_path: Path, sim_built: Path) -> None:
    """After a reboot that lost GPU 1 (not enumerated) the driver gives GPUs 2 and 3 minors 1 and 2. The
    agent keeps GPU 1's place (listed lost) and still serves: the lost GPU must not keep minor 1, which is
    GPU 2's now (two GPUs of one minor stopped the start: 'duplicate GPU minor number'). A claim prepared
    on gpu-2 before the reboot keeps gpu-2 (its /dev/nvidia1 now, its capacity charged there), and a new
    claim on gpu-2 gets /dev/nvidia1."""
    spec_file = tmp_path / "spec.json"
    spec_file.write_text((Path(__file__).parent.parent / "deploy/sim/v100-pcie-x4.json").read_text())
    with DRACluster(tmp_path / "node", spec_file, health_quiet_period="1h", status_lag=0) as c:
        assert c.kubelet is not None
        before = make_claim(c, "before", [share("gpu-2", "60", "1Gi")])
        assert c.kubelet.prepare(DRIVER, [before])[before[2]]["error"] == ""
        _reboot_without_gpu(c, spec_file, 1)
        s = c.wait_slice(lambda s: s is not None and taint_values(c, "gpu-1") == ["lost"])
        minors = {d["name"]: d["attributes"]["minor"]["int"] for d in s["spec"]["devices"]}
        assert (minors["gpu-0"], minors["gpu-2"], minors["gpu-3"]) == (0, 1, 2)
        assert minors["gpu-1"] not in (0, 1, 2)
        for name in ("gpu-0", "gpu-2", "gpu-3"):
            assert taint_values(c, name) == []

        def nodes(uid: str) -> list[str]:
            spec = json.loads((c.cdi_root / f"{DRIVER}-{uid}.json").read_text())
            return [n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]

        # the claim prepared before the reboot: gpu-2's device node now, and gpu-2's capacity
        assert c.kubelet.prepare(DRIVER, [before])[before[2]]["error"] == ""
        assert nodes(before[2]) == ["/dev/nvidia1"]
        over = make_claim(c, "over", [share("gpu-2", "50", "1Gi")])
        assert "more than the device has left" in c.kubelet.prepare(DRIVER, [over])[over[2]]["error"]
        fits = make_claim(c, "fits", [share("gpu-3", "100", "1Gi")])
        assert c.kubelet.prepare(DRIVER, [fits])[fits[2]]["error"] == ""
        assert nodes(fits[2]) == ["/dev/nvidia2"]


def test_a_driver_that_serves_no_claim_publishes_no_gpu(tmp_path: Path, sim_built: Path) -> None:
    """The slice goes out early in the start (the scheduler waits on it); when the start then fails to serve
    claims (here dra.sock cannot be bound: a directory is in its way), the GPUs must not stay offered: every
    claim placed on them would fail its Prepare for good. The slice is deleted and not published again."""
    from simnode.dra_kubelet import DRAKubeletSimulator

    c = DRACluster(tmp_path, "v100-pcie-x4", health_quiet_period="1h", status_lag=0)
    try:
        c.start_api()
        c.kubelet = DRAKubeletSimulator(
            registry_dir=c.registry_dir, api_client=c.client, node=NODE, cdi_dirs=[c.cdi_root]
        )
        c.kubelet.start()
        (c.plugin_dir / "dra.sock").mkdir(parents=True)
        agent = c.start_agent(wait=False)
        agent.wait_for_log("is not serving claims", timeout=30)
        c.wait_slice(lambda s: s is None, timeout=10)
        assert "cannot serve the DRA driver" in agent.log_text()
    finally:
        c.stop()


def test_socket_directory_replaced_by_a_file_is_said_without_traceback(cluster: DRACluster) -> None:
    """The directory of dra.sock replaced by a file: the sockets cannot be served again. The agent says so
    in one error line naming the socket and the error (no traceback each pass), and serves them again, and
    is registered again, once the directory can be made."""
    import shutil
    import time

    assert cluster.agent is not None and cluster.kubelet is not None
    before = cluster.kubelet.registrations(DRIVER)
    shutil.rmtree(cluster.plugin_dir)
    cluster.plugin_dir.write_text("not a directory\n")
    cluster.agent.wait_for_log("cannot serve the DRA sockets again", timeout=30)
    time.sleep(7)  # more passes of the watch
    log = cluster.agent.log_text()
    assert "Traceback" not in log
    assert log.count("cannot serve the DRA sockets again") == 1
    assert str(cluster.plugin_dir / "dra.sock") in log
    cluster.plugin_dir.unlink()
    cluster.kubelet.wait_registered(DRIVER, after=before, timeout=30)
