"""Which containers of this node use a prepared claim (for pids.config, /usage and metrics).

A pod refers to claims in ``spec.resourceClaims[]`` (``resourceClaimName``, or a
template whose generated claim is named in ``status.resourceClaimStatuses[]``); a
container uses the ones listed in ``resources.claims[].name``, and the one the scheduler made for
its extended resources (``status.extendedResourceClaimStatus``). Init containers (sidecars with
``restartPolicy: Always`` among them) use claims the same way as the app containers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation


def claim_names(pod: Pod) -> dict[str, str]:
    """Pod-level claim name -> ResourceClaim name (those known so far)."""
    out: dict[str, str] = {}
    for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
        if isinstance(entry, dict) and entry.get("name") and entry.get("resourceClaimName"):
            out[str(entry["name"])] = str(entry["resourceClaimName"])
    for entry in (pod.get("status") or {}).get("resourceClaimStatuses") or []:
        if isinstance(entry, dict) and entry.get("name") and entry.get("resourceClaimName"):
            out[str(entry["name"])] = str(entry["resourceClaimName"])
    return out


def all_containers(pod: Pod) -> list[dict[str, Any]]:
    """The pod's init containers, then its app containers (those that are objects)."""
    spec = pod.get("spec") or {}
    out: list[dict[str, Any]] = []
    for key in ("initContainers", "containers"):
        items = spec.get(key) if isinstance(spec, dict) else None
        out.extend(c for c in items or [] if isinstance(c, dict))
    return out


def container_claims(pod: Pod) -> dict[str, list[str]]:
    """Container name -> the ResourceClaims it uses: those its ``resources.claims`` name (in that
    order), then the claim the scheduler made for the extended resources it asks for
    (``status.extendedResourceClaimStatus``, where a DeviceClass names an extended resource)."""
    local = claim_names(pod)
    out: dict[str, list[str]] = {}
    for c in all_containers(pod):
        refs = ((c.get("resources") or {}).get("claims")) or []
        names = (local[str(r["name"])] for r in refs if isinstance(r, dict) and str(r.get("name")) in local)
        out[str(c.get("name", ""))] = list(dict.fromkeys(names))
    ext = (pod.get("status") or {}).get("extendedResourceClaimStatus")
    if isinstance(ext, dict) and ext.get("resourceClaimName"):
        claim = str(ext["resourceClaimName"])
        for mapping in ext.get("requestMappings") or []:
            used = out.get(str(mapping.get("containerName"))) if isinstance(mapping, dict) else None
            if used is not None and claim not in used:
                used.append(claim)
    return out


def containers_using(pod: Pod, claim_name: str) -> list[str]:
    """Names of the pod's containers that use the ResourceClaim ``claim_name``."""
    return [name for name, claims in container_claims(pod).items() if claim_name in claims]


def consumers(claim: ClaimAllocation, pods: Iterable[Pod]) -> list[tuple[Pod, str]]:
    """(pod, container) pairs of running or pending pods in the claim's namespace that use it."""
    out: list[tuple[Pod, str]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("namespace") != claim.namespace or podinfo.is_terminated(pod):
            continue
        out.extend((pod, name) for name in containers_using(pod, claim.name))
    return out


def container_allocations(claims: Sequence[ClaimAllocation], pods: Sequence[Pod]) -> list[ContainerAllocation]:
    """The claims as per-container allocations: what /usage and the container metrics show."""
    out = []
    for claim in claims:
        share = next((d for d in claim.devices if not d.whole), None)
        for pod, container in consumers(claim, pods):
            meta = pod.get("metadata") or {}
            out.append(
                ContainerAllocation(
                    pod_uid=podinfo.uid(pod),
                    container=container,
                    minors=claim.minors,
                    cores=share.cores if share else 100 * len(claim.devices),
                    memory=share.memory if share else 0,
                    namespace=str(meta.get("namespace", "")),
                    pod_name=str(meta.get("name", "")),
                    extra={"claim": claim.name, "claim_uid": claim.uid},
                )
            )
    return out
