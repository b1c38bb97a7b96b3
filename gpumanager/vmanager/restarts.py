"""A restarted container's new cgroup, before its pod's status names the new container ID.

A container that restarts gets a new ID and a new cgroup; the kubelet's status update naming the new ID
reaches the API server a second or two later, and meanwhile the status names the old ID, whose cgroup
is gone. Its new processes must be held to its limits all the same (their pids.config), so the new
cgroup is told apart below the pod's: one that no status names and that was not there when the pod's
cgroup was first seen (:meth:`CgroupLocator.new_below_pod`; the sandbox's was). It is taken only when
nothing else can be it: exactly one such cgroup, and of the pod's containers that may run
(:func:`podinfo.may_run`, ephemeral ones too), this one alone without a cgroup of the ID its status
names (or without an ID yet). Two containers restarting at once, or one of them without a GPU, or a
``kubectl debug`` container starting meanwhile, get nothing until the status says.
"""

from __future__ import annotations

from pathlib import Path

from gpumanager import safenames
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from gpumanager.vmanager.cgroups import CgroupLocator, pids_under


def settle(locator: CgroupLocator, pod: Pod) -> None:
    """Right after a look at one of the pod's containers' cgroups: when that look saw the pod's cgroup for
    the first time, tell the locator which of its entries the pod's statuses do not name (its sandbox's,
    :meth:`CgroupLocator.settle`). A look at an empty set otherwise."""
    uid = podinfo.uid(pod)
    if locator.unsettled(uid):
        locator.settle(uid, set(podinfo.container_ids(pod, ephemeral=True).values()))


def new_cgroup(locator: CgroupLocator, pod: Pod, container: str) -> tuple[str, Path] | None:
    """The container ID and cgroup directory of ``container``'s new cgroup, when it restarted and its
    pod's status still names the old ID (whose cgroup the caller found gone); None when it cannot be told."""
    uid = podinfo.uid(pod)
    if not locator.watches(uid):
        return None
    may_run = podinfo.may_run(pod)
    if may_run is None or container not in may_run:
        return None
    ids = podinfo.container_ids(pod, ephemeral=True)
    below = locator.new_below_pod(uid, set(ids.values()))
    if below is None:
        return None
    missing, new = below
    if len(new) != 1:
        return None
    owners = [name for name in may_run if ids.get(name, "") in missing or not ids.get(name)]
    if owners != [container]:
        return None
    new_id, directory = new[0]
    try:
        safenames.container_id(new_id)
    except safenames.UnsafeNameError:
        return None
    return new_id, directory


def container_pids(locator: CgroupLocator, pod: Pod, container: str) -> list[int]:
    """Host PIDs of ``container`` of ``pod``: of the cgroup of the ID its status names, or, when that one
    is gone, of its new one (:func:`new_cgroup`); empty when there is none."""
    uid = podinfo.uid(pod)
    cid = podinfo.container_ids(pod).get(container)
    if not cid:
        return []
    pids = locator.pids(uid, cid, podinfo.qos_class(pod))
    settle(locator, pod)
    if pids or locator.located(uid, cid):
        return pids
    found = new_cgroup(locator, pod, container)
    return pids_under(found[1]) if found is not None else []
