"""Which containers of this node use a prepared claim (for pids.config, /usage and metrics).

A pod refers to claims in ``spec.resourceClaims[]`` (``resourceClaimName``, or a
template whose generated claim is named in ``status.resourceClaimStatuses[]``); a
container uses the ones listed in ``resources.claims[].name``, and the one the scheduler made for
its extended resources (``status.extendedResourceClaimStatus``). Init containers (sidecars with
``restartPolicy: Always`` among them) use claims the same way as the app containers.

A pod names a claim by name only, and a claim deleted and made again under its name (while the old
one is still prepared, its pod still terminating) is another claim, of another UID, used by other
pods. The join is the claim object's ``status.reservedFor``: it lists the UIDs of the pods the claim
is reserved for, and the kubelet runs a pod only once each claim of it is reserved for it. So a pod
means the prepared claim of that name whose ``reservedFor`` was seen to hold the pod's UID
(:class:`Reservations`, filled from every read of a claim); where no read has shown the pod yet
(a pod that joined a claim after its Prepare, or after a restart of the agent) and only one claim of
that name is prepared, it means that one; where several are, none, until a read tells.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
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


def claim_requests(pod: Pod) -> dict[str, dict[str, set[str | None]]]:
    """Container name -> ResourceClaim name -> the requests of it the container names
    (``resources.claims[].request``; None: the whole claim). A claim made for extended resources
    counts under the request its ``requestMappings`` name."""
    local = claim_names(pod)
    out: dict[str, dict[str, set[str | None]]] = {}
    for c in all_containers(pod):
        named = out.setdefault(str(c.get("name", "")), {})
        for r in ((c.get("resources") or {}).get("claims")) or []:
            if isinstance(r, dict) and str(r.get("name")) in local:
                named.setdefault(local[str(r["name"])], set()).add(str(r["request"]) if r.get("request") else None)
    ext = (pod.get("status") or {}).get("extendedResourceClaimStatus")
    if isinstance(ext, dict) and ext.get("resourceClaimName"):
        claim = str(ext["resourceClaimName"])
        for mapping in ext.get("requestMappings") or []:
            if isinstance(mapping, dict) and str(mapping.get("containerName")) in out:
                request = str(mapping["requestName"]) if mapping.get("requestName") else None
                out[str(mapping["containerName"])].setdefault(claim, set()).add(request)
    return out


def requests_named(pod: Pod, container: str, claim_name: str) -> set[str | None]:
    """The requests of claim ``claim_name`` the container names (None: the whole claim)."""
    return claim_requests(pod).get(container, {}).get(claim_name, set())


def containers_using(pod: Pod, claim_name: str) -> list[str]:
    """Names of the pod's containers that use the ResourceClaim ``claim_name``."""
    return [name for name, claims in container_claims(pod).items() if claim_name in claims]


Reserved = Mapping[str, AbstractSet[str]]
"""Claim UID -> the UIDs of the pods its ``status.reservedFor`` was seen to hold."""


def reserved_pods(claim: Mapping[str, Any]) -> tuple[str, frozenset[str]]:
    """(claim UID, UIDs of the pods its ``status.reservedFor`` holds) of a claim as the API server has it."""
    meta = claim.get("metadata")
    uid = str(meta.get("uid") or "") if isinstance(meta, Mapping) else ""
    status = claim.get("status")
    entries = status.get("reservedFor") if isinstance(status, Mapping) else None
    pods = frozenset(
        str(e["uid"])
        for e in (entries if isinstance(entries, list) else [])
        if isinstance(e, Mapping) and e.get("resource") == "pods" and e.get("uid")
    )
    return uid, pods


