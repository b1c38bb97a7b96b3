"""The extender counts a pod's ordinary GPU init containers as the agent and the kubelet do: on each GPU,
the larger of its init containers and its other containers, for as long as the pod runs."""

from __future__ import annotations

from gpumanager.extender.charges import pod_charges
from gpumanager.extender.nodes import Charge
from gpumanager.extender.state import ClusterState
from simnode.apiserver_objects import node_object
from tests.extender_fixtures import BLOCK, PREFIX, World, gpu_pod, held, inventory, with_inits, world

__all__ = ["world"]


def test_a_whole_gpu_init_container_keeps_its_gpu_for_the_pod(world: World) -> None:
    """Two GPUs; a pod whose init container takes one whole and whose app container asks 30 cores of the
    other. The agent keeps the init container's whole GPU charged until the pod ends (as the kubelet keeps
    its devices counted): a pod asking for a whole GPU must not be predicted onto this node."""
    world.add_node("n", inventory([80, 80]))
    world.start_extender()
    pod = world.create(with_inits(gpu_pod("p", [(30, 4)]), [("setup", 100, 0, False)]))
    assert world.bind(pod, "n") == ""
    annotations = world.annotations(pod)
    assert annotations[f"{PREFIX}0"] == "0" and annotations[f"{PREFIX}-1"] == "1", annotations
    world.wait_seen(1)
    gpus = world.extender.state.node("n")
    assert gpus is not None
    assert [leaf.allocatable_cores for leaf in gpus.tree.leaves] == [70, 0]
    other = world.create(gpu_pod("q", [(100, 0)]))
    answer = world.filter(other)
    assert answer["FailedNodes"] and "n" in answer["FailedNodes"], answer
    assert world.extender.state.over_committed() == {}


def test_charges_count_the_larger_of_init_and_other_containers_per_gpu() -> None:
    """Shares: init 60 cores/8 blocks and app 30 cores/4 blocks on GPU 1 hold 60 cores/8 blocks there; an
    init container alone on GPU 0 holds its own share."""
    annotations = held("n", [[1]]) | {f"{PREFIX}-1": "1", f"{PREFIX}-2": "0"}
    pod = with_inits(
        gpu_pod("p", [(30, 4)], node="n", annotations=annotations),
        [("setup", 60, 8, False), ("fetch", 20, 2, False)],
    )
    charges = pod_charges(pod)
    assert charges is not None and charges.unplaced == 0
    by_gpu: dict[int, tuple[int, int]] = {}
    for c in charges.charges:
        cores, memory = by_gpu.get(c.minor, (0, 0))
        by_gpu[c.minor] = (cores + c.cores, memory + c.memory)
    assert by_gpu == {0: (20, 2 * BLOCK), 1: (60, 8 * BLOCK)}, charges
    state = ClusterState()
    state.node_event("ADDED", node_object("n", annotations={"tencent.com/gpu-inventory": inventory([80, 80])}))
    state.pod_event("ADDED", pod)
    gpus = state.node("n")
    assert gpus is not None and [leaf.allocatable_cores for leaf in gpus.tree.leaves] == [80, 40]
    assert Charge(1, 30, 4 * BLOCK) in charges.charges
