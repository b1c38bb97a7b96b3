"""Which containers of this node use a prepared claim (for pids.config, /usage and metrics).

A pod refers to claims in ``spec.resourceClaims[]`` (``resourceClaimName``, or a
template whose generated claim is named in ``status.resourceClaimStatuses[]``); a
container uses the ones listed in ``resources.claims[].name``. Init containers (sidecars with
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


def containers_using(pod: Pod, claim_name: str) -> list[str]:
    """Names of the pod's containers that use the ResourceClaim ``claim_name``."""
    local = {k for k, v in claim_names(pod).items() if v == claim_name}
    if not local:
        return []
    out = []
    for c in all_containers(pod):
        refs = ((c.get("resources") or {}).get("claims")) or []
        if any(isinstance(r, dict) and r.get("name") in local for r in refs):
            out.append(str(c.get("name", "")))
    return out


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
