"""The DRA driver's kubelet calls: their series from the start, and refused ones alerting."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.metrics.calls import CallMetrics
from gpumanager.metrics.textformat import FamilyText

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "gpu-manager.rules.yaml"
SERIES = (
    'gpu_manager_kubelet_call_errors_total{job="gpu-manager",instance="n1:5678",'
    'resource="gpu.tencent.com",call="NodePrepareResources"}'
)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_dra_call_series_exist_from_the_start() -> None:
    """The DRA driver's calls (resource = the driver's name) have their series from the start, as the
    device-plugin calls have: an error counter that appears at its first error hides it from increase()."""
    registry = CollectorRegistry()
    CallMetrics(registry, mode="dra", driver="gpu.tencent.com")
    samples = _samples(FamilyText().render(registry.collect()))
    for call in ("NodePrepareResources", "NodeUnprepareResources"):
        labels = (("call", call), ("resource", "gpu.tencent.com"))
        assert samples[("gpu_manager_kubelet_call_errors_total", labels)] == 0.0
        assert samples[("gpu_manager_kubelet_call_duration_seconds_count", labels)] == 0.0
    # No device-plugin series in DRA mode: they would never move.
    assert not any(dict(labels).get("call") == "Allocate" for _, labels in samples)


def test_device_plugin_call_series_unchanged() -> None:
    registry = CollectorRegistry()
    CallMetrics(registry)
    samples = _samples(FamilyText().render(registry.collect()))
    calls = {dict(labels).get("call") for name, labels in samples if name == "gpu_manager_kubelet_call_errors_total"}
    assert calls == {"Allocate", "PreStartContainer"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_refused_dra_prepare_alerts(tmp_path: Path) -> None:
    """GPUManagerAllocationRefusals only looked at Allocate and PreStartContainer: a DRA node refusing
    NodePrepareResources (its pods never start) never alerted."""
    test = tmp_path / "dra.test.yaml"
    test.write_text(
        textwrap.dedent(
            f"""\
            rule_files: [{RULES}]
            evaluation_interval: 1m
            tests:
              - interval: 1m
                input_series:
                  - series: '{SERIES}'
                    values: '0 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15'
                alert_rule_test:
                  - eval_time: 10m
                    alertname: GPUManagerAllocationRefusals
                    exp_alerts: []
            """
        )
    )
    result = subprocess.run(["promtool", "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    # Expected no alert: promtool fails and lists the alert that fired (its annotations are prose).
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    got = out.split("got:", 1)[1]
    assert 'call="NodePrepareResources"' in got and 'alertname="GPUManagerAllocationRefusals"' in got, out


def test_dra_agent_scrape_registered_and_prepare_series(tmp_path: Path, sim_built: Path) -> None:
    """A real DRA-mode agent: registered with the kubelet (as a DRA driver) says 1, and its prepare
    calls are counted under the driver's name; promtool accepts the page."""
    import urllib.request

    from simnode.dra_cluster import DRIVER, DRACluster, claim_pod, claim_template

    with DRACluster(tmp_path / "node", "t4-x1") as cluster:
        cluster.add_template(claim_template("c30", cores=30, memory="4Gi"))
        cluster.create_pod(claim_pod("p30", "c30"))
        cluster.settle()
        assert cluster.agent is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.agent.query_port}/metrics", timeout=5) as resp:
            page = resp.read().decode()
    samples = _samples(page)
    assert samples[("gpu_manager_kubelet_registered", ())] == 1.0
    assert samples[("gpu_manager_kubelet_registrations_total", ())] >= 1.0
    prepare = (("call", "NodePrepareResources"), ("resource", DRIVER))
    assert samples[("gpu_manager_kubelet_call_duration_seconds_count", prepare)] >= 1.0
    assert samples[("gpu_manager_kubelet_call_errors_total", prepare)] == 0.0
    unprepare = (("call", "NodeUnprepareResources"), ("resource", DRIVER))
    assert samples[("gpu_manager_kubelet_call_errors_total", unprepare)] == 0.0
    if shutil.which("promtool") is not None:
        done = subprocess.run(["promtool", "check", "metrics"], input=page, capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
