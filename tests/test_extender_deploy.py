"""The extender's manifests and scheduler configurations say what the extender needs and serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumanager import names
from gpumanager.extender.cli import build_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} documents"
    return found[0]


def test_extender_manifest_rbac_and_command() -> None:
    docs = documents(DEPLOY / "extender.yaml")
    rules = {(tuple(r["resources"]), tuple(r["verbs"])) for r in by_kind(docs, "ClusterRole")["rules"]}
    assert rules == {
        (("pods",), ("get", "list", "watch", "patch")),
        (("pods/binding",), ("create",)),
        (("nodes",), ("get", "list", "watch", "patch")),
    }
    deployment = by_kind(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    budget = by_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/opt/gpu-manager/bin/gpu-manager-extender"]
    parsed = build_parser().parse_args(container["args"])  # the flags exist and parse
    assert (parsed.listen, parsed.policy, parsed.url_prefix) == (":3456", "binpack", "/scheduler")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    service = by_kind(docs, "Service")
    assert service["spec"]["ports"][0]["port"] == 3456


@pytest.mark.parametrize("name", ["default-scheduler.yaml", "gpu-scheduler.yaml"])
def test_scheduler_configurations(name: str) -> None:
    config = documents(DEPLOY / "scheduler" / name)[0]
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["kind"] == "KubeSchedulerConfiguration"
    (ext,) = config["extenders"]
    assert ext["urlPrefix"].endswith(":3456/scheduler")
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    assert ext["nodeCacheCapable"] is False and ext["ignorable"] is False and ext["httpTimeout"] == "10s"
    assert ext["managedResources"] == [
        {"name": names.VCORE_RESOURCE, "ignoredByScheduler": False},
        {"name": names.VMEMORY_RESOURCE, "ignoredByScheduler": False},
    ]


def test_second_scheduler_runs_the_shipped_configuration() -> None:
    docs = documents(DEPLOY / "gpu-scheduler.yaml")
    config_map = by_kind(docs, "ConfigMap")
    assert config_map["data"]["config.yaml"] == (DEPLOY / "scheduler" / "gpu-scheduler.yaml").read_text()
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    assert config["profiles"] == [{"schedulerName": "gpu-scheduler"}]
    assert config["leaderElection"]["resourceName"] == "gpu-scheduler"
    container = by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "--config=/etc/gpu-scheduler/config.yaml" in container["command"]
