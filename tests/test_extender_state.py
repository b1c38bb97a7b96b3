"""The extender's cluster state: charges in any order, assumptions, their end, nodes coming and going."""

from __future__ import annotations

import logging
import time

import pytest

from gpumanager import names
from gpumanager.extender.charges import PodCharges, pod_charges
from gpumanager.extender.nodes import Charge
from gpumanager.extender.state import ClusterState
from simnode.apiserver_objects import node_object
from tests.extender_fixtures import GIB, gpu_pod, held, inventory


def node(name: str = "n", memory: tuple[int, ...] = (80, 80)) -> dict[str, object]:
    return node_object(name, annotations={"tencent.com/gpu-inventory": inventory(list(memory))})


def free(state: ClusterState, name: str = "n") -> list[tuple[int, int]]:
    gpus = state.node(name)
    assert gpus is not None
    return [(leaf.allocatable_cores, leaf.allocatable_memory // GIB) for leaf in gpus.tree.leaves]


def test_charges_in_any_order_leave_an_exact_tree() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    a = gpu_pod("a", [(30, 40)], node="n", annotations=held("n", [[0]]))  # 30 cores, 10 GiB
    b = gpu_pod("b", [(100, 0)], node="n", annotations=held("n", [[1]]))
    c = gpu_pod("c", [(50, 80)], node="n", annotations=held("n", [[0]]))  # 20 GiB
    for pod in (a, b, c):
        state.pod_event("ADDED", pod)
    assert free(state) == [(20, 50), (0, 0)]
    state.pod_event("DELETED", b)
    state.pod_event("DELETED", a)
    assert free(state) == [(50, 60), (100, 80)]
    gpus = state.node("n")
    assert gpus is not None and gpus.tree.leaf(1).available and not gpus.tree.leaf(0).available
    state.pod_event("DELETED", c)
    assert free(state) == [(100, 80), (100, 80)] and gpus.tree.leaf(0).available
    assert state.pod_count() == 0


def test_over_commitment_is_seen_not_hidden() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    state.pod_event("ADDED", gpu_pod("whole", [(100, 0)], node="n", annotations=held("n", [[0]])))
    state.pod_event("ADDED", gpu_pod("share", [(10, 4)], node="n", annotations=held("n", [[0]])))
    assert state.over_committed() == {"n": [0]}


def test_pods_count_where_they_are_bound_or_chosen_until_they_end() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    chosen = gpu_pod("chosen", [(40, 4)], annotations=held("n", [[1]]))  # predicate-node, no nodeName
    assert pod_charges(chosen) == PodCharges("n", (Charge(1, 40, 4 * names.MEMORY_BLOCK_BYTES),), 0, "1")
    state.pod_event("ADDED", chosen)
    assert free(state)[1][0] == 60
    unplaced = gpu_pod("unplaced", [(40, 4)], node="n")  # bound, the agent has not said which GPU yet
    state.pod_event("ADDED", unplaced)
    assert state.unplaced() == 1 and free(state)[0][0] == 100
    chosen["status"] = {"phase": "Succeeded"}
    state.pod_event("MODIFIED", chosen)
    assert free(state)[1][0] == 100


def test_an_assumption_holds_until_the_watch_shows_the_pod() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    pod = gpu_pod("p", [(60, 4)])
    uid = pod["metadata"]["uid"] = "uid-p"
    state.assume(uid, PodCharges("n", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),), 0, "777"))
    assert free(state)[0][0] == 40 and state.is_assumed(uid)
    state.pod_event("MODIFIED", pod)  # an older version of the pod: no annotations yet
    assert free(state)[0][0] == 40 and state.is_assumed(uid)
    pod["metadata"]["annotations"] = {**held("n", [[0]]), names.PREDICATE_TIME: "777"}
    state.pod_event("MODIFIED", pod)  # the watch shows what bind wrote, not bound yet
    assert state.is_assumed(uid) and free(state)[0][0] == 40
    pod["spec"]["nodeName"] = "n"
    state.pod_event("MODIFIED", pod)  # bound: its annotations carry the charge
    assert not state.is_assumed(uid) and free(state)[0][0] == 40
    state.pod_event("DELETED", pod)
    assert free(state)[0][0] == 100


