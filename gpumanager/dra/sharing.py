"""Whether a claim may be prepared given the containers that use it: one share per container.

A container's limits are one vcuda.config, mounted at ``/etc/vcuda`` by the CDI spec of its
claim. A container (an init or sidecar container too) that uses several claims of the driver
(listed in its ``resources.claims``, or one made for its extended resources) gets every spec's
edits, merged by the runtime in the order the container lists them, the last mount and env
winning: with a share and another claim (a whole GPU, or a second share), the container would run
with the other claim's ``/etc/vcuda`` and the share's GPU would no longer be held to the share. So
a claim is refused when a container of a pod it is reserved for also uses another claim of the
driver and either of them holds a share; containers that each use one claim are fine. A claim
whose shares belong to several requests (each limited on its own, for the containers that name
it) is refused when a container uses all of it, or more than one of its requests. A container
may use several claims of whole GPUs: each claim's CDI devices bring their own device nodes, and
no spec names a GPU (``NVIDIA_VISIBLE_DEVICES=void`` in each), so nothing of one claim depends on
another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.pods import Pod
from gpumanager.device.types import GPUInfo
from gpumanager.dra.apierror import describe, plain
from gpumanager.dra.claims import ClaimError, ClaimNotFound, ClaimRef, parse_claim
from gpumanager.dra.consumers import claim_requests, container_claims
from gpumanager.dra.reads import get_within

log = logging.getLogger(__name__)

JSON = dict[str, Any]


@dataclass(frozen=True)
class SharingCheck:
    """What the check needs: the driver and node, and ways to find pods and other claims."""

    driver: str
    pool: str
    gpus: Sequence[GPUInfo]
    pod_by_uid: Callable[[str], Pod | None]
    read_pod: Callable[[str, str], JSON | None]  # None: gone (404); ClaimError: cannot be read
    read_claim: Callable[[str, str], JSON]
    #: (namespace, name, pod UID) -> the prepared claim of that name seen reserved for that pod; None where
    #: none was (the claim is then read from the API server: the one of that name there now).
    prepared: Callable[[str, str, str], ClaimAllocation | None]


def _pods(check: SharingCheck, namespace: str, claim: Mapping[str, Any]) -> Iterator[Pod]:
    """The pods the claim is reserved for. A pod that is gone (the API server answers 404, or has
    another pod of that name now) is skipped; one that cannot be read raises ClaimError (from
    ``read_pod``), since the check would otherwise pass unseen."""
    for entry in (claim.get("status") or {}).get("reservedFor") or []:
        if not isinstance(entry, Mapping) or entry.get("resource") != "pods":
            continue
        uid, name = str(entry.get("uid") or ""), str(entry.get("name") or "")
        pod = check.pod_by_uid(uid) if uid else None
        if pod is None and name:
            pod = check.read_pod(namespace, name)
            if pod is not None and uid and (pod.get("metadata") or {}).get("uid") != uid:
                pod = None  # another pod of that name now
        if pod is None:
            meta = claim.get("metadata") or {}
            log.warning("claim %s/%s: pod %s (%s) it is reserved for is gone", namespace, meta.get("name"), name, uid)
            continue
        yield pod


def _ours(check: SharingCheck, namespace: str, name: str, pod_uid: str) -> ClaimAllocation | None:
    """The claim ``name`` of pod ``pod_uid`` as this driver holds it, or None when it holds no device of
    the driver here (or the API server no longer has it); ClaimError when it cannot be read. A prepared
    claim of that name counts only if it was seen reserved for the pod: an older claim of that name,
    deleted and made again while still prepared, is not the pod's."""
    known = check.prepared(namespace, name, pod_uid)
    if known is not None:
        return known
    try:
        data = check.read_claim(namespace, name)
    except ClaimNotFound:
        return None
    try:
        uid = str((data.get("metadata") or {}).get("uid") or "")
        parsed, _ = parse_claim(
            data, ClaimRef(namespace, name, uid), driver=check.driver, pool=check.pool, gpus=check.gpus
        )
    except ClaimError:
        return None
    return parsed


@dataclass(frozen=True)
class Review:
    """What the containers that use a claim say about it."""

    problem: str | None
    """Why the claim must not be prepared, naming the container and claims; None when it may be."""


def review(check: SharingCheck, ref: ClaimRef, data: Mapping[str, Any], claim: ClaimAllocation) -> Review:
    """Look at every container of the pods ``claim`` (read as ``data``) is reserved for that uses it."""
    namespace = ref.namespace
    others: dict[tuple[str, str], ClaimAllocation | None] = {}  # each other claim of each pod read once
    for pod in _pods(check, namespace, data):
        meta = pod.get("metadata") or {}
        pod_uid = str(meta.get("uid") or "")
        if claim.per_request:
            for container, claims in claim_requests(pod).items():
                named = claims.get(ref.name, set())
                if named and (None in named or len(named) > 1):
                    which = "the whole claim" if None in named else f"requests {', '.join(sorted(map(str, named)))}"
                    return Review(
                        f"claim {ref} ({ref.uid}): container {container} of pod {meta.get('namespace')}/"
                        f"{meta.get('name')} uses {which}, whose shares belong to requests "
                        f"{', '.join(sorted(claim.share_requests))}, each limited on its own: a container must name "
                        "one request of it (resources.claims[].request), or the claim must ask for one request"
                    )
        for container, used in container_claims(pod).items():
            if ref.name not in used or len(used) < 2:
                continue
            for other in used:
                if other == ref.name:
                    continue
                if (pod_uid, other) not in others:
                    others[(pod_uid, other)] = _ours(check, namespace, other, pod_uid)
                theirs = others[(pod_uid, other)]
                if theirs is None:
                    continue
                if claim.shared or theirs.shared:
                    share = ref.name if claim.shared else other
                    return Review(
                        f"claim {ref} ({ref.uid}): container {container} of pod "
                        f"{meta.get('namespace')}/{meta.get('name')} uses it and claim {namespace}/{other} of driver "
                        f"{check.driver}, and {namespace}/{share} is a share of a GPU: a container with a share can "
                        "use no other claim of this driver (its limits are one vcuda.config)"
                    )
    return Review(None)


def api_pod_reader(api_client: Any, timeout: float = 5.0) -> Callable[[str, str], JSON | None]:
    """GET a pod: None when the API server answers 404; ClaimError (naming the pod and the error)
    when it cannot be read otherwise (another status, a connection error, a timeout, not an object),
    so the kubelet retries the Prepare rather than the check passing unseen."""
    from gpumanager.kube.rest import ApiException, KubeRest, pod_path

    rest = KubeRest(api_client)

    def read(namespace: str, name: str) -> JSON | None:
        try:
            # Bounded as a whole: a server that trickles its answer must not hold the Prepare.
            out = get_within(rest, pod_path(namespace, name), timeout)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise ClaimError(
                f"pod {namespace}/{name}: cannot read it to check the containers that use the claim: {describe(exc)}"
            ) from None
        except Exception as exc:  # connection errors, timeouts, a body that is not JSON
            raise ClaimError(
                f"pod {namespace}/{name}: cannot read it to check the containers that use the claim: {plain(exc)}"
            ) from None
        if not isinstance(out, dict):
            raise ClaimError(f"pod {namespace}/{name}: cannot read it: the answer is not an object")
        return out

    return read


def no_pod(_namespace: str, _name: str) -> JSON | None:
    """A pod reader for an agent with no API server: nothing is found."""
    return None
