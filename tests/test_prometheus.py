"""The alerts and the dashboard against Prometheus itself (Debian's package: prometheus and promtool).

`promtool check rules`, `promtool test rules` (deploy/prometheus/gpu-manager.rules.test.yaml),
`promtool check metrics` on a real scrape, and a real Prometheus scraping agents on the simulated
node: every alert expression and every dashboard query is evaluated through its HTTP API and must
return series of the expected shape. `make test` installs the package when it is missing.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess, free_port
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError
from tests.agent_fixtures import gpusim

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gpu-manager.rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "gpu-manager.rules.test.yaml"
DASHBOARD = ROOT / "deploy" / "helm" / "gpu-manager" / "files" / "dashboard.json"
MIB = 1 << 20
JOB = "gpu-manager"
RENDER = runpy.run_path(str(ROOT / "scripts" / "render_manifests.py"))


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: `make test` installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (`make test` installs Debian's prometheus package)")
    return path


def test_rules_pass_promtool_check() -> None:
    done = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def test_rules_pass_their_unit_tests() -> None:
    done = subprocess.run(
        [_tool("promtool"), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _check_metrics(page: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([_tool("promtool"), "check", "metrics"], input=page, capture_output=True, text=True)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.mark.parametrize("legacy", [False, True])
def test_promtool_check_metrics_on_a_scrape(tmp_path: Path, sim_built: Path, legacy: bool) -> None:
    c = SimCluster(tmp_path, "v100-pcie-x4", agent_flags=[f"--legacy-metrics={str(legacy).lower()}"]).start()
    try:
        c.run_pod(gpu_pod("p", [("main", 30, 4)]))
        c.run_pod(gpu_pod("w", [("main", 100, 0)]))
        assert c.agent is not None
        done = _check_metrics(_scrape(c.agent.query_port))
    finally:
        c.stop()
    if legacy:  # upstream's families break the naming rules, which is why they are off by default
        assert done.returncode != 0
        assert 'container_gpu_memory_total non-counter metrics should not have "_total" suffix' in done.stderr
    else:
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_promtool_check_metrics_on_the_claim_families() -> None:
    from tests.test_metrics import claim_page

    page = claim_page()
    assert "gpu_manager_claim_gpu_core_ratio{" in page and "gpu_manager_claim_containers{" in page
    done = _check_metrics(page)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


# -- a real Prometheus ------------------------------------------------------------------------------


def node_name(index: int) -> str:
    """The ``node`` label of the ``index``-th target (each agent on a node of its own)."""
    return f"sim-node-{index}"


def operator_scrape_config(targets: list[str]) -> dict[str, Any]:
    """The scrape job the Prometheus Operator makes of the chart's ServiceMonitor for ``targets``.

    The operator's relabelings put the labels of the agent's own pod on every target (``namespace``,
    ``pod``, ``container``, ``service``, ``endpoint``; ``job`` from ``jobLabel``; the chart's ``node``,
    ``sim-node-<i>`` for the i-th target),
    and its ``honor_labels`` is the endpoint's ``honorLabels`` (false unless set): what decides whether
    the agent's ``namespace``/``pod``/``container`` labels survive or become ``exported_*``.
    """
    docs = RENDER["documents"]({"serviceMonitor": {"enabled": True}})
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    agent_pod = {
        "job": JOB,
        "namespace": monitor["metadata"]["namespace"],
        "service": "gpu-manager-metric",
        "pod": "gpu-manager-7xk2p",
        "container": "gpu-manager",
        "endpoint": endpoint["port"],
    }
    return {
        "job_name": f"serviceMonitor/{monitor['metadata']['namespace']}/{monitor['metadata']['name']}/0",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint["path"],
        "static_configs": [
            {"targets": [target], "labels": {**agent_pod, "node": node_name(i)}} for i, target in enumerate(targets)
        ],
    }


class Prometheus:
    """A Prometheus server on 127.0.0.1 scraping ``targets`` every second as the chart's ServiceMonitor
    has the Prometheus Operator scrape them, with the agent's rules."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": [str(RULES)],
            "scrape_configs": [operator_scrape_config(targets)],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def wait(self, expr: str, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``expr`` returns something."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.query(expr)
                if found:
                    return found
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} returned nothing (prometheus exit {self.proc.poll()})")
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _gpus(annotation: str) -> set[int]:
    return {int(m) for m in re.findall(r"/dev/nvidia(\d+)", annotation)}