def test_assumptions_expire_and_bind_failures_forget() -> None:
    state = ClusterState(assume_ttl=0.05)
    state.node_event("ADDED", node())
    state.assume("u1", PodCharges("n", (Charge(0, 100, 0),), 0, "1"))
    state.assume("u2", PodCharges("n", (Charge(1, 100, 0),), 0, "2"))
    state.assume("u3", PodCharges("n", (Charge(1, 100, 0),), 0, "3"))
    state.assumed_bound("u1", bound=False)  # the Binding got no answer: the TTL starts now
    state.forget("u2")  # bind failed
    state.assumed_bound("u3")  # bound: held until the watch shows the pod, however late
    assert free(state) == [(0, 0), (0, 0)]
    time.sleep(0.1)
    assert state.expire() == 1 and free(state) == [(100, 80), (0, 0)]


def test_a_pod_is_judged_without_its_own_charges() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    pod = gpu_pod("p", [(100, 0)], annotations=held("n", [[0]]))
    state.pod_event("ADDED", pod)
    with state.without(pod["metadata"]["uid"]):
        assert free(state)[0] == (100, 80)
    assert free(state)[0] == (0, 0)


def test_nodes_rebuilt_on_change_keep_their_pods() -> None:
    state = ClusterState()
    state.pod_event("ADDED", gpu_pod("p", [(30, 4)], node="n", annotations=held("n", [[1]])))
    state.node_event("ADDED", node())  # the node arrives after its pod
    assert free(state)[1][0] == 70
    changed = node_object("n", annotations={"tencent.com/gpu-inventory": inventory([80, 80], unhealthy=[0])})
    state.node_event("MODIFIED", changed)
    gpus = state.node("n")
    assert gpus is not None and not gpus.tree.leaf(0).healthy and free(state)[1][0] == 70
    state.node_event("DELETED", changed)
    assert state.node("n") is None
    state.node_event("ADDED", node())
    assert free(state)[1][0] == 70


def test_gpus_chosen_for_another_node_are_not_counted_where_the_pod_is_bound() -> None:
    state = ClusterState()
    state.node_event("ADDED", node())
    # Chosen for "m" by a bind whose Binding failed; then bound to "n" by someone else: the agent on
    # "n" chooses by itself, so the indices say nothing about "n" until it writes its own.
    moved = gpu_pod("moved", [(40, 4)], node="n", annotations=held("m", [[1]]) | {names.GPU_ASSIGNED: "false"})
    state.pod_event("ADDED", moved)
    assert state.unplaced() == 1 and free(state) == [(100, 80), (100, 80)]
    moved["metadata"]["annotations"].update({names.GPU_ASSIGNED: "true", f"{names.PREDICATE_GPU_IDX_PREFIX}0": "0"})
    state.pod_event("MODIFIED", moved)
    assert state.unplaced() == 0 and free(state)[0][0] == 60


def test_a_pod_chosen_for_a_node_but_never_bound_stops_holding_its_gpus(caplog: pytest.LogCaptureFixture) -> None:
    """Bind wrote the annotations, then the Binding failed and the pod stayed Pending: its GPUs are
    held for it no longer than the assume TTL, even when the watch shows it again; bound, or chosen
    again, it counts at once."""
    state = ClusterState(assume_ttl=0.05)
    state.node_event("ADDED", node())
    stuck = gpu_pod("stuck", [(100, 0)], annotations=held("n", [[0]]))
    state.pod_event("ADDED", stuck)
    assert free(state)[0] == (0, 0)
    assert state.expire() == 0 and free(state)[0] == (0, 0), "within the TTL the choice holds"
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="gpumanager.extender.state"):
        state.expire()
    assert "pod default/stuck (uid-stuck) was chosen for node n" in caplog.text
    assert free(state)[0] == (100, 80) and state.pod_count() == 0
    state.pod_event("MODIFIED", stuck)  # a status update: the same stale choice
    assert free(state)[0] == (100, 80)
    again = {**stuck, "metadata": {**stuck["metadata"], "annotations": {**held("n", [[1]]), names.PREDICATE_TIME: "2"}}}
    state.pod_event("MODIFIED", again)  # chosen again: a new predicate time
    assert free(state) == [(100, 80), (0, 0)]
    bound = {**again, "spec": {**again["spec"], "nodeName": "n"}}
    time.sleep(0.1)
    state.pod_event("MODIFIED", bound)  # the Binding landed: bound pods hold their GPUs for good
    state.expire()
    assert free(state) == [(100, 80), (0, 0)]


