"""The chart's monitoring objects: the Service's scrape annotations, the ServiceMonitor's job and the
PrometheusRule's."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RENDER = runpy.run_path(str(ROOT / "scripts" / "render_manifests.py"))


def _docs(values: dict[str, Any]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = RENDER["documents"](values)
    return docs


def _kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def test_service_is_not_annotated_for_scraping_when_a_service_monitor_scrapes_it() -> None:
    plain = _kind(_docs({}), "Service")["metadata"]["annotations"]
    assert plain["prometheus.io/scrape"] == "true"
    docs = _docs({"serviceMonitor": {"enabled": True}, "service": {"annotations": {"example.com/team": "gpu"}}})
    annotations = _kind(docs, "Service")["metadata"]["annotations"]
    assert "prometheus.io/scrape" not in annotations, annotations
    assert annotations["example.com/team"] == "gpu"
    assert _kind(docs, "ServiceMonitor")


def test_default_rendering_is_unchanged() -> None:
    assert (ROOT / "deploy" / "daemonset.yaml").read_text() == RENDER["daemonset_yaml"]()


def test_service_monitor_job_is_the_rules_job_whatever_the_release_is_called() -> None:
    for values in ({}, {"fullnameOverride": "gpu-sharing"}):
        docs = _docs({**values, "serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}})
        monitor = _kind(docs, "ServiceMonitor")
        job = _kind(docs, "DaemonSet")["metadata"]["labels"][monitor["spec"]["jobLabel"]]
        service_labels = _kind(docs, "Service")["metadata"]["labels"]
        assert service_labels[monitor["spec"]["jobLabel"]] == job
        exprs = [r["expr"] for g in _kind(docs, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
        jobs = {m for e in exprs for m in re.findall(r'job="([^"]*)"', e)}
        assert jobs == {job}, (values, jobs)