@pytest.fixture(scope="module")
def scraped_node(tmp_path_factory: pytest.TempPathFactory, sim_built: Path) -> Iterator[dict[str, Any]]:
    """Agents and Prometheus with every alert's condition true on the simulated node.

    ``node-a``: a shared container near its memory limit, a whole-GPU pod, a GPU with an XID
    error, refused Allocate calls and a checkpoint that cannot be written. ``node-b``: an agent
    without a kubelet (never registered). ``down``: a target nothing answers on.
    """
    tmp_path = tmp_path_factory.mktemp("scraped-node")
    cluster = SimCluster(tmp_path / "a", "v100-pcie-x4", agent_flags=["--allocation-check-period=1"]).start()
    lonely = AgentProcess(tmp_path / "b", SPEC_DIR / "t4-x1.json", extra_args=["--hostname-override=node-b"])
    prometheus: Prometheus | None = None
    try:
        lonely.start()
        lonely.wait_for_log("HTTP on", timeout=30)
        assert cluster.agent is not None
        train = cluster.run_pod(gpu_pod("train", [("main", 50, 4)], namespace="ml"))
        infer = cluster.run_pod(gpu_pod("infer", [("main", 100, 0)], namespace="ml"))
        shared_gpu = min(_gpus(train.core["main"].response.annotations[names.VDEVICE_ANNOTATION]))
        used = _gpus(infer.core["main"].response.annotations[names.VDEVICE_ANNOTATION]) | {shared_gpu}
        broken_gpu = min({0, 1, 2, 3} - used)
        gpusim(
            cluster.agent, "proc", "--gpu", str(shared_gpu), "--pid", str(train.pids["main"]),
            "--used-mib", "980", "--sm-percent", "40",
        )  # fmt: skip
        node_a = f"127.0.0.1:{cluster.agent.query_port}"
        node_b = f"127.0.0.1:{lonely.query_port}"
        down = f"127.0.0.1:{free_port()}"
        prometheus = Prometheus(tmp_path, [node_a, node_b, down])
        # Counters are seen at zero before anything goes wrong, as on a real node.
        prometheus.wait(f'count_over_time(gpu_manager_kubelet_call_errors_total{{instance="{node_a}"}}[1m]) >= 2')

        gpusim(cluster.agent, "xid", "--gpu", str(broken_gpu), "--xid", "79")
        for attempt in range(3):
            with pytest.raises(KubeletSimError):
                cluster.kubelet.allocate(
                    names.VCORE_RESOURCE, 30, pod_uid=f"no-such-pod-{attempt}", container_name="c", pod_name="ghost"
                )
        checkpoint = cluster.checkpoint_dir / names.OWN_CHECKPOINT
        checkpoint.unlink()
        (checkpoint / "not-a-file").mkdir(parents=True)
        # Changes go to the journal; the agent finds the snapshot unwritable when it next writes it
        # (SIGHUP: check now), and from then on refuses new allocations until it can be written.
        assert cluster.agent is not None
        cluster.agent.signal(signal.SIGHUP)
        prometheus.wait(f'gpu_manager_checkpoint_write_failures_total{{instance="{node_a}"}} > 0')
        with pytest.raises(KubeletSimError):
            cluster.run_pod(gpu_pod("late", [("main", 10, 1)]))
        prometheus.wait(f'gpu_manager_gpu_healthy{{instance="{node_a}"}} == 0')
        time.sleep(3)  # a few more scrapes, so rates see the increments
        yield {
            "prometheus": prometheus,
            "node_a": node_a,
            "node_b": node_b,
            "down": down,
            "shared_gpu": shared_gpu,
            "broken_gpu": broken_gpu,
        }
    finally:
        if prometheus is not None:
            prometheus.stop()
        lonely.stop()
        cluster.stop()