class Reservations:
    """The pods each claim was seen reserved for, by claim UID (thread-safe; in memory only: after a
    restart a read of the claim fills it again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[str, frozenset[str]] = {}
        self._unused: set[str] = set()  # UIDs not prepared at the last prune: dropped at the next
        self.generation = 0  # changes whenever what a pod means may change

    def saw(self, claim: Mapping[str, Any]) -> None:
        """A read of ``claim``: the pods it is reserved for are added to those seen before."""
        uid, pods = reserved_pods(claim)
        if uid:
            self.add(uid, pods)

    def add(self, uid: str, pods: AbstractSet[str]) -> None:
        """Pods known to be reserved in claim ``uid``."""
        with self._lock:
            known = self._pods.get(uid, frozenset())
            if not pods <= known:
                self._pods[uid] = known | pods
                self.generation += 1
            self._unused.discard(uid)

    def snapshot(self) -> dict[str, frozenset[str]]:
        """Claim UID -> pod UIDs."""
        with self._lock:
            return dict(self._pods)

    def prune(self, prepared: AbstractSet[str]) -> None:
        """Forget the claims not prepared now nor at the last prune (a claim read for a Prepare still in
        progress is kept until the next one)."""
        with self._lock:
            for uid in [u for u in self._pods if u not in prepared]:
                if uid in self._unused:
                    del self._pods[uid]
                    self._unused.discard(uid)
                else:
                    self._unused.add(uid)
            self._unused &= set(self._pods)


def owner(
    pod_uid: str, namespace: str, name: str, claims: Iterable[ClaimAllocation], reserved: Reserved
) -> ClaimAllocation | None:
    """The prepared claim a pod means by claim ``name``: the one seen reserved for it; where none was, the
    only one of that name (None where several are, or none)."""
    group = [c for c in claims if c.namespace == namespace and c.name == name]
    for c in group:
        if pod_uid in reserved.get(c.uid, ()):
            return c
    return group[0] if len(group) == 1 else None


def unowned(
    claims: Sequence[ClaimAllocation], pods: Iterable[Pod], reserved: Reserved
) -> dict[tuple[str, str], list[str]]:
    """(namespace, claim name) of each name several prepared claims have -> UIDs of the running or pending
    pods that use a claim of that name but that no read has shown reserved in one of them."""
    names: dict[tuple[str, str], int] = {}
    for c in claims:
        names[(c.namespace, c.name)] = names.get((c.namespace, c.name), 0) + 1
    out: dict[tuple[str, str], list[str]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        if podinfo.is_terminated(pod):
            continue
        namespace, uid = str(meta.get("namespace", "")), podinfo.uid(pod)
        used = {n for ns in container_claims(pod).values() for n in ns}
        for name in sorted(used):
            if names.get((namespace, name), 0) > 1 and owner(uid, namespace, name, claims, reserved) is None:
                out.setdefault((namespace, name), []).append(uid)
    return out


def consumers(
    claim: ClaimAllocation,
    pods: Iterable[Pod],
    claims: Sequence[ClaimAllocation] = (),
    reserved: Reserved | None = None,
) -> list[tuple[Pod, str]]:
    """(pod, container) pairs of running or pending pods in the claim's namespace that use it: that name
    it, and mean this claim of that name (:func:`owner`; ``claims``: every prepared claim, ``reserved``:
    :class:`Reservations`' snapshot)."""
    everyone = [*claims, claim] if claim not in claims else list(claims)
    known = reserved or {}
    out: list[tuple[Pod, str]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("namespace") != claim.namespace or podinfo.is_terminated(pod):
            continue
        users = containers_using(pod, claim.name)
        means = owner(podinfo.uid(pod), claim.namespace, claim.name, everyone, known) if users else None
        if means is None or means.uid != claim.uid:
            continue
        out.extend((pod, name) for name in users)
    return out


def container_allocations(
    claims: Sequence[ClaimAllocation], pods: Sequence[Pod], reserved: Reserved | None = None
) -> list[ContainerAllocation]:
    """The claims as per-container allocations: what /usage and the container metrics show.

    A result with admin access (monitoring access to a GPU, beside the claims that share it) is no
    request: as the claim metrics do, it is left out, and a container whose claim holds nothing else
    is not shown."""
    out = []
    for claim in claims:
        held = [d for d in claim.devices if d.consumes]
        if not held:
            continue
        by_request = claim.share_requests if claim.per_request else {}
        for pod, container in consumers(claim, pods, claims, reserved):
            meta = pod.get("metadata") or {}
            mine = held
            named = requests_named(pod, container, claim.name)
            if len(named) == 1 and (request := next(iter(named))) in by_request:
                mine = list(by_request[str(request)])  # a container that names one request: its limits
            share = ClaimAllocation(claim.uid, claim.namespace, claim.name, tuple(mine)).share_limits
            out.append(
                ContainerAllocation(
                    pod_uid=podinfo.uid(pod),
                    container=container,
                    minors=tuple(dict.fromkeys(d.minor for d in mine)),
                    cores=share[0] if share else 100 * len(mine),
                    memory=share[1] if share else 0,
                    namespace=str(meta.get("namespace", "")),
                    pod_name=str(meta.get("name", "")),
                    extra={"claim": claim.name, "claim_uid": claim.uid},
                )
            )
    return out
