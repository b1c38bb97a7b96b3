"""The agent's /metrics and /usage on the simulated node, with pods allocated and processes on their GPUs."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import empty_pb2

from gpumanager import buildinfo, names
from gpumanager.api import display_pb2_grpc
from simnode.cluster import SimCluster, gpu_pod
from simnode.gpusim_state import load_spec, spec_dir
from tests.agent_fixtures import gpusim
from tests.metrics_text import samples, value

CORE = names.VCORE_RESOURCE
MIB = 1 << 20
SPEC = load_spec(spec_dir() / "h100-nvlink-x8.json")


def start(tmp_path: Path, *flags: str) -> SimCluster:
    return SimCluster(tmp_path, "h100-nvlink-x8", agent_flags=["--allocation-check-period=1", *flags]).start()


@pytest.fixture
def cluster(tmp_path: Path, sim_built: Path) -> Iterator[SimCluster]:
    c = start(tmp_path)
    yield c
    c.stop()


def scrape(c: SimCluster, path: str = "/metrics") -> str:
    assert c.agent is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{c.agent.query_port}{path}", timeout=10) as r:
        return str(r.read().decode())


def metered_pods(c: SimCluster) -> tuple[int, dict[str, int]]:
    """A shared container with a process on its GPU, a second process of no container there, a whole-GPU pod."""
    run = c.run_pod(gpu_pod("metered", [("main", 50, 8), ("side", 0, 0)]))
    c.run_pod(gpu_pod("whole", [("train", 100, 0)], namespace="ml"))
    assert c.agent is not None
    gpu = int(run.core["main"].response.annotations[names.VDEVICE_ANNOTATION][-1])
    pid = run.pids["main"]
    gpusim(c.agent, "proc", "--gpu", str(gpu), "--pid", str(pid), "--used-mib", "1500", "--sm-percent", "37")
    gpusim(c.agent, "proc", "--gpu", str(gpu), "--pid", "77", "--used-mib", "999")  # not a container's
    # A process is the container's once the kubelet's status update (late, as on a real node) names it.
    c.wait_status(run)
    deadline = time.monotonic() + 20
    while pid not in {p for u in json.loads(scrape(c, "/usage"))["usage"].values() for p in _pids(u)}:
        assert time.monotonic() < deadline, "the agent never attributed the process to its container"
        time.sleep(0.1)
    # A fresh utilisation sample (NVML's samples age out of the sampler's window).
    gpusim(c.agent, "proc", "--gpu", str(gpu), "--pid", str(pid), "--used-mib", "1500", "--sm-percent", "37")
    return gpu, {"main": pid}


def _pids(usage: dict[str, object]) -> set[int]:
    stat = usage.get("stat") or {}
    assert isinstance(stat, dict)
    return {p for c in stat.values() for d in c.get("dev") or [] for p in d.get("pids") or []}


def test_metrics_for_shared_and_whole_containers(cluster: SimCluster) -> None:
    gpu, pids = metered_pods(cluster)
    text = scrape(cluster)
    got = samples(text)
    uuid = SPEC.gpus[gpu].uuid
    main = {"namespace": "default", "pod": "metered", "container": "main", "gpu": str(gpu), "uuid": uuid}
    assert value(got, "gpu_manager_container_gpu_memory_used_bytes", **main) == 1500 * MIB
    assert value(got, "gpu_manager_container_gpu_utilization_ratio", **main) == pytest.approx(0.37)
    assert value(got, "gpu_manager_container_gpu_memory_limit_bytes", **main) == 8 * 256 * MIB
    assert value(got, "gpu_manager_container_gpu_core_limit_ratio", **main) == 0.5
    whole = [labels for (name, labels) in got if name == "gpu_manager_container_gpu_core_limit_ratio"]
    (train,) = [dict(labels) for labels in whole if dict(labels)["pod"] == "whole"]
    train_gpu = SPEC.gpus[int(train["gpu"])]
    assert train["uuid"] == train_gpu.uuid and train["namespace"] == "ml"
    assert value(got, "gpu_manager_container_gpu_memory_limit_bytes", **train) == train_gpu.memory_bytes
    assert value(got, "gpu_manager_container_gpu_core_limit_ratio", **train) == 1.0

    per_gpu = {"gpu": str(gpu), "uuid": uuid}
    assert value(got, "gpu_manager_gpu_core_allocated_ratio", **per_gpu) == 0.5
    assert value(got, "gpu_manager_gpu_memory_allocated_bytes", **per_gpu) == 8 * 256 * MIB
    assert value(got, "gpu_manager_gpu_memory_used_bytes", **per_gpu) == (1500 + 999) * MIB
    assert value(got, "gpu_manager_gpu_core_allocated_ratio", gpu=train["gpu"], uuid=train["uuid"]) == 1.0
    assert value(got, "gpu_manager_gpu_memory_bytes", **per_gpu) == SPEC.gpus[gpu].memory_bytes
    assert value(got, "gpu_manager_gpu_healthy", **per_gpu) == 1.0
    assert value(got, "gpu_manager_kubelet_registered") == 1.0
    assert value(got, "gpu_manager_kubelet_call_duration_seconds_count", call="Allocate", resource=CORE) >= 2
    assert value(got, "gpu_manager_kubelet_call_errors_total", call="Allocate", resource=CORE) == 0
    assert value(got, "gpu_manager_checkpoint_writes_total") >= 2
    assert value(got, "gpu_manager_checkpoint_write_failures_total") == 0
    assert "process_resident_memory_bytes" in {name for name, _ in got}
    assert "_created" not in text and 'node="' not in text
    assert "\ncontainer_" not in text  # upstream's families only with --legacy-metrics

    usage = json.loads(scrape(cluster, "/usage"))["usage"]
    (metered,) = [u for u in usage.values() if "main" in u["stat"]]
    dev = metered["stat"]["main"]["dev"][0]
    assert dev["card_idx"] == str(gpu) and dev["pids"] == [pids["main"]] and dev["mem"] == 1500.0
    assert dev["gpu"] == 37.0
    assert metered["spec"]["main"] == {"gpu": 0.5, "mem": 2048.0}


def test_version_is_the_short_commit_as_upstream_answers_it(cluster: SimCluster) -> None:
    (build,) = [labels for name, labels in samples(scrape(cluster)) if name == "gpu_manager_build_info"]
    commit = dict(build)["commit"]
    assert commit != buildinfo.UNKNOWN  # a checkout: git knows it
    version = json.loads(scrape(cluster, "/version"))["version"]
    assert version == commit[:7]
    assert cluster.agent is not None
    with grpc.insecure_channel(f"unix://{cluster.agent.display_socket}") as ch:
        assert display_pb2_grpc.GPUDisplayStub(ch).Version(empty_pb2.Empty(), timeout=5).version == version


def test_legacy_metrics_as_upstream_wrote_them(tmp_path: Path, sim_built: Path) -> None:
    c = start(tmp_path, "--legacy-metrics")
    try:
        gpu, _ = metered_pods(c)
        text = scrape(c)
    finally:
        c.stop()

    def line(name: str, extra: str, value: str, container: str = "main", after: str = "") -> str:
        labels = f'container_name="{container}",{extra}namespace="default",node="sim-node",pod_name="metered"{after}'
        return f"{name}{{{labels}}} {value}"

    lines = set(text.splitlines())
    assert line("container_gpu_memory_total", f'gpu_memory="gpu{gpu}",', "1500") in lines
    assert line("container_gpu_memory_total", 'gpu_memory="total",', "1500") in lines
    assert line("container_gpu_utilization", f'gpu="gpu{gpu}",', "37") in lines
    assert line("container_request_gpu_utilization", "", "0.5", after=',req_of_gpu="total"') in lines
    assert line("container_request_gpu_memory", "", "2048", after=',req_of_gpu_memory="total"') in lines
    assert line("container_request_gpu_utilization", "", "0", container="side", after=',req_of_gpu="total"') in lines
    assert "# HELP container_gpu_memory_total gpu memory usage in MiB" in lines
    assert "gpu_manager_container_gpu_memory_used_bytes{" in text  # the new families stay
