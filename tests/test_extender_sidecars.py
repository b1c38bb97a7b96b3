"""GPU init containers: sidecars (``restartPolicy: Always``) hold their GPUs beside the app containers;
ordinary init containers run alone before them. Every GPU container the agent asks about is named."""

from __future__ import annotations

from gpumanager.extender.charges import pod_charges
from gpumanager.extender.nodes import Charge
from gpumanager.extender.state import ClusterState
from simnode.apiserver_objects import node_object
from tests.extender_fixtures import BLOCK, PREFIX, World, gpu_pod, held, inventory, with_inits, world

__all__ = ["world"]


def test_a_sidecar_is_charged_beside_the_app_container(world: World) -> None:
    """One 80 GiB GPU; a pod whose sidecar asks 50 cores and app container 50 cores fills it. Before,
    only the app container was charged, and a third 50-core share was let onto the full GPU."""
    world.add_node("n", inventory([80]))
    world.start_extender()
    pod = world.create(with_inits(gpu_pod("p", [(50, 8)]), [("proxy", 50, 8, True)]))
    assert world.passed(pod) == ["n"]
    assert world.bind(pod, "n") == ""
    annotations = world.annotations(pod)
    # The agent asks for an init container under its negative index (-1: the first init container).
    assert annotations[f"{PREFIX}0"] == "0" and annotations[f"{PREFIX}-1"] == "0", annotations
    world.wait_seen(1)
    gpus = world.extender.state.node("n")
    assert gpus is not None and gpus.tree.leaf(0).allocatable_cores == 0
    other = world.create(gpu_pod("q", [(50, 8)]))
    answer = world.filter(other)
    assert answer["FailedNodes"] and "n" in answer["FailedNodes"], answer
    assert "no longer fits" in world.bind(other, "n")
    assert world.extender.state.over_committed() == {}


def test_a_sidecar_that_does_not_fit_beside_the_app_container_is_refused(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender()
    pod = world.create(with_inits(gpu_pod("p", [(60, 8)]), [("proxy", 50, 8, True)]))
    answer = world.filter(pod)
    reason = answer["FailedAndUnresolvableNodes"]["n"]  # even the empty GPU cannot hold both
    # The sidecar is placed first (the kubelet allocates init containers first): the app has no room.
    assert "container 'c0' needs 60 cores" in reason and "no GPU has 60 free cores" in reason, answer
    answer = world.filter(world.create(with_inits(gpu_pod("p2", [(0, 0)]), [("proxy", 110, 8, True)])))
    assert "sidecar 'proxy': 110 tencent.com/vcuda-core" in answer["FailedAndUnresolvableNodes"]["n"], answer
    assert "no longer fits" in world.bind(pod, "n")
    # A pod whose only GPU container is a sidecar is placed, named and charged as well.
    only = world.create(with_inits(gpu_pod("only", [(0, 0)]), [("setup", 30, 4, False), ("proxy", 40, 4, True)]))
    assert world.bind(only, "n") == ""
    annotations = world.annotations(only)
    assert annotations[f"{PREFIX}-2"] == "0" and annotations[f"{PREFIX}-1"] == "0", annotations
    world.wait_seen(1)
    gpus = world.extender.state.node("n")
    assert gpus is not None and gpus.tree.leaf(0).allocatable_cores == 60


def test_ordinary_init_containers_are_named_and_charged_as_the_agent_counts_them(world: World) -> None:
    """An init container runs before the others and ends: it is named (so the agent places it where
    it fits beside the sidecar and the app container); the agent keeps its charge while the pod runs
    (on each GPU, the larger of it and the pod's other containers there), and so does the extender."""
    world.add_node("n", inventory([80, 80]))
    world.start_extender()
    pod = world.create(with_inits(gpu_pod("p", [(50, 8)]), [("setup", 60, 8, False), ("proxy", 50, 8, True)]))
    assert world.bind(pod, "n") == ""
    annotations = world.annotations(pod)
    sidecar, app, init = annotations[f"{PREFIX}-2"], annotations[f"{PREFIX}0"], annotations[f"{PREFIX}-1"]
    assert sidecar == app == "0" and init == "1", annotations  # binpack: sidecar and app share GPU 0
    world.wait_seen(1)
    gpus = world.extender.state.node("n")
    assert gpus is not None
    assert [leaf.allocatable_cores for leaf in gpus.tree.leaves] == [0, 40]


def test_charges_read_a_sidecar_from_its_negative_index() -> None:
    """The second init container is ``predicate-gpu-idx--2``; a sidecar holds what it names, an
    ordinary init container what it names beyond the pod's other containers on that GPU."""
    annotations = held("n", [[1]]) | {f"{PREFIX}-1": "0", f"{PREFIX}-2": "1"}
    pod = with_inits(
        gpu_pod("p", [(30, 4)], node="n", annotations=annotations),
        [("setup", 20, 4, False), ("proxy", 40, 8, True)],
    )
    charges = pod_charges(pod)
    assert charges is not None and charges.unplaced == 0
    assert sorted(charges.charges, key=lambda c: c.cores) == [
        Charge(0, 20, 4 * BLOCK),
        Charge(1, 30, 4 * BLOCK),
        Charge(1, 40, 8 * BLOCK),
    ]
    state = ClusterState()
    state.node_event("ADDED", node_object("n", annotations={"tencent.com/gpu-inventory": inventory([80, 80])}))
    state.pod_event("ADDED", pod)
    gpus = state.node("n")
    assert gpus is not None and [leaf.allocatable_cores for leaf in gpus.tree.leaves] == [80, 30]
    # A sidecar without an annotation (gpu-admission names spec.containers only) is unplaced.
    del pod["metadata"]["annotations"][f"{PREFIX}-2"]
    later = pod_charges(pod)
    assert later is not None and later.unplaced == 1
    assert later.charges == (Charge(1, 30, 4 * BLOCK), Charge(0, 20, 4 * BLOCK))
