"""Rebuilding allocations from the kubelet's records when our own checkpoint is missing or corrupt.

Sources, most exact first:
1. ``kubelet_internal_checkpoint``: the ``AllocResp`` the kubelet stored for each
   container is our own Allocate answer, whose annotations name the devices
   (``tencent.com/vcuda-device``), cores and memory.
2. PodResources: the kubelet's current device IDs per container; the GPUs come
   from the pod's ``tencent.com/predicate-gpu-idx-<i>`` once we have marked it
   ``gpu-assigned=true``, else from the GPUs the vcuda-core IDs belong to.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod, PodSpecError
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError
from gpumanager.kube.kubelet_checkpoint import KubeletEntry
from gpumanager.kube.podresources import ContainerDevices

log = logging.getLogger(__name__)

_DEV = re.compile(r"^/dev/nvidia(\d+)$")


def from_kubelet_checkpoint(entries: Sequence[KubeletEntry]) -> list[ContainerAllocation]:
    """Allocations recorded in the AllocResp of vcuda-core entries."""
    out = []
    for e in entries:
        if e.resource != names.VCORE_RESOURCE or not e.alloc_resp:
            continue
        try:
            resp = pb.ContainerAllocateResponse.FromString(e.alloc_resp)
            devices = [d for d in resp.annotations.get(names.VDEVICE_ANNOTATION, "").split(",") if d]
            minors = tuple(int(m.group(1)) for d in devices if (m := _DEV.match(d)))
            cores = int(resp.annotations.get(names.VCORE_RESOURCE, "0"))
            memory = int(resp.annotations.get(names.VMEMORY_RESOURCE, "0"))
        except Exception as exc:
            log.warning("kubelet checkpoint: pod %s container %s: unusable AllocResp: %s", e.pod_uid, e.container, exc)
            continue
        if not minors or len(minors) != len(devices):
            log.warning("kubelet checkpoint: pod %s container %s: no devices in AllocResp", e.pod_uid, e.container)
            continue
        out.append(
            ContainerAllocation(
                pod_uid=e.pod_uid,
                container=e.container,
                minors=minors,
                cores=cores or len(e.device_ids),
                memory=memory,
                device_ids=e.device_ids,
            )
        )
    return out


def from_pod_resources(
    entries: Sequence[ContainerDevices],
    *,
    find_pod: Callable[[str, str], Pod | None],
    layout: DeviceLayout,
    gpus: Sequence[GPUInfo],
) -> list[ContainerAllocation]:
    """Allocations implied by the kubelet's current device assignment and the pods' annotations."""
    minor_of = {g.index: g.minor for g in gpus}
    out = []
    for e in entries:
        if e.resource != names.VCORE_RESOURCE or not e.device_ids:
            continue
        pod = find_pod(e.namespace, e.pod)
        where = f"pod {e.namespace}/{e.pod} container {e.container}"
        if pod is None:
            log.warning("PodResources: %s is not known to the API server; skipped", where)
            continue
        try:
            request = next((r for r in podinfo.gpu_requests(pod) if r.name == e.container), None)
            predicated = podinfo.predicated_gpus(pod, request.index) if request else None
        except PodSpecError as exc:
            log.warning("PodResources: %s: %s; skipped", where, exc)
            continue
        if request is None:
            continue
        if predicated is not None and podinfo.is_assigned(pod):
            minors = tuple(predicated)
        else:
            try:
                by_gpu = layout.group_by_gpu(names.VCORE_RESOURCE, e.device_ids)
            except UnknownDeviceError as exc:
                log.warning("PodResources: %s: %s; skipped", where, exc)
                continue
            minors = tuple(minor_of[g] for g in sorted(by_gpu))
        out.append(
            ContainerAllocation(
                pod_uid=podinfo.uid(pod),
                container=e.container,
                minors=minors,
                cores=request.cores,
                memory=request.memory_bytes,
                device_ids=e.device_ids,
                namespace=e.namespace,
                pod_name=e.pod,
                container_index=request.index,
            )
        )
    return out
