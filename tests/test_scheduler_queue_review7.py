"""The scheduler stand-in's queue: a cluster event during a pod's scheduling attempt is not lost."""

from __future__ import annotations

from simnode.apiserver import ApiServerSimulator
from simnode.multinode import pending_pod
from simnode.scheduler import SchedulerStandIn
from tests.extender_fixtures import wait_for
from tests.test_extender_review5 import CORE, MEMORY, _ready

__all__: list[str] = []


def test_a_node_turning_ready_while_the_pod_is_found_unschedulable_is_not_missed() -> None:
    """kube-scheduler remembers the cluster events of a pod's scheduling attempt: a pod found unschedulable
    after the node it needs turned Ready (while its status was being written) goes back to the queue
    after its backoff, not to the unschedulable pods that wait for the next event or 5 minutes."""
    api = ApiServerSimulator()
    api.start()
    scheduler = SchedulerStandIn(api.client(), initial_backoff=0.05, max_backoff=0.05, unschedulable_timeout=300)
    try:
        api.add_node("n", capacity={CORE: "100", MEMORY: "320"})
        api.update_node("n", lambda node: _ready(node, "False"))
        api.delay(r"/namespaces/default/pods/p/status$", 2.0, method="PATCH", count=1)  # slow to write why
        scheduler.start()
        api.create_pod(pending_pod("p", [(50, 4)]))
        wait_for(lambda: scheduler.stats.unschedulable >= 1, timeout=30, what="the pod found unschedulable")
        api.update_node("n", lambda node: _ready(node, "True"))  # during the write of the pod's status
        wait_for(lambda: scheduler.stats.scheduled == 1, timeout=30, what="the pod scheduled once the node is Ready")
    finally:
        scheduler.stop()
        api.stop()
