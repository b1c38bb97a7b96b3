"""Per-container series of running containers while the agent has no view of the pods yet (an agent
restarted while the API server cannot be reached)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from simnode.cluster import SimCluster, gpu_pod

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _wait(port: int, condition: str, check: object, timeout: float = 60.0) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        try:
            samples = _scrape(port)
        except OSError:  # the agent is not listening yet
            samples = {}
        if check(samples):  # type: ignore[operator]
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{condition}: not seen within {timeout:g} s; last scrape: {samples}")
        time.sleep(0.1)


def _family(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def test_container_series_stay_while_the_pod_list_is_not_there(tmp_path: Path, sim_built: Path) -> None:
    c = SimCluster(tmp_path, "v100-pcie-x4", status_lag=0).start()
    try:
        c.run_pod(gpu_pod("train", [("main", 30, 4)], namespace="ml"))
        assert c.agent is not None
        before = _wait(
            c.agent.query_port,
            "the container's series",
            lambda s: _family(s, "gpu_manager_container_gpu_core_limit_ratio"),
        )
        limits = _family(before, "gpu_manager_container_gpu_core_limit_ratio")
        memory = _family(before, "gpu_manager_container_gpu_memory_limit_bytes")
        labels = dict(next(iter(limits)))
        assert labels["pod"] == "train" and labels["namespace"] == "ml"
        gpu = (("gpu", labels["gpu"]), ("uuid", labels["uuid"]))
        c.agent.stop()
        c.api.set_down(True)
        agent = c.start_agent(wait=False)
        # The agent holds the container's allocation again (from its checkpoint) ...
        during = _wait(
            agent.query_port,
            "the allocation loaded",
            lambda s: s.get(("gpu_manager_gpu_core_allocated_ratio", gpu), 0) > 0,
        )
        # ... and its limits are still exported under the pod's name while the pods cannot be listed
        # (the container runs: its series vanished, and the alerts on them resolved).
        assert _family(during, "gpu_manager_container_gpu_core_limit_ratio") == limits
        assert _family(during, "gpu_manager_container_gpu_memory_limit_bytes") == memory
        # Its usage cannot be told (its container ID comes from the pod's status): absent, not 0.
        assert not _family(during, "gpu_manager_container_gpu_memory_used_bytes")
        c.api.set_down(False)
        after = _wait(
            agent.query_port,
            "the usage series once the pods are listed",
            lambda s: _family(s, "gpu_manager_container_gpu_memory_used_bytes"),
        )
        assert _family(after, "gpu_manager_container_gpu_core_limit_ratio") == limits
    finally:
        c.stop()
