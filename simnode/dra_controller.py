"""A resourceclaim-controller stand-in: claims from templates for pods, released when pods end.

As kube-controller-manager's resourceclaim controller does: for every pod entry
``spec.resourceClaims[].resourceClaimTemplateName`` without a claim yet, it creates a claim from
the template named ``<pod>-<entry>-<5 random characters>``, owned by the pod and annotated
``resource.kubernetes.io/pod-claim-name``, and records it in the pod's
``status.resourceClaimStatuses``. A claim whose reserving pods are gone or finished loses them
from ``reservedFor``; when none is left, a claim owned by a pod is deleted and any other claim is
deallocated (its ``status.allocation`` removed).
"""

from __future__ import annotations

import json
import logging
import random
import string
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)

JSON = dict[str, Any]
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


class ClaimController:
    """One reconcile pass at a time (:meth:`sync`), through the real kubernetes client."""

    def __init__(self, api_client: Any, *, seed: int | None = None) -> None:
        self._api: Any = k8s.ResourceV1Api(api_client)
        self._core: Any = k8s.CoreV1Api(api_client)
        self._rand = random.Random(seed)

    def _items(self, fn: Any) -> list[JSON]:
        items: list[JSON] = json.loads(fn(_preload_content=False).data)["items"]
        return items

    def sync(self) -> int:
        """Create missing claims and release finished pods' claims; returns the changes made."""
        pods = self._items(self._core.list_pod_for_all_namespaces)
        changes = 0
        for pod in pods:
            changes += self._create_claims(pod)
        live = {
            p["metadata"]["uid"]
            for p in pods
            if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
            and not p["metadata"].get("deletionTimestamp")
        }
        for claim in self._items(self._api.list_resource_claim_for_all_namespaces):
            changes += self._release(claim, live)
        return changes

    def _create_claims(self, pod: JSON) -> int:
        md = pod["metadata"]
        ns = md.get("namespace", "default")
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return 0
        statuses = list((pod.get("status") or {}).get("resourceClaimStatuses") or [])
        have = {s["name"] for s in statuses}
        made = 0
        for entry in (pod.get("spec") or {}).get("resourceClaims") or []:
            template_name = entry.get("resourceClaimTemplateName")
            if not template_name or entry["name"] in have:
                continue
            try:
                template = json.loads(
                    self._api.read_namespaced_resource_claim_template(template_name, ns, _preload_content=False).data
                )
            except ApiException as exc:
                log.warning("claim controller: pod %s/%s: template %s: %s", ns, md["name"], template_name, exc.reason)
                continue
            suffix = "".join(self._rand.choice(string.ascii_lowercase + string.digits) for _ in range(5))
            name = f"{md['name']}-{entry['name']}-{suffix}"[:253]
            body = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {
                    "name": name,
                    "namespace": ns,
                    "annotations": {POD_CLAIM_NAME: entry["name"]},
                    "ownerReferences": [
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "name": md["name"],
                            "uid": md["uid"],
                            "controller": True,
                            "blockOwnerDeletion": True,
                        }
                    ],
                },
                "spec": (template.get("spec") or {}).get("spec") or {},
            }
            self._api.create_namespaced_resource_claim(ns, body, _preload_content=False)
            statuses.append({"name": entry["name"], "resourceClaimName": name})
            made += 1
        if made:
            self._core.patch_namespaced_pod_status(
                md["name"],
                ns,
                {"status": {"resourceClaimStatuses": statuses}},
                _content_type="application/merge-patch+json",
                _preload_content=False,
            )
        return made

    def _release(self, claim: JSON, live: set[str]) -> int:
        md = claim["metadata"]
        status = claim.get("status") or {}
        reserved = status.get("reservedFor") or []
        keep = [r for r in reserved if r.get("uid") in live]
        owner = next((o for o in md.get("ownerReferences") or [] if o.get("kind") == "Pod"), None)
        owner_done = owner is not None and owner.get("uid") not in live
        if keep == reserved and not (owner_done and not keep):
            return 0
        if not keep and owner_done:
            try:
                self._api.delete_namespaced_resource_claim(md["name"], md["namespace"], _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise
            log.info("claim controller: deleted claim %s/%s", md["namespace"], md["name"])
            return 1
        patch: JSON = {"metadata": {"resourceVersion": md["resourceVersion"]}, "status": {"reservedFor": keep or None}}
        if not keep:
            patch["status"]["allocation"] = None
        self._api.patch_namespaced_resource_claim_status(
            md["name"], md["namespace"], patch, _content_type="application/merge-patch+json", _preload_content=False
        )
        return 1
