"""The Helm chart deploy/helm/gpu-manager, rendered and linted with Helm's own library.

Every rendering is validated against the Kubernetes API schemas of 1.30 and 1.37
(kubernetes-validate, strict), the Prometheus Operator's kinds against their models.
deploy/daemonset.yaml and deploy/prometheus/gpu-manager.rules.yaml are the chart's renderings.
"""

from __future__ import annotations

import ast
import re
import runpy
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as monitoring

from gpumanager import cli, flagspec
from gpumanager.config import Config
from gpumanager.kube.rest import KubeRest

ROOT = Path(__file__).resolve().parent.parent
RENDER = runpy.run_path(str(ROOT / "scripts" / "render_manifests.py"))
CHART = RENDER["CHART"]
K8S_VERSIONS = ("1.30.0", "1.37.0")

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything on": {
        "image": {"repository": "registry.example.com/gpu-manager", "digest": "sha256:" + "ab" * 32},
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "prometheusRule": {"enabled": True, "gpuUnhealthyFor": "3m", "memoryNearLimitRatio": 0.95},
        "dashboard": {"enabled": True, "namespace": "monitoring"},
        "logDir": "/var/log/gpu-manager",
        "legacyMetrics": True,
        "logFormat": "json",
        "flags": {"ignored-xids": [13, 31, 79], "health-quiet-period": "10m", "sample-period": 2},
        "resources": {"limits": {"memory": "512Mi"}},
        "podAnnotations": {"example.com/owner": "gpu-team"},
        "imagePullSecrets": [{"name": "registry"}],
    },
    "whole GPUs only, own account": {
        "shareMode": False,
        "serviceAccount": {"create": False, "name": "existing"},
        "rbac": {"create": False},
        "nodeSelector": {"gpu": "true"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
        "priorityClassName": "",
        "image": {"tag": "0.1.0-rc1"},
    },
}

_OPERATOR_KINDS = {"ServiceMonitor": monitoring.ServiceMonitor, "PrometheusRule": monitoring.PrometheusRule}


