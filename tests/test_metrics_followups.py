"""The alert rules (deploy/prometheus/gpu-manager.rules.yaml, rendered from the chart) under promtool."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.dra.publisher import GATES
from gpumanager.metrics.claims import FeatureGateCollector

ROOT = Path(__file__).resolve().parent.parent
RENDER = runpy.run_path(str(ROOT / "scripts" / "render_manifests.py"))
RULES = ROOT / "deploy" / "prometheus" / "gpu-manager.rules.yaml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (`make test` installs Debian's prometheus package)")
    return path


def _rules() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}


def _promtool_test(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(RULES.read_text())
    spec = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}
    (tmp_path / "test.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return subprocess.run([_promtool(), "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True)


def test_rules_file_is_rendered_and_passes_promtool_check() -> None:
    assert RULES.read_text() == RENDER["rules_yaml"](), "run python scripts/render_manifests.py"
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_failed_unprepare_calls_raise_their_own_alert(tmp_path: Path) -> None:
    rule = _rules()["GPUManagerUnprepareFailures"]
    assert "NodeUnprepareResources" in rule["expr"]
    assert "Terminating" in rule["annotations"]["description"]
    # Refused unprepare calls are not allocation refusals (containers that do not start).
    assert "NodeUnprepareResources" not in _rules()["GPUManagerAllocationRefusals"]["expr"]
    series = (
        'gpu_manager_kubelet_call_errors_total{job="gpu-manager",instance="node-a:5678",'
        'resource="gpu.example.com",call="%s"}'
    )
    done = _promtool_test(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": [
                    {"series": series % "NodeUnprepareResources", "values": "0 0 1 2 3 4 5 6 7 8 9 10"},
                    {"series": series % "NodePrepareResources", "values": "0 0 0 0 0 0 0 0 0 0 0 0"},
                    {
                        "series": series.replace("node-a", "node-b") % "NodeUnprepareResources",
                        "values": "0 0 0 0 0 0 0 0 0 0 0 0",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "3m", "alertname": "GPUManagerUnprepareFailures", "exp_alerts": []},
                    {
                        "eval_time": "8m",
                        "alertname": "GPUManagerUnprepareFailures",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "gpu-manager",
                                    "instance": "node-a:5678",
                                    "resource": "gpu.example.com",
                                    "call": "NodeUnprepareResources",
                                },
                                "exp_annotations": {
                                    "summary": "gpu-manager on node-a:5678 fails to release DRA claims",
                                    "description": (
                                        "7 NodeUnprepareResources calls for gpu.example.com failed in the last"
                                        " 10 minutes on node-a:5678: the kubelet retries them, the pods using those"
                                        " claims stay Terminating and their claims are not released (their GPUs"
                                        " stay allocated). The agent's log names each claim and the reason."
                                    ),
                                },
                            }
                        ],
                    },
                    {"eval_time": "8m", "alertname": "GPUManagerAllocationRefusals", "exp_alerts": []},
                ],
            }
        ],
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _container(family: str, pod: str, gpu: str) -> str:
    return (
        f'gpu_manager_container_gpu_{family}{{job="gpu-manager",instance="node-a:5678",namespace="ml",'
        f'pod="{pod}",container="main",gpu="{gpu}",uuid="GPU-{gpu}"}}'
    )


def test_near_memory_limit_is_for_shared_containers_only(tmp_path: Path) -> None:
    """A whole GPU has no memory limit enforced (its "limit" is the GPU's memory, which frameworks
    pre-allocate): only a share (vcuda-core below 100, core limit ratio below 1) is near a limit."""
    gib = 1 << 30
    done = _promtool_test(
        tmp_path,
        [
            {
                "interval": "1m",
                "input_series": [
                    # Shared: 30 % of GPU 0, 2 GiB, 1.9 GiB used.
                    {"series": _container("memory_used_bytes", "train", "0"), "values": f"{int(1.9 * gib)}x10"},
                    {"series": _container("memory_limit_bytes", "train", "0"), "values": f"{2 * gib}x10"},
                    {"series": _container("core_limit_ratio", "train", "0"), "values": "0.3x10"},
                    # Whole GPU 1 (16 GiB), 15.5 GiB pre-allocated by the framework.
                    {"series": _container("memory_used_bytes", "whole", "1"), "values": f"{int(15.5 * gib)}x10"},
                    {"series": _container("memory_limit_bytes", "whole", "1"), "values": f"{16 * gib}x10"},
                    {"series": _container("core_limit_ratio", "whole", "1"), "values": "1x10"},
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "6m",
                        "alertname": "GPUManagerContainerNearMemoryLimit",
                        "exp_alerts": [
                            {
                                "exp_labels": {
                                    "severity": "warning",
                                    "job": "gpu-manager",
                                    "instance": "node-a:5678",
                                    "namespace": "ml",
                                    "pod": "train",
                                    "container": "main",
                                    "gpu": "0",
                                    "uuid": "GPU-0",
                                },
                                "exp_annotations": {
                                    "summary": "ml/train container main is near its GPU memory limit",
                                    "description": (
                                        "Container main of ml/train uses 95% of its GPU memory limit on GPU 0;"
                                        " its next allocations will fail with out-of-memory."
                                    ),
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    )
    assert done.returncode == 0, done.stdout + done.stderr


_DESIRED = (
    'kube_daemonset_status_desired_number_scheduled{job="kube-state-metrics",namespace="kube-system",'
    'daemonset="gpu-manager-daemonset"}'
)
_MISSING = "GPUManagerTargetsMissing"


def _missing_case(name: str, series: dict[str, str], alerts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "alert_rule_test": [{"eval_time": "20m", "alertname": _MISSING, "exp_alerts": alerts}],
    }


def _missing_alert(value: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "exp_labels": {"severity": "critical", **labels},
        "exp_annotations": {
            "summary": "gpu-manager agents have no scrape target",
            "description": (
                f"At least {value} gpu-manager agent(s) that the DaemonSets kube-system/gpu-manager-daemonset,"
                " kube-system/gpu-manager-dra should run have had no scrape target for 10 minutes (a pod deleted"
                " and not recreated, a lost node, or no agent left at all): GPU pods on their nodes can be neither"
                " admitted nor started,"
                " and GPUManagerDown does not fire for them."
            ),
        },
    }


def test_agents_that_disappear_entirely_raise_an_alert(tmp_path: Path) -> None:
    up = 'up{job="gpu-manager",instance="%s:5678",node="%s"}'
    a, b = up % ("10.0.0.1", "node-a"), up % ("10.0.0.2", "node-b")
    done = _promtool_test(
        tmp_path,
        [
            _missing_case("healthy, kube-state-metrics present", {_DESIRED: "2x25", a: "1x25", b: "1x25"}, []),
            _missing_case("healthy, no kube-state-metrics", {a: "1x25", b: "1x25"}, []),
            _missing_case("agent pod up == 0 (GPUManagerDown's case)", {_DESIRED: "2x25", a: "1x25", b: "0x25"}, []),
            _missing_case(
                "one target gone for good", {_DESIRED: "2x25", a: "1x25", b: "1x3 _x22"}, [_missing_alert("1", {})]
            ),
            _missing_case(
                "every target gone, no kube-state-metrics",
                {a: "1x3 _x22", b: "1x3 _x22"},
                [_missing_alert("1", {"job": "gpu-manager"})],
            ),
            _missing_case(
                "every target gone, kube-state-metrics counts two",
                {_DESIRED: "2x25", a: "1x3 _x22", b: "1x3 _x22"},
                [_missing_alert("2", {})],
            ),
            _missing_case("no GPU node (the DaemonSet wants no pod)", {_DESIRED: "0x25"}, []),
            _missing_case("a target back within 10 minutes", {_DESIRED: "2x25", a: "1x25", b: "1x3 _x8 1x13"}, []),
        ],
    )
    assert done.returncode == 0, done.stdout + done.stderr


# What the node does meanwhile, in the alert of each gate the agent reports.
_GATE_CONSEQUENCE = {
    "DRAConsumableCapacity": (
        "prepares every claim as a whole GPU",
        "kube-apiserver, kube-scheduler and every kubelet",
    ),
    "DRADeviceTaints": ("leaves its unhealthy GPUs out of the slice", "kube-apiserver and kube-scheduler"),
}


def _gates_page(off: frozenset[str]) -> str:
    """The agent's gpu_manager_dra_feature_gate_off family with ``off`` seen off."""
    registry = CollectorRegistry()
    registry.register(FeatureGateCollector(lambda: off))
    return generate_latest(registry).decode()


