"""The Grafana dashboard (deploy/helm/gpu-manager/files/dashboard.json) selects nodes by the ``node`` label."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "helm" / "gpu-manager" / "files" / "dashboard.json"


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return queries + [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_dashboard_selects_nodes_by_the_node_label() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert "instance" not in variables
    assert re.fullmatch(r"label_values\(.+, node\)", variables["node"]["query"]["query"])
    for query in _dashboard_queries():
        assert "instance" not in query, query
        if (query.startswith("label_values(") and query.endswith(", node)")) or "gpu_manager_build_info, job" in query:
            continue
        assert 'node=~"$node"' in query, query
    legends = [t["legendFormat"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert all("instance" not in legend for legend in legends), legends
