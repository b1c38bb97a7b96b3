"""A DRA share claim used by several containers is limited as one (one vcuda.config, the PIDs of all
its containers in one pids.config): what they use together against the claim's limit is a series of
its own, and the near-limit alert sees a claim filled by several containers none of which is near it
alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simnode.dra_cluster import DRACluster, claim_pod, claim_template
from tests.agent_fixtures import gpusim

MIB = 1 << 20
RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "gpu-manager.rules.yaml"


def _samples(port: int, name: str) -> list[tuple[dict[str, str], float]]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = []
    for family in text_string_to_metric_families(body):
        out.extend((dict(s.labels), s.value) for s in family.samples if s.name == name)
    return out


def test_a_claim_used_by_two_containers_reports_their_use_together(tmp_path: Path, sim_built: Path) -> None:
    with DRACluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        c.add_template(claim_template("share", cores=30, memory="2Gi"))
        sleeper = ["sleep", "120"]
        pod = c.create_pod(claim_pod("duo", "share", containers=("a", "b")), commands={"a": sleeper, "b": sleeper})
        c.settle()
        uid = pod["metadata"]["uid"]
        claim = c.claim_of("duo")
        assert c.agent is not None and c.kubelet is not None
        limits = _samples(c.agent.query_port, "gpu_manager_claim_gpu_memory_bytes")
        assert len(limits) == 1
        gpu = limits[0][0]["gpu"]
        for name, mib in (("a", 1100), ("b", 900)):
            proc = c.kubelet.containers[(uid, name)].proc
            assert proc is not None
            gpusim(c.agent, "proc", "--gpu", gpu, "--pid", str(proc.pid), "--used-mib", str(mib))
        deadline = time.monotonic() + 20
        while True:
            used = _samples(c.agent.query_port, "gpu_manager_claim_gpu_memory_used_bytes")
            if (used and used[0][1] == 2000 * MIB) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert used == [
            (
                {
                    "namespace": "default",
                    "claim": claim["metadata"]["name"],
                    "claim_uid": claim["metadata"]["uid"],
                    "gpu": gpu,
                    "uuid": limits[0][0]["uuid"],
                    "share": "true",
                },
                2000.0 * MIB,
            )
        ]
        # Each container alone is under 90 % of the claim's 2 GiB; together they are at 98 %.
        used_by = _samples(c.agent.query_port, "gpu_manager_container_gpu_memory_used_bytes")
        assert {labels["container"]: value for labels, value in used_by} == {"a": 1100.0 * MIB, "b": 900.0 * MIB}


def _promtool_test(
    tmp_path: Path, series: dict[str, str], alerts: list[dict[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of the shipped rules: ``series`` (name{labels} -> values) give ``alerts``
    for GPUManagerClaimNearMemoryLimit at 10 minutes."""
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": name, "values": values} for name, values in series.items()],
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "GPUManagerClaimNearMemoryLimit", "exp_alerts": alerts}
                ],
            }
        ],
    }
    path = tmp_path / "claims.test.yaml"
    path.write_text(json.dumps(test, indent=1))  # JSON is YAML
    return subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)


_LABELS = {
    "job": "gpu-manager",
    "instance": "n1:5678",
    "namespace": "ml",
    "claim": "duo-gpu-x",
    "claim_uid": "u1",
    "gpu": "1",
    "uuid": "GPU-1",
}


def _series(name: str, share: str) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in {**_LABELS, "share": share}.items()) + "}"


def _users(count: int) -> dict[str, str]:
    """``gpu_manager_claim_containers`` of the claim: ``count`` containers of pod duo."""
    labels = {k: v for k, v in _LABELS.items() if k not in ("gpu", "uuid")}
    name = "gpu_manager_claim_containers{" + ",".join(f'{k}="{v}"' for k, v in {**labels, "pod": "duo"}.items())
    return {name + "}": f"{count}x15"}


_NO_PROMTOOL = shutil.which("promtool") is None


@pytest.mark.skipif(_NO_PROMTOOL, reason="no promtool")
def test_the_shipped_rules_alert_on_a_claim_near_its_memory_limit(tmp_path: Path) -> None:
    series = {
        _series("gpu_manager_claim_gpu_memory_used_bytes", "true"): "2097152000x15",
        _series("gpu_manager_claim_gpu_memory_bytes", "true"): "2147483648x15",
        **_users(2),
    }
    alerts = [
        {
            "exp_labels": {"severity": "warning", **_LABELS, "share": "true"},
            "exp_annotations": {
                "summary": "claim ml/duo-gpu-x is near its GPU memory limit on GPU 1",
                "description": "The containers using claim ml/duo-gpu-x use 97.66% of its GPU memory limit on "
                "GPU 1 (GPU-1) together; their next allocations will fail with out-of-memory.",
            },
        }
    ]
    done = _promtool_test(tmp_path, series, alerts)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(_NO_PROMTOOL, reason="no promtool")
def test_a_claim_under_the_ratio_is_not_alerted(tmp_path: Path) -> None:
    series = {
        _series("gpu_manager_claim_gpu_memory_used_bytes", "true"): "1000000000x15",
        _series("gpu_manager_claim_gpu_memory_bytes", "true"): "2147483648x15",
        **_users(2),
    }
    done = _promtool_test(tmp_path, series, [])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(_NO_PROMTOOL, reason="no promtool")
def test_a_whole_gpu_claim_is_not_alerted(tmp_path: Path) -> None:
    """A whole GPU has no limit enforced (as for containers), however full it is."""
    series = {
        _series("gpu_manager_claim_gpu_memory_used_bytes", "false"): "34000000000x15",
        _series("gpu_manager_claim_gpu_memory_bytes", "false"): "34359738368x15",
        **_users(2),
    }
    done = _promtool_test(tmp_path, series, [])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(_NO_PROMTOOL, reason="no promtool")
def test_a_claim_of_one_container_is_left_to_the_container_alert(tmp_path: Path) -> None:
    """One container: its own series carry the claim's limit, GPUManagerContainerNearMemoryLimit fires for it."""
    series = {
        _series("gpu_manager_claim_gpu_memory_used_bytes", "true"): "2097152000x15",
        _series("gpu_manager_claim_gpu_memory_bytes", "true"): "2147483648x15",
        **_users(1),
    }
    done = _promtool_test(tmp_path, series, [])
    assert done.returncode == 0, done.stdout + done.stderr
