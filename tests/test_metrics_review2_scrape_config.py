"""A scrape job for Prometheus without the Operator, matching the shipped alerts and the Services."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SCRAPE = REPO / "deploy" / "prometheus" / "gpu-manager.scrape.yaml"
RULES = REPO / "deploy" / "prometheus" / "gpu-manager.rules.yaml"
MANIFESTS = (REPO / "deploy" / "daemonset.yaml", REPO / "deploy" / "dra" / "daemonset.yaml")


def _job() -> dict[str, Any]:
    assert SCRAPE.exists(), "no scrape job for a Prometheus without the Operator"
    jobs = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    assert len(jobs) == 1
    job: dict[str, Any] = jobs[0]
    return job


def _metric_services() -> list[tuple[str, str, str]]:
    """(namespace, name, port name) of each agent metrics Service the plain manifests create."""
    out = []
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Service":
                for port in doc["spec"]["ports"]:
                    out.append((doc["metadata"]["namespace"], doc["metadata"]["name"], port["name"]))
    return out


def test_scrape_job_gives_the_job_the_alerts_select() -> None:
    """The alerts select job="gpu-manager"; an annotation-based scrape (prometheus.io/scrape on the
    Services) names the job after its own scrape config, so none of them could ever fire."""
    jobs_in_rules = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    assert jobs_in_rules == {_job()["job_name"]}


def test_scrape_job_keeps_the_agents_labels_and_adds_the_node() -> None:
    job = _job()
    assert job["honor_labels"] is True  # else namespace/pod/container arrive as exported_*
    assert job["metrics_path"] == "/metrics"
    assert any(
        r.get("target_label") == "node" and r.get("source_labels") == ["__meta_kubernetes_pod_node_name"]
        for r in job["relabel_configs"]
    )


def test_scrape_job_finds_both_agents_services() -> None:
    job = _job()
    sd = job["kubernetes_sd_configs"]
    assert len(sd) == 1
    namespaces = set(sd[0]["namespaces"]["names"])
    keep = next(r for r in job["relabel_configs"] if r.get("action") == "keep")
    sources = keep["source_labels"]
    assert sources[0] == "__meta_kubernetes_service_name"
    for namespace, name, port in _metric_services():
        assert namespace in namespaces
        assert re.fullmatch(keep["regex"], f"{name};{port}"), (name, port)
    assert not re.fullmatch(keep["regex"], "gpu-manager-extender;http")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_job_with_the_rules(tmp_path: Path) -> None:
    # Debian's promtool (the one CI installs) is built without Kubernetes discovery: the rest of the job
    # (relabelling, honor_labels, intervals) is checked with a static target in its place.
    job = _job()
    assert job.pop("kubernetes_sd_configs")[0]["role"] == "endpointslice"
    job["static_configs"] = [{"targets": ["127.0.0.1:5678"]}]
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"scrape_configs": [job], "rule_files": [str(RULES)]}))
    done = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
