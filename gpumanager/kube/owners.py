"""Who holds a set of device IDs, in the kubelet's own view: PodResources first, its checkpoint second."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from gpumanager.allocation.pods import Pod
from gpumanager.kube import kubelet_checkpoint
from gpumanager.kube.podresources import PodResourcesClient, PodResourcesUnavailableError

log = logging.getLogger(__name__)

#: A pod by (namespace, name), from the pod cache, else from a list of the node's pods sent since the time
#: given (``time.monotonic()``; None: none made before), else from a fresh list.
FindPod = Callable[[str, str, float | None], Pod | None]


class OwnerResolver:
    """Maps device IDs to (pod UID, container) through the kubelet's records."""

    def __init__(
        self,
        *,
        pod_resources: PodResourcesClient | None,
        kubelet_checkpoint_path: Path,
        find_pod: FindPod,
    ) -> None:
        self._pr = pod_resources
        self._checkpoint = kubelet_checkpoint.CheckpointFile(kubelet_checkpoint_path)
        self._find_pod = find_pod
        self.last_source = ""

    def owner(
        self,
        resource: str,
        device_ids: Sequence[str],
        hint: tuple[str, str] | None = None,
        since: float | None = None,
        listed: float | None = None,
    ) -> tuple[str, str] | None:
        """(pod UID, container) that the kubelet says holds exactly ``device_ids``; None when nobody says.

        ``hint`` is the (namespace, pod name) we believe holds them: asked first. ``since``: when the
        kubelet's Allocate of these IDs reached us (``time.monotonic()``), if in this run: a PodResources
        List made since then may answer (:meth:`PodResourcesClient.owner_of`). ``listed``: when their
        admission began; a list of the node's pods sent since then may name the pod the cache does not
        show yet.
        """
        if self._pr is not None:
            try:
                found = self._pr.owner_of(
                    resource, device_ids, hint, since=since, trust=lambda holder: self._not_init(holder, listed)
                )
            except PodResourcesUnavailableError as exc:
                log.debug("%s; trying the kubelet checkpoint", exc)
            else:
                if found is not None:
                    namespace, name, container = found
                    pod = self._find_pod(namespace, name, listed)
                    if pod is not None:
                        self.last_source = "PodResources"
                        return (str((pod.get("metadata") or {}).get("uid", "")), container)
                    log.warning("PodResources names pod %s/%s, which the pod cache does not know", namespace, name)
        try:
            entries = self._checkpoint.entries()
        except kubelet_checkpoint.KubeletCheckpointError as exc:
            log.warning("cannot use the kubelet checkpoint: %s", exc)
            return None
        found_cp = kubelet_checkpoint.owner_of(entries, resource, device_ids)
        if found_cp is not None:
            self.last_source = "kubelet checkpoint"
        return found_cp

    def _not_init(self, holder: tuple[str, str, str], listed: float | None = None) -> bool:
        """Whether ``holder`` (namespace, pod, container) is one of its pod's app containers or sidecars
        (init containers with ``restartPolicy: Always``), as the pod cache knows it: the kubelet hands the IDs
        of the other init containers on to the next containers of their pod, never a sidecar's."""
        namespace, name, container = holder
        pod = self._find_pod(namespace, name, listed)
        if pod is None:
            return False
        spec = pod.get("spec") or {}
        sidecars = [
            c for c in spec.get("initContainers") or [] if isinstance(c, dict) and c.get("restartPolicy") == "Always"
        ]
        return any(
            c.get("name") == container for c in [*(spec.get("containers") or []), *sidecars] if isinstance(c, dict)
        )