def test_each_dra_feature_gate_the_agent_reports_off_alerts_with_what_it_costs(tmp_path: Path) -> None:
    """The series come from the agent's own collector (its family, label and gate names), with every gate
    off on one node and none on another: an alert per gate off, each saying what the node does meanwhile
    and where to turn the gate on."""
    assert set(GATES) == set(_GATE_CONSEQUENCE), "describe the new gate in GPUManagerDRAFeatureGateOff"
    series = []
    for instance, off in (("node-a:5678", set(GATES)), ("node-b:5678", set())):
        for family in text_string_to_metric_families(_gates_page(frozenset(off))):
            for sample in family.samples:
                labels = {**sample.labels, "job": "gpu-manager", "instance": instance}
                selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
                series.append({"series": f"{sample.name}{{{selector}}}", "values": f"{sample.value:g}x12"})
    assert len(series) == 2 * len(GATES)
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "alert_rule_test": [
                {"eval_time": "9m", "alertname": "GPUManagerDRAFeatureGateOff", "exp_alerts": []},
                # Expected none: promtool fails and lists the alerts that fired with their prose.
                {"eval_time": "11m", "alertname": "GPUManagerDRAFeatureGateOff", "exp_alerts": []},
            ],
        }
    ]
    done = _promtool_test(tmp_path, tests)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "time: 9m" not in out, out
    got = out.split("got:", 1)[1]
    fired = re.findall(r'Labels:\{(.*?)\}\s*Annotations:\{description="(.*?)", summary="(.*?)"\}', got)
    by_gate: dict[str, tuple[str, str]] = {}
    for labels, description, summary in fired:
        assert 'instance="node-a:5678"' in labels and 'severity="warning"' in labels, labels
        (gate,) = re.findall(r'gate="(\w+)"', labels)
        by_gate[gate] = (description, summary)
    assert set(by_gate) == set(GATES), out
    for gate, (description, summary) in by_gate.items():
        assert summary == f"gpu-manager on node-a:5678 finds DRA feature gate {gate} off"
        does, where = _GATE_CONSEQUENCE[gate]
        assert f"feature gate {gate} off" in description and does in description, description
        assert f"Turn the gate on on {where}" in description, description
