"""Restarts nobody notices: the kubelet's, the agent's, a crash, at awkward moments."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import journal
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from simnode.cluster import SimCluster, gpu_pod
from simnode.kubelet import PluginRPCError


def _reregistered(c: SimCluster, since: float) -> None:
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        c.kubelet.wait_for_registration(resource, since=since, timeout=30, with_devices=True)


def _mapping(c: SimCluster) -> dict[str, Any]:
    document = journal.read_document(c.checkpoint_dir / names.OWN_CHECKPOINT) or {}
    return dict(document.get("PodGPUMapping") or {})


@pytest.mark.parametrize("lost_slice", [slice(-50, None), slice(25, 75)], ids=["disjoint", "overlapping"])
def test_kubelet_restart_during_allocate_then_new_ids(tmp_path: Path, sim_built: Path, lost_slice: slice) -> None:
    """The kubelet restarts while our Allocate answer is on its way: it never records it, re-admits the pod
    and asks again, with other IDs. The container is allocated anew (its first, lost answer freed), not
    refused as 'candidate pod not found' (which fails the pod's admission)."""
    with SimCluster(tmp_path, "v100-pcie-x4") as c:
        pod = c.create(gpu_pod("p1", [("main", 50, 4)]))
        uid = pod["metadata"]["uid"]
        healthy = sorted(c.kubelet.healthy_ids(names.VCORE_RESOURCE), key=lambda s: int(s.rsplit("-", 1)[1]))
        lost = healthy[lost_slice]  # the kubelet then fills from the lowest: other IDs, or some of these
        ep = c.kubelet._endpoints[names.VCORE_RESOURCE]
        request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=lost)])
        ep.stub.Allocate(request, timeout=10)  # answered; the kubelet dies before recording it
        since = time.monotonic()
        c.kubelet.restart()
        _reregistered(c, since)
        run = c.admit(pod, create=False)  # raised PluginRPCError: candidate pod not found
        again = run.core["main"].device_ids
        assert set(again) != set(lost)
        assert run.core["main"].response.annotations[names.VCORE_RESOURCE] == "50"
        c.start_containers(run)
        entries = _mapping(c)
        assert list(entries) == [uid]
        assert sorted(entries[uid]) == ["main"]
        assert sorted(entries[uid]["main"]["DeviceIDs"]) == sorted(again)


def test_stop_while_the_checkpoint_is_being_loaded_keeps_it(tmp_path: Path, sim_built: Path) -> None:
    """SIGTERM while the start is still loading the checkpoint: the stop must not write the state it has
    not loaded yet (empty) over the snapshot, nor remove the journal."""
    with SimCluster(tmp_path, "v100-pcie-x4") as c:
        run = c.run_pod(gpu_pod("p1", [("main", 50, 4)]))
        assert list(_mapping(c)) == [run.uid]
        agent = c.agent
        assert agent is not None
        assert agent.stop() == 0
        again = c.start_agent(wait=False, env={"GPU_MANAGER_STALL_AT": "recovery:3"})
        again.wait_for_log("stalling 3 s at recovery", timeout=30)
        again.signal(signal.SIGTERM)
        again.wait(timeout=20)
        assert list(_mapping(c)) == [run.uid]


def test_a_pod_marked_assigned_does_not_take_an_unstarted_containers_place(tmp_path: Path, sim_built: Path) -> None:
    """An Allocate no waiting container explains, while a pending pod already marked gpu-assigned=true asks
    for that many cores: that pod may be the one asking, so the request is refused as before, and the
    unstarted container holding an allocation of that size keeps it."""
    with SimCluster(tmp_path, "v100-pcie-x4") as c:
        p = c.admit(gpu_pod("p1", [("main", 50, 4)]))
        before = _mapping(c)[p.uid]["main"]
        odd = gpu_pod("q1", [("main", 50, 4)], annotations={names.GPU_ASSIGNED: "true"})
        with pytest.raises(PluginRPCError, match="gpu-assigned=true"):
            c.admit(odd)
        assert _mapping(c)[p.uid]["main"] == before
        c.start_containers(p)
