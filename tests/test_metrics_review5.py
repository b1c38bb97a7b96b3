"""Metrics: upstream's legacy families and the per-container families for containers the agent knows
only from its checkpoint, DRA containers before the pod list, and the page's labels."""

from __future__ import annotations

import inspect
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpumanager import names
from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
from gpumanager.api import display_pb2
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.dra import consumers, prepare, sharing
from gpumanager.metrics import legacy, usage
from gpumanager.metrics.calls import CallMetrics
from gpumanager.metrics.collector import AgentCollector
from gpumanager.metrics.containers import ContainerFamilies
from gpumanager.metrics.http import QueryServer
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage
from simnode.cluster import SimCluster, gpu_pod
from tests.test_metrics import GPUS, alloc, pod


def _unmeasured(index: int) -> DeviceUsage:
    return DeviceUsage(GPUS[index], 0, 0.0, 0.0, (), measured=False)


def test_a_container_kept_from_the_checkpoint_has_its_legacy_request_series() -> None:
    share = replace(alloc("uid-a", "main", (3,), 50, 8 * names.MEMORY_BLOCK_BYTES), namespace="ml", pod_name="train")
    listed = pod("train", "ml", "uid-a", ["main"])
    # The same container, once with its pod listed, once while the agent has only its checkpoint.
    known = legacy.render([ContainerUsage(listed, share, [_unmeasured(3)])], node="sim-node")
    kept = legacy.render([ContainerUsage(usage._standin(share), share, [_unmeasured(3)])], node="sim-node")
    assert 'container_request_gpu_utilization{container_name="main",namespace="ml",node="sim-node"' in known
    assert kept == known


def test_an_unknown_path_is_answered_404_naming_it_and_what_is_served() -> None:
    server = QueryServer(
        "127.0.0.1",
        0,
        routes={
            "/usage": lambda: display_pb2.UsageResponse(),
            "/version": lambda: display_pb2.VersionResponse(version="abc1234"),
        },
        metrics=lambda: b"",
        health=lambda: (True, {}),
    )
    server.start()
    try:
        # A pod's usage asked by UID, as if the display API had per-pod answers: it has none.
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/usage/0b1e-pod-uid?x=1", timeout=10)
        assert caught.value.code == 404
        error = json.loads(caught.value.read())["error"]
        assert "/usage/0b1e-pod-uid" in error
        for served in ("/usage", "/version", "/metrics", "/healthz", "/readyz"):
            assert served in error
    finally:
        server.stop()


def test_call_latency_buckets_reach_a_prepare_that_waits_on_a_slow_api_server() -> None:
    # A NodePrepareResources reads its claim (up to the claim read's deadline) and, for a share, the pods
    # using it (up to the pod read's deadline): one such Prepare must land in a finite bucket, or
    # histogram_quantile reports the largest finite bound however long the calls take.
    claim_read = inspect.signature(prepare.api_reader).parameters["timeout"].default
    pod_read = inspect.signature(sharing.api_pod_reader).parameters["timeout"].default
    slow = float(claim_read + pod_read)
    registry = CollectorRegistry()
    calls = CallMetrics(registry, mode="dra", driver="gpu.tencent.com")
    calls.observe("gpu.tencent.com", "NodePrepareResources", slow, True)
    labels = {"resource": "gpu.tencent.com", "call": "NodePrepareResources"}
    finite = [
        s
        for family in registry.collect()
        for s in family.samples
        if s.name.endswith("_bucket")
        and s.labels.get("le") != "+Inf"
        and all(s.labels[k] == v for k, v in labels.items())
    ]
    assert any(s.value == 1.0 for s in finite), f"{slow:g} s is past every finite bucket"


def test_the_not_registered_alert_says_what_a_dra_agent_misses() -> None:
    # gpu_manager_kubelet_registered follows the DRA driver's registration in DRA mode: the alert that
    # fires on it must not send the operator of a DRA node looking for vcuda-core and vcuda-memory.
    rules = yaml.safe_load((Path(__file__).parent.parent / "deploy/prometheus/gpu-manager.rules.yaml").read_text())
    (rule,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "GPUManagerNotRegistered"]
    assert "DRA driver" in rule["annotations"]["description"]


