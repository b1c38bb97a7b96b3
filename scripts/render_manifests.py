"""Render the Helm chart deploy/helm/gpu-manager into the plain files for users without Helm.

    python scripts/render_manifests.py          # rewrite them
    python scripts/render_manifests.py --check  # exit 1 if one is not what the chart renders

- deploy/daemonset.yaml: the chart's default rendering (release ``gpu-manager`` in
  ``kube-system``), for ``kubectl apply``;
- deploy/prometheus/gpu-manager.rules.yaml: the chart's alerts as a Prometheus rule file.

Rendering uses Helm's own library (the ``helm-python-sdk`` package binds its Go SDK), so the
files are exactly what ``helm template`` gives.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "gpu-manager"
DAEMONSET = ROOT / "deploy" / "daemonset.yaml"
RULES = ROOT / "deploy" / "prometheus" / "gpu-manager.rules.yaml"
RELEASE = "gpu-manager"
NAMESPACE = "kube-system"
#: deploy/dra/daemonset.yaml's DaemonSet, whose agents the plain scrape job also scrapes.
DRA_DAEMONSET = "gpu-manager-dra"

# The order objects are applied in: what the DaemonSet refers to first.
_ORDER = ("serviceaccount", "rbac", "daemonset", "service", "servicemonitor", "prometheusrule", "dashboard-configmap")

DAEMONSET_HEADER = """\
# gpu-manager: everything one `kubectl apply -f deploy/daemonset.yaml` needs: the ServiceAccount,
# RBAC with exactly the calls the agent makes, the node agent DaemonSet, the headless metrics Service.
# Nodes opt in with: kubectl label node <node> nvidia-device-enable=enable
# Generated from the Helm chart deploy/helm/gpu-manager (its default values) by
# scripts/render_manifests.py; change the chart, not this file. See docs/deploying.md.
"""

RULES_HEADER = """\
# The gpu-manager alerts for a Prometheus without the Prometheus Operator (rule_files: [...]).
# Generated from the Helm chart deploy/helm/gpu-manager by scripts/render_manifests.py.
# Unit tests: promtool test rules deploy/prometheus/gpu-manager.rules.test.yaml
"""


def render(values: Mapping[str, Any] | None = None) -> dict[str, str]:
    """template file name (``daemonset.yaml``) -> rendered text, for release gpu-manager in kube-system."""
    chart = helm.Chart.load(str(CHART))
    try:
        out = chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()
    return {Path(path).name: text for path, text in out.items()}


def documents(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every object the chart renders with ``values``, in apply order."""
    rendered = render(values)
    docs: list[dict[str, Any]] = []
    for name in sorted(rendered, key=lambda n: _ORDER.index(n[:-5]) if n[:-5] in _ORDER else len(_ORDER)):
        if name.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(rendered[name]) if d]
    return docs


def _strip(text: str) -> str:
    """A template's output without Helm's leading blank lines."""
    return text.strip("\n") + "\n"


def daemonset_yaml() -> str:
    """deploy/daemonset.yaml as the chart renders it with its defaults."""
    rendered = render()
    parts = [_strip(rendered[f"{n}.yaml"]) for n in _ORDER if rendered.get(f"{n}.yaml", "").strip()]
    return DAEMONSET_HEADER + "---\n".join(parts)


def rules_yaml() -> str:
    """deploy/prometheus/gpu-manager.rules.yaml: the PrometheusRule's groups."""
    # the plain scrape job (gpu-manager.scrape.yaml) scrapes the DRA DaemonSet's agents under the same job
    rendered = render({"prometheusRule": {"enabled": True, "otherDaemonSets": [DRA_DAEMONSET]}})
    text = rendered["prometheusrule.yaml"]
    spec = text[text.index("\nspec:\n") + len("\nspec:\n") :]
    lines = [line[2:] if line.startswith("  ") else line for line in spec.splitlines()]
    return RULES_HEADER + "\n".join(lines).strip("\n") + "\n"


def main(argv: list[str]) -> int:
    wanted = {DAEMONSET: daemonset_yaml(), RULES: rules_yaml()}
    if "--check" in argv:
        stale = [str(p.relative_to(ROOT)) for p, text in wanted.items() if not p.exists() or p.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run: python scripts/render_manifests.py", file=sys.stderr)
            return 1
        return 0
    for path, text in wanted.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
