"""A container whose saved answer names a device node that reaches no GPU (or another GPU) after a
replacement while the agent was down: its record is dropped at the start (the GPU it names is not this
node's), and the kubelet's PodResources, which lists its device IDs, brings an allocation of it back a
moment later when the pod is not marked assigned yet (the agent's patch of ``tencent.com/gpu-assigned`` after
the start had not landed when the node went down), placing it by its device IDs on the GPU now at its
place. Its start must be refused the same whether it comes before that or after."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc

from gpumanager import names
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from tests.battery_fixtures import answered, gpu
from tests.test_gpu_replaced_review9 import _refusal, _restart_with, _spec


def test_start_after_podresources_rebuilt_it_is_still_refused(tmp_path: Path) -> None:
    """GPU 0 is replaced by one the driver numbers /dev/nvidia5: the saved answer's /dev/nvidia0 is no GPU."""
    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(tmp_path / "node", _spec(tmp_path / "before.json", old))
    with cluster:
        run = cluster.run_pod(gpu_pod("p0", [("main", 50, 8)], annotations=admission_annotations([[0]], 1)))
        assert answered(run)["main"][0] == (0,)
        cluster.wait_annotations(run, {names.GPU_ASSIGNED: "true"})

        def unassigned(pod: dict[str, Any]) -> None:
            pod["metadata"]["annotations"][names.GPU_ASSIGNED] = "false"

        cluster.api.update_pod("default", "p0", unassigned)
        new = dict(gpu(7, memory_mib=16384), pci_bus_id=old[0]["pci_bus_id"], minor=5)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        assert cluster.agent is not None
        cluster.agent.wait_for_log("from PodResources", timeout=30)  # the record is back before the start
        err = _refusal(cluster, run)
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        for part in (names.PRESTART_FAILED, "default/p0", "container main", old[0]["uuid"], new["uuid"]):
            assert part in err.details, (part, err.details)
        assert "/dev/nvidia0" in err.details and "/dev/nvidia5" in err.details
