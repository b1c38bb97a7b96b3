"""What a pod holds: its node and, per GPU container, the GPUs named by gpu-admission's annotations.

A pod counts on ``spec.nodeName``, else on ``tencent.com/predicate-node`` (chosen, not yet
bound; see :class:`~gpumanager.extender.state.ClusterState` for how long), unless it has ended
(Succeeded/Failed). Each GPU container ``i`` holds what
``tencent.com/predicate-gpu-idx-<i>`` names: its cores and memory on that GPU for a share, every
named GPU whole otherwise. A GPU sidecar (an init container with ``restartPolicy: Always``, which
runs beside the others for the pod's whole life) holds the same way what its annotation names;
the agent asks for an init container's under its negative index, ``predicate-gpu-idx--1`` for the
first init container. An ordinary init container runs alone, before the others, yet the agent (as
the kubelet) keeps its charge until the pod ends: on each GPU the pod holds the larger of its ordinary
init containers (the largest of them) and the sum of its other containers there. A bound GPU
container without the annotation holds no known GPU yet (the agent chooses at Allocate and writes
the annotation afterwards): it is counted as unplaced,
as is one whose annotations were chosen for another node than the one it is bound to.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import GPURequest, Pod, PodSpecError
from gpumanager.extender.nodes import Charge

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class PodCharges:
    """Where a pod counts and what it holds there."""

    node: str
    charges: tuple[Charge, ...]
    unplaced: int = 0
    """GPU containers without a ``predicate-gpu-idx`` annotation."""
    predicate_time: str = ""
    bound: bool = field(default=True, compare=False)
    """The pod is bound to :attr:`node` (else it was only chosen for it, by ``predicate-node``)."""


def pod_spec(pod: Pod) -> Mapping[str, Any]:
    """The pod's spec ({} when absent or not an object: a spec of another shape failed the pod watch's
    listener with a traceback)."""
    spec = pod.get("spec")
    return spec if isinstance(spec, dict) else {}


def pod_node(pod: Pod) -> str:
    """``spec.nodeName``, else the ``predicate-node`` annotation, else ``""``."""
    bound = str(pod_spec(pod).get("nodeName") or "")
    return bound or str(podinfo.pod_annotations(pod).get(names.PREDICATE_NODE) or "")


def counts(pod: Pod) -> bool:
    """Whether the pod may hold GPUs now: on (or chosen for) a node, and not ended."""
    return bool(pod_node(pod)) and podinfo.phase(pod) not in TERMINAL


def init_containers(pod: Pod) -> tuple[list[GPURequest], list[GPURequest]]:
    """The pod's GPU init containers: (ordinary ones, sidecars), each in spec order (PodSpecError on
    unreadable quantities or a ``spec.initContainers`` that is not a list of containers).

    A sidecar (``restartPolicy: Always``, Kubernetes 1.28+) starts before the app containers and runs
    beside them; the kubelet never hands its devices on to a later container.
    """
    requests = podinfo.init_gpu_requests(pod)
    if not requests:
        return [], []
    specs = pod_spec(pod).get("initContainers") or []
    ordinary: list[GPURequest] = []
    sidecars: list[GPURequest] = []
    for request in requests:
        if not request.gpu_required:
            continue
        spec = specs[-1 - request.index]
        (sidecars if spec.get("restartPolicy") == "Always" else ordinary).append(request)
    return ordinary, sidecars


def held_containers(pod: Pod) -> list[GPURequest]:
    """The GPU containers that hold GPUs while the pod runs: its sidecars, then ``spec.containers``
    (the order in which the kubelet allocates them)."""
    return init_containers(pod)[1] + podinfo.gpu_containers(pod)


def is_gpu_pod(pod: Pod) -> bool:
    """Whether any container of the pod, init containers included, needs a GPU (unreadable requests
    count as not)."""
    try:
        return bool(podinfo.allocation_order(pod))
    except PodSpecError:
        return False


def pod_charges(pod: Pod) -> PodCharges | None:
    """The pod's charges, or None when it holds nothing (ended, nowhere, no GPU container)."""
    if not counts(pod):
        return None
    try:
        ordinary, sidecars = init_containers(pod)
        requests = sidecars + podinfo.gpu_containers(pod)
    except PodSpecError as exc:
        log.warning("%s; the pod is not counted", exc)
        return None
    if not requests and not ordinary:
        return None
    charges: list[Charge] = []
    unplaced = 0
    bound = bool(pod_spec(pod).get("nodeName"))
    here = podinfo.predicated_here(pod)
    for request in requests:
        if not here:  # chosen for another node: the agent here chooses by itself
            unplaced += 1
            continue
        placed = _placed_charges(pod, request)
        if placed is None:
            unplaced += 1
            continue
        charges.extend(placed)
    if here and ordinary:
        charges = count_inits(charges, [c for r in ordinary for c in _placed_charges(pod, r) or ()])
    when = str(podinfo.pod_annotations(pod).get(names.PREDICATE_TIME, ""))
    return PodCharges(pod_node(pod), tuple(charges), unplaced, when, bound)


def _placed_charges(pod: Pod, request: GPURequest) -> list[Charge] | None:
    """What container ``request`` holds where its ``predicate-gpu-idx`` annotation says; None when the
    annotation is missing or unusable (logged)."""
    try:
        minors = podinfo.predicated_gpus(pod, request.index)
    except PodSpecError as exc:
        log.warning("%s; container %s is not counted", exc, request.name)
        return None
    if minors is None:
        return None
    need = request.cores // names.HUNDRED_CORES if request.cores >= names.HUNDRED_CORES else 1
    if len(set(minors)) != need:
        log.warning(
            "pod %s container %s: %s%d names GPU(s) %s but %d cores need %d distinct GPU(s); not counted",
            podinfo.pod_key(pod),
            request.name,
            names.PREDICATE_GPU_IDX_PREFIX,
            request.index,
            ",".join(map(str, minors)),
            request.cores,
            need,
        )
        return None
    memory = request.memory_bytes if request.shared else 0
    return [Charge(m, request.cores, memory) for m in dict.fromkeys(minors)]


def count_inits(charges: list[Charge], inits: list[Charge]) -> list[Charge]:
    """``charges`` (the pod's containers that run together) with its ordinary init containers' ``inits``
    counted as the agent counts them: on each GPU, the larger of the largest init container and the sum
    of the others there (a whole GPU is larger than any share)."""
    out = list(charges)
    for minor in dict.fromkeys(c.minor for c in inits):
        first = [c for c in inits if c.minor == minor]
        rest = [c for c in charges if c.minor == minor]
        if any(c.whole for c in rest):
            continue  # the others hold the whole GPU already
        if any(c.whole for c in first):
            # The pod holds the whole GPU: its other shares there are within it.
            out = [c for c in out if c.minor != minor] + [Charge(minor, names.HUNDRED_CORES, 0)]
            continue
        beyond_cores = max(c.cores for c in first) - sum(c.cores for c in rest)
        beyond_memory = max(c.memory for c in first) - sum(c.memory for c in rest)
        if beyond_cores > 0 or beyond_memory > 0:
            out.append(Charge(minor, max(beyond_cores, 0), max(beyond_memory, 0)))
    return out