def documents(values: dict[str, Any]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = RENDER["documents"](values)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _kept(given: Any, parsed: Any) -> bool:
    """Whether everything in ``given`` survived the model (which adds the CRD's defaults)."""
    if isinstance(given, dict):
        return isinstance(parsed, dict) and all(k in parsed and _kept(v, parsed[k]) for k, v in given.items())
    if isinstance(given, list):
        return isinstance(parsed, list) and len(given) == len(parsed) and all(map(_kept, given, parsed))
    return bool(given == parsed)


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_rendering_is_valid_for_kubernetes_1_30_and_1_37(name: str) -> None:
    docs = documents(VALUE_SETS[name])
    assert docs
    for doc in docs:
        what = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        model = _OPERATOR_KINDS.get(doc["kind"])
        if model is not None:
            # Every field must be one the operator's CRD defines: a round trip through its model keeps them all.
            parsed = model.model_validate(doc).model_dump(by_alias=True, mode="json")
            assert _kept(doc, parsed), what
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{what} is not valid for Kubernetes {version}: {exc}")


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_chart_lints_clean(name: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def test_operator_model_round_trip_catches_unknown_fields() -> None:
    doc = by_kind(documents(VALUE_SETS["everything on"]), "ServiceMonitor")
    doc["spec"]["endpoints"][0]["scrapeIntervall"] = "30s"
    parsed = monitoring.ServiceMonitor.model_validate(doc).model_dump(by_alias=True, mode="json")
    assert not _kept(doc, parsed)


def test_service_monitor_keeps_the_agents_namespace_pod_and_container_labels() -> None:
    (endpoint,) = by_kind(documents(VALUE_SETS["everything on"]), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # else the operator's target labels rename them exported_*


def test_deploy_daemonset_yaml_is_the_default_rendering() -> None:
    assert (ROOT / "deploy" / "daemonset.yaml").read_text() == RENDER["daemonset_yaml"](), (
        "deploy/daemonset.yaml differs from the chart: run python scripts/render_manifests.py"
    )


def test_rules_file_is_the_charts_prometheus_rule() -> None:
    assert RENDER["RULES"].read_text() == RENDER["rules_yaml"](), "run python scripts/render_manifests.py"
    # the plain scrape job also scrapes deploy/dra/daemonset.yaml's agents: their DaemonSet counts too
    values = {"prometheusRule": {"enabled": True, "otherDaemonSets": [RENDER["DRA_DAEMONSET"]]}}
    rule = by_kind(documents(values), "PrometheusRule")
    assert yaml.safe_load(RENDER["RULES"].read_text()) == rule["spec"]


def test_defaults_tolerate_gpu_taints_and_probe_readiness_on_readyz() -> None:
    docs = documents({})
    spec = by_kind(docs, "DaemonSet")["spec"]["template"]["spec"]
    taints = {(t["key"], t.get("effect")) for t in spec["tolerations"]}
    assert ("nvidia.com/gpu", "NoSchedule") in taints  # GKE's and the GPU Operator's GPU taint
    assert ("tencent.com/vcuda-core", "NoSchedule") in taints
    c = container(docs)
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {k for d in docs for k in [d["kind"]]} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Service",
    }


def test_no_log_file_unless_asked_and_then_rotated() -> None:
    c = container(documents({}))
    assert not any(a.startswith("--log-dir") for a in c["args"])
    assert "log" not in {m["name"] for m in c["volumeMounts"]}
    c = container(documents({"logDir": "/var/log/gpu-manager", "logFileMaxSize": 50}))
    assert "--log-dir=/var/log/gpu-manager" in c["args"] and "--log-file-max-size=50" in c["args"]
    assert {"name": "log", "mountPath": "/var/log/gpu-manager"} in c["volumeMounts"]


def test_image_by_tag_or_digest() -> None:
    assert container(documents({}))["image"] == "gpu-manager:0.1.0"
    assert container(documents({"image": {"repository": "r/gm", "tag": "1.2"}}))["image"] == "r/gm:1.2"
    digest = "sha256:" + "0" * 64
    assert container(documents({"image": {"repository": "r/gm", "digest": digest}}))["image"] == f"r/gm@{digest}"


def _non_default(f: flagspec.FlagField) -> Any:
    """A value unlike the flag's default, as a chart value (what YAML would hold)."""
    special = {"--vmodule": "allocator=4", "--log-backtrace-at": "allocator.py:12"}  # klog's grammars
    # a directory of its own: the chart refuses two mounts at one path (/x is --pod-resources-socket's)
    special["--display-socket"] = "/x/display/gpu-manager.sock"
    # every address only: the probes reach the pod's IP (the chart refuses another)
    special["--query-addr"] = "0.0.0.0"
    if f.flag in special:
        return special[f.flag]
    if f.spec.choices:
        return next(c for c in f.spec.choices if c != f.default)
    if isinstance(f.default, bool):
        return not f.default
    if isinstance(f.default, int):
        return f.default + 7
    if isinstance(f.default, float):
        return "90s"
    if isinstance(f.default, tuple):
        return [13, 79]
    return f"/x/{f.name}"


def test_every_agent_flag_can_be_set_from_values() -> None:
    # but --mode: the chart deploys device-plugin mode only (it refuses another, tests/test_rbac_review_mounts.py)
    fields = [f for f in flagspec.flag_fields(Config) if f.name != "mode"]
    flags = {f.flag[2:]: _non_default(f) for f in fields}
    args = container(documents({"flags": flags}))["args"]
    parsed = cli.build_parser().parse_args(cli.normalize_argv(args))
    for f in fields:
        raw = flags[f.flag[2:]]
        text = (
            ",".join(map(str, raw))
            if isinstance(raw, list)
            else str(raw).lower()
            if isinstance(raw, bool)
            else str(raw)
        )
        assert getattr(parsed, f.name) == f.spec.parse(text) != f.default, f.flag


def test_first_class_values_reach_the_agent() -> None:
    values = {"shareMode": False, "logLevel": 5, "logFormat": "json", "legacyMetrics": True, "port": 9400}
    c = container(documents(values))
    parsed = cli.build_parser().parse_args(cli.normalize_argv(c["args"]))
    assert (parsed.share_mode, parsed.v, parsed.log_format, parsed.legacy_metrics, parsed.query_port) == (
        False,
        5,
        "json",
        True,
        9400,
    )
    assert c["ports"][0]["containerPort"] == 9400


def test_dashboard_configmap_holds_the_dashboard() -> None:
    cm = by_kind(documents({"dashboard": {"enabled": True}}), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["gpu-manager.json"].strip() == (CHART / "files" / "dashboard.json").read_text().strip()


# -- RBAC: exactly the calls the agent makes ------------------------------------------------------

# Kubernetes client method -> (verb, resource). A method not listed here fails the test below:
# add it, and the RBAC rule it needs to the chart.
_CLIENT_CALLS = {
    "list_pod_for_all_namespaces": ("list", "pods"),
    "patch_namespaced_pod": ("patch", "pods"),
    "delete_namespaced_pod": ("delete", "pods"),
    "patch_node": ("patch", "nodes"),
}
# gpumanager.kube.rest.KubeRest method -> (verb, resource). Its generic ``request``/``json`` are not
# listed: a call of them outside gpumanager/kube/rest.py fails the test (give the request a method).
_REST_CALLS = {
    "list_pods": ("list", "pods"),
    "watch_pods": ("watch", "pods"),
    "patch_pod": ("patch", "pods"),
    "delete_pod": ("delete", "pods"),
    "patch_node": ("patch", "nodes"),
}
_CLIENT_METHOD = re.compile(r"^(list|watch|read|get|patch|delete|create|replace)_\w+$")
# DRA mode and the scheduler extender (deploy/extender.yaml) have their own manifests and RBAC.
_OTHER_MODES = ("gpumanager/dra/", "gpumanager/extender/")
_REST_METHODS = {name for name in vars(KubeRest) if not name.startswith("_")}


def _calls_in_code() -> set[tuple[str, str]]:
    needed: set[tuple[str, str]] = set()
    for path in sorted((ROOT / "gpumanager").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("gpumanager/api/", *_OTHER_MODES)):
            continue
        text = path.read_text()
        if "kubernetes" not in text and "CoreV1Api" not in text and "KubeRest" not in text:
            continue
        uses_rest = "KubeRest" in text and rel != "gpumanager/kube/rest.py"
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name = node.func.attr
            if uses_rest and name in _REST_METHODS:
                owner = ast.unparse(node.func.value)
                assert name in _REST_CALLS, f"{rel}:{node.lineno}: {owner}.{name}: add it to the RBAC and this table"
                needed.add(_REST_CALLS[name])
                continue
            if not _CLIENT_METHOD.match(name):
                continue
            owner = ast.unparse(node.func.value)
            if "core" not in owner.lower() and "CoreV1Api" not in owner:
                continue
            assert name in _CLIENT_CALLS, f"{rel}:{node.lineno}: {owner}.{name}: add it to the RBAC and this table"
            needed.add(_CLIENT_CALLS[name])
            if any(k.arg == "watch" for k in node.keywords):
                needed.add(("watch", _CLIENT_CALLS[name][1]))
    return needed


def test_rbac_grants_exactly_what_the_agent_calls() -> None:
    (role,) = [d for d in documents({}) if d["kind"] == "ClusterRole"]
    granted = {(verb, res) for rule in role["rules"] for res in rule["resources"] for verb in rule["verbs"]}
    assert all(rule["apiGroups"] == [""] for rule in role["rules"])
    assert granted == _calls_in_code()
