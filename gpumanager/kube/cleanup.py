"""Deleting pods that failed admission or PreStart, as gpu-manager's periodic check does.

Only pods a controller owns are deleted (the controller makes a new one); a naked
pod is left for its owner to see. Its GPUs are freed either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from gpumanager.kube.apierror import failure
from gpumanager.kube.rest import ApiClient, ApiException, KubeRest

log = logging.getLogger(__name__)


def controller_owned(pod: Mapping[str, Any]) -> bool:
    """Whether some owner reference is not itself a Pod (gpu-manager's rule)."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or []
    return bool(refs) and all(str(r.get("kind", "")) != "Pod" for r in refs)


def delete_pod(api: ApiClient, pod: Mapping[str, Any]) -> bool:
    """Delete the pod (only that exact UID); True when it is gone."""
    meta = pod.get("metadata") or {}
    name, namespace, uid = str(meta.get("name")), str(meta.get("namespace")), str(meta.get("uid"))
    try:
        KubeRest(api).delete_pod(namespace, name, {"preconditions": {"uid": uid}}, timeout=10)
    except ApiException as exc:
        if exc.status in (404, 409):
            return True
        log.warning("cannot delete pod %s/%s: %s", namespace, name, failure(exc))
        return False
    except Exception as exc:
        log.warning("cannot delete pod %s/%s: %s", namespace, name, exc)
        return False
    log.info("deleted pod %s/%s, which failed to start on its GPUs (its controller will replace it)", namespace, name)
    return True