def test_dra_mode_does_not_report_device_plugin_devices_as_advertised() -> None:
    # A DRA agent offers its GPUs through its ResourceSlice (one device per GPU), not tencent.com/vcuda-*
    # devices: gpu_manager_advertised_devices said it offered 100 vcuda-core devices per GPU to the kubelet.
    health = SimpleNamespace(
        snapshot=lambda: {0: SimpleNamespace(healthy=True), 1: SimpleNamespace(healthy=False)},
        critical_xid_events=0,
        ignored_xid_events=0,
    )
    agent = SimpleNamespace(
        gpus=GPUS[:2],
        layout=DeviceLayout(GPUS[:2]),
        health=health,
        plugins=None,
        allocator=None,
        dra=None,  # not started yet, or its start failed
        config=SimpleNamespace(mode="dra", dra_driver_name="gpu.tencent.com"),
    )
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    advertised = {
        tuple(sorted(s.labels.items())): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "gpu_manager_advertised_devices"
    }
    assert advertised == {
        (("health", names.HEALTHY), ("resource", "gpu.tencent.com")): 1.0,
        (("health", names.UNHEALTHY), ("resource", "gpu.tencent.com")): 1.0,
    }


def test_a_dra_share_of_all_the_compute_and_part_of_the_memory_reports_its_memory_limit() -> None:
    # consumedCapacity cores=100, memory=8 GiB: a share whose memory the interceptor limits (the claim is
    # not whole). Its container's series said the whole GPU's memory was its limit.
    eight = 8 << 30
    share = ClaimDevice("gpus", "node", "gpu-2", 2, "s1", 100, eight, whole=False)
    claim = ClaimAllocation("claim-uid-1", "ml", "c1", (share,))
    trainer = {
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-t"},
        "spec": {
            "nodeName": "sim-node",
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "c1"}],
            "containers": [{"name": "main", "resources": {"claims": [{"name": "gpu"}]}}],
        },
        "status": {"phase": "Running"},
    }
    (allocation,) = consumers.container_allocations([claim], [trainer])
    u = ContainerUsage(trainer, allocation, [DeviceUsage(GPUS[2], 0, 0.0, 0.0, ())])
    lines = ContainerFamilies().render([u]).splitlines()
    limit = [line for line in lines if line.startswith("gpu_manager_container_gpu_memory_limit_bytes{")]
    assert limit == [
        'gpu_manager_container_gpu_memory_limit_bytes{namespace="ml",pod="train",container="main",gpu="2",'
        f'uuid="{GPUS[2].uuid}"}} {float(eight)!r}'
    ]


def _legacy_requests(port: int) -> dict[tuple[tuple[str, str], ...], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "container_request_gpu_memory"
    }


def _until(what: str, read: Callable[[], dict[tuple[tuple[str, str], ...], float]]) -> Any:
    deadline = time.monotonic() + 60
    while True:
        try:
            got = read()
        except OSError:  # the agent is not listening yet
            got = {}
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within 60 s")
        time.sleep(0.1)


def test_an_agent_restarted_without_the_api_server_keeps_the_legacy_request_series(
    tmp_path: Path, sim_built: Path
) -> None:
    c = SimCluster(tmp_path, "v100-pcie-x4", status_lag=0, agent_flags=["--legacy-metrics=true"]).start()
    try:
        c.run_pod(gpu_pod("train", [("main", 30, 4)], namespace="ml"))
        assert c.agent is not None
        port = c.agent.query_port
        before = _until("the container's legacy series", lambda: _legacy_requests(port))
        c.agent.stop()
        c.api.set_down(True)
        agent = c.start_agent(wait=False)
        # Its allocation comes back from the checkpoint while the pods cannot be listed: the same series.
        assert _until("the legacy series after the restart", lambda: _legacy_requests(agent.query_port)) == before
    finally:
        c.stop()
