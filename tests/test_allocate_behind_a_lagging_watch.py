"""The kubelet admits a pod as soon as its own watch shows it; ours may lag. GetPreferredAllocation then
finds the pod in a list asked of the API server, and the Allocate and PreStartContainer that follow use that
list while the pod cache knows nothing newer: one list per admission, not three."""

from __future__ import annotations

import time
from pathlib import Path

from simnode.apiserver_faults import RequestRecord
from simnode.cluster import SimCluster, gpu_pod
from tests.test_kubelet_checkpoint_lost_review12 import _usage


def _pod_lists(requests: list[RequestRecord]) -> list[RequestRecord]:
    return [
        r
        for r in requests
        if r.method == "GET" and r.path == "/api/v1/pods" and r.query.get("watch") not in ("true", "1")
    ]


def test_the_calls_of_one_admission_behind_a_lagging_watch_list_the_pods_once(tmp_path: Path, sim_built: Path) -> None:
    with SimCluster(tmp_path, "v100-pcie-x4", status_lag=0) as c:
        assert c.agent is not None
        c.api.hold_watches(True)  # the agent's pod cache does not see the pods below
        runs = []
        try:
            for i in range(3):
                c.api.clear_requests()
                runs.append(c.run_pod(gpu_pod(f"late{i}", [("main", 30, 4)])))
                lists = _pod_lists(c.api.requests)
                assert len(lists) == 1, [(r.path, dict(r.query)) for r in lists]
        finally:
            c.api.hold_watches(False)
        deadline = time.monotonic() + 20
        while len(usage := _usage(c)) < len(runs) and time.monotonic() < deadline:
            time.sleep(0.05)
        for run in runs:  # each pod's own allocation
            cards, gpus = usage[(run.uid, "main")]
            assert len(cards) == 1 and gpus == 0.3, usage
