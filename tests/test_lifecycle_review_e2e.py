"""A pod's life through the simulated kubelet: init containers whose device IDs it hands on in part."""

from __future__ import annotations

from pathlib import Path

import pytest

from simnode.cluster import SimCluster, gpu_pod
from tests.battery_fixtures import answered, spec_one_gpu, wait_agent_matches
from tests.test_battery_pods import _with_init


@pytest.mark.parametrize(
    ("init", "app"),
    [
        ((50, 8), [("app", 100, 0)]),  # a share, then the whole GPU: 50 of its IDs reused
        ((100, 0), [("a", 50, 8), ("b", 50, 8)]),  # the whole GPU, its IDs split between two shares
        ((60, 8), [("a", 40, 4), ("b", 40, 4)]),  # 80 cores in the end, 60 first
    ],
)
def test_init_container_ids_handed_on_in_part_on_a_one_gpu_node(
    tmp_path: Path, init: tuple[int, int], app: list[tuple[str, int, int]]
) -> None:
    """The kubelet admits such a pod on one GPU (it counts the larger of the init container and the
    others together); every Allocate is answered on that GPU and the agent charges what the kubelet does."""
    with SimCluster(tmp_path / "node", spec_one_gpu(tmp_path / "spec.json")) as cluster:
        run = cluster.run_pod(_with_init("with-init", init, app))
        assert {name: minors for name, (minors, _, _) in answered(run).items()} == {
            "warmup": (3,),
            **{name: (3,) for name, _, _ in app},
        }
        wait_agent_matches(cluster, [run])
        cluster.delete(run, wait=True)
        wait_agent_matches(cluster, [])
        again = cluster.run_pod(gpu_pod("after", [("main", 100, 0)]))  # nothing left behind
        wait_agent_matches(cluster, [again])
