"""The agent (device-plugin mode) on a simulated node whose API server misbehaves in turn: storms of 429 and
5xx, watches dropped, its resourceVersion gone back (etcd restored from a backup). Allocate answers, no pod
gets GPUs another holds, the GPUs of pods gone are given back, and no traceback reaches the log."""

from __future__ import annotations

import time
from pathlib import Path

from simnode.cluster import PodRun, SimCluster, gpu_pod
from simnode.kubelet import KubeletSimError


def _wait(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _run_until_admitted(c: SimCluster, name: str, cores: int, blocks: int, timeout: float = 90.0) -> PodRun:
    """Run a pod; an admission refused (the pod failed, as the kubelet fails it) is followed by a new pod,
    as its controller makes one, until one is admitted."""
    deadline = time.monotonic() + timeout
    for attempt in range(1000):
        try:
            return c.run_pod(gpu_pod(f"{name}-{attempt}", [("c", cores, blocks)]))
        except KubeletSimError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def test_agent_through_storms_and_a_restored_etcd(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        assert c.agent is not None
        backup = c.api.backup()
        first = _run_until_admitted(c, "first", 100, 4)
        c.api.fail_next("GET", r"^/api/v1/pods$", 429, count=4, retry_after=3600)
        c.api.fail_next("PATCH", r"/pods/", 503, count=10)
        c.api.fail_next("GET", r"^/api/v1/pods$", 500, count=5)
        c.api.close_watches(abrupt=True)
        second = _run_until_admitted(c, "second", 100, 4)
        c.api.clear_faults()
        # etcd restored: both pods vanish from the API server, which goes on from an older resourceVersion;
        # the kubelet stops what the API server no longer has.
        c.api.restore(backup)
        for run in (first, second):
            c._stop_pod(run.uid)
        _run_until_admitted(c, "whole-node", 400, 0)
        log = c.agent.log_text()
    assert "Traceback" not in log, log[-5000:]