def _chosen(name: str, when: str, gpu: int = 0) -> dict[str, object]:
    """A pending pod carrying bind's annotations (predicate time ``when``), not bound yet."""
    return gpu_pod(name, [(60, 4)], annotations={**held("n", [[gpu]]), names.PREDICATE_TIME: when})


def test_a_binding_slower_than_the_ttl_keeps_its_charge() -> None:
    """Bind wrote the annotations and the watch shows them; the Binding takes longer than the TTL (a
    slow API server). Before, the watch ended the assumption and the unbound pod's charge lapsed after
    the TTL: a second 60-core share was let onto the same GPU before the first pod was bound there."""
    state = ClusterState(assume_ttl=0.05)
    state.node_event("ADDED", node())
    pod = _chosen("p", "777")
    uid = "uid-p"
    state.assume(uid, PodCharges("n", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),), 0, "777"))
    state.pod_event("MODIFIED", pod)  # the patch is seen; the Binding is still on its way
    time.sleep(0.1)
    assert state.expire() == 0 and state.is_assumed(uid) and free(state)[0][0] == 40
    state.assumed_bound(uid)  # the Binding was made; the watch lags behind it
    time.sleep(0.1)
    assert state.expire() == 0 and state.is_assumed(uid) and free(state)[0][0] == 40
    pod["spec"]["nodeName"] = "n"  # type: ignore[index]
    state.pod_event("MODIFIED", pod)
    assert not state.is_assumed(uid) and free(state)[0][0] == 40
    time.sleep(0.1)
    state.expire()
    assert free(state)[0][0] == 40, "a bound pod holds its GPUs for good"


def test_an_unanswered_binding_is_held_for_the_ttl_then_dropped_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = ClusterState(assume_ttl=0.05)
    state.node_event("ADDED", node())
    state.assume("uid-p", PodCharges("n", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),), 0, "777"))
    state.pod_event("MODIFIED", _chosen("p", "777"))
    state.assumed_bound("uid-p", bound=False)
    assert state.expire() == 0 and free(state)[0][0] == 40
    time.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="gpumanager.extender.state"):
        assert state.expire() == 1
    assert "its Binding got no answer" in caplog.text and "no longer held" in caplog.text
    assert free(state)[0][0] == 100


def test_a_pod_whose_bind_failed_holds_nothing_even_with_annotations_left(caplog: pytest.LogCaptureFixture) -> None:
    """The Binding was refused and the annotations could not be removed: the scheduler was told and
    places the pod anew, so that choice holds nothing (before, it held the GPU for the TTL)."""
    state = ClusterState(assume_ttl=60)
    state.node_event("ADDED", node())
    state.assume("uid-p", PodCharges("n", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),), 0, "777"))
    with caplog.at_level(logging.INFO, logger="gpumanager.extender.state"):
        state.forget("uid-p")
    assert "bind to node n failed" in caplog.text
    pod = _chosen("p", "777")
    state.pod_event("MODIFIED", pod)
    assert free(state)[0][0] == 100 and state.pod_count() == 0
    again = _chosen("p", "778", gpu=1)  # chosen anew (by gpu-admission, or a bind whose Binding is slow)
    state.pod_event("MODIFIED", again)
    assert free(state) == [(100, 80), (40, 79)]


def test_an_assumption_ends_when_the_pod_is_bound_elsewhere_or_deleted(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState(assume_ttl=60)
    state.node_event("ADDED", node())
    state.assume("uid-p", PodCharges("n", (Charge(0, 60, 4 * names.MEMORY_BLOCK_BYTES),), 0, "777"))
    state.assumed_bound("uid-p")
    elsewhere = gpu_pod("p", [(60, 4)], node="m")
    with caplog.at_level(logging.INFO, logger="gpumanager.extender.state"):
        state.pod_event("MODIFIED", elsewhere)
        assert not state.is_assumed("uid-p") and free(state)[0][0] == 100
        state.assume("uid-q", PodCharges("n", (Charge(1, 100, 0),), 0, "9"))
        state.pod_event("DELETED", gpu_pod("q", [(100, 0)]))
    assert (
        "is bound to node m, not n" in caplog.text and "it was deleted before the watch showed it bound" in caplog.text
    )
    assert free(state) == [(100, 80), (100, 80)]