def _rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_alert_expression_finds_its_condition(scraped_node: dict[str, Any]) -> None:
    prom: Prometheus = scraped_node["prometheus"]
    a, b = scraped_node["node_a"], scraped_node["node_b"]
    expected: dict[str, list[dict[str, str]]] = {
        "GPUManagerDown": [{"instance": scraped_node["down"], "job": JOB}],
        "GPUManagerNotRegistered": [{"instance": b, "job": JOB}],
        "GPUManagerGPUUnhealthy": [{"instance": a, "gpu": str(scraped_node["broken_gpu"])}],
        "GPUManagerAllocationRefusals": [{"instance": a, "call": "Allocate", "resource": names.VCORE_RESOURCE}],
        "GPUManagerContainerNearMemoryLimit": [
            {
                "instance": a,
                "namespace": "ml",
                "pod": "train",
                "container": "main",
                "gpu": str(scraped_node["shared_gpu"]),
            }
        ],
        "GPUManagerCheckpointWriteFailures": [{"instance": a, "job": JOB}],
        # DRA mode only (the simulated node runs the device plugin): the expression must evaluate, finding nothing.
        "GPUManagerUnprepareFailures": [],
        "GPUManagerDRAFeatureGateOff": [],
        "GPUManagerClaimNearMemoryLimit": [],
        # Every target the simulated node's Prometheus knows is there, and no kube-state-metrics.
        "GPUManagerTargetsMissing": [],
    }
    rules = _rules()
    assert {r["alert"] for r in rules} == set(expected)
    for rule in rules:
        found = prom.query(rule["expr"])
        for want in expected[rule["alert"]]:
            assert any(want.items() <= s["metric"].items() for s in found), (rule["alert"], want, found)
        assert all(s["metric"].get("job") == JOB for s in found), found
    # Prometheus evaluates them too: every rule is healthy and each alert is pending or firing.
    groups = prom.api("rules", type="alert")["groups"]
    states = {r["name"]: (r["health"], r["state"]) for g in groups for r in g["rules"]}
    assert states == {
        name: ("ok", "inactive" if not expected[name] else "firing" if "for" not in rule else "pending")
        for name, rule in ((r["alert"], r) for r in rules)
    }


_VARIABLES = {"$job": JOB, "$node": ".*", "$namespace": ".*", "$pod": ".*", "$__rate_interval": "30s"}


def _substitute(expr: str) -> str:
    for name, value in sorted(_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def test_every_dashboard_query_returns_series_of_the_expected_shape(scraped_node: dict[str, Any]) -> None:
    prom: Prometheus = scraped_node["prometheus"]
    dashboard = json.loads(DASHBOARD.read_text())
    targets = list(_targets(dashboard))
    assert len(targets) >= 15
    for title, target in targets:
        found = prom.query(_substitute(target["expr"]))
        assert found, f"{title}: {target['expr']} returned nothing"
        legend_labels = set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]))
        for series in found:
            missing = legend_labels - series["metric"].keys()
            assert not missing, f"{title}: series {series['metric']} lacks {missing} used in its legend"
            float(series["value"][1])  # a number (NaN included)
    by_title = {title: prom.query(_substitute(t["expr"])) for title, t in targets if t["refId"] == "A"}
    whole = {s["metric"]["node"]: float(s["value"][1]) for s in by_title["GPUs allocatable as whole GPUs"]}
    assert whole == {node_name(0): 1.0, node_name(1): 1.0}  # 4 GPUs: one shared, one whole, one broken
    pods = {(s["metric"]["namespace"], s["metric"]["pod"]) for s in by_title["GPU memory requested per pod"]}
    assert pods == {("ml", "train"), ("ml", "infer")}


def test_every_dashboard_variable_has_values(scraped_node: dict[str, Any]) -> None:
    prom: Prometheus = scraped_node["prometheus"]
    dashboard = json.loads(DASHBOARD.read_text())
    seen = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var
        values = prom.api(f"label/{m.group(2)}/values", **{"match[]": _substitute(m.group(1))})
        assert values, var["name"]
        seen[var["name"]] = set(values)
    assert seen["job"] == {JOB}
    assert seen["node"] == {node_name(0), node_name(1)}  # the agent that is down has no build info
    assert seen["namespace"] == {"ml"} and seen["pod"] == {"train", "infer"}


def test_the_agents_namespace_pod_and_container_labels_survive_the_operators_target_labels(
    scraped_node: dict[str, Any],
) -> None:
    prom: Prometheus = scraped_node["prometheus"]
    a = scraped_node["node_a"]
    found = prom.query(f'gpu_manager_container_gpu_memory_limit_bytes{{instance="{a}"}}')
    assert {(s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["container"]) for s in found} == {
        ("ml", "train", "main"),
        ("ml", "infer", "main"),
    }
    assert not [s for s in found if any(k.startswith("exported_") for k in s["metric"])], found
    per_pod = prom.query(f'sum by (namespace, pod) (gpu_manager_container_gpu_memory_limit_bytes{{instance="{a}"}})')
    assert {(s["metric"]["namespace"], s["metric"]["pod"]) for s in per_pod} == {("ml", "train"), ("ml", "infer")}
