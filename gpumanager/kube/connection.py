"""Everything that talks to the API server, brought up in the background after the device plugin serves.

Loading the Kubernetes client takes longer than registering with the kubelet,
so the agent registers first and connects here: client, pod cache, annotation
patcher, node labels. Allocate waits for this side (bounded); registration and
ListAndWatch never do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpumanager.allocation.annotations import missing_annotations
from gpumanager.allocation.pods import Pod
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.kube import cleanup, nodelabels
from gpumanager.kube import client as kube_client
from gpumanager.kube.inventory_publisher import InventoryPublisher
from gpumanager.kube.patcher import AnnotationPatcher
from gpumanager.kube.pods import PodCache, PodListener

log = logging.getLogger(__name__)


class ApiConnection:
    """The API-server side of the agent."""

    def __init__(self, *, kubeconfig: str, node_name: str) -> None:
        self._kubeconfig = kubeconfig
        self._node = node_name
        self.api: Any = None
        self.pod_cache: PodCache | None = None
        self.patcher: AnnotationPatcher | None = None
        self.inventory: InventoryPublisher | None = None
        self.error = ""
        self._stop = threading.Event()

    def client(self) -> Any:
        """The API client, built on first use (the Kubernetes package is loaded then); None, with
        :attr:`error`, when it cannot be built."""
        if self.api is None and not self.error:
            try:
                self.api = kube_client.kube_client(self._kubeconfig)
            except kube_client.KubeUnavailableError as exc:
                self.error = str(exc)
        return self.api

    def connect(self, listener: PodListener) -> PodCache | None:
        """Start the pod cache and the patcher on :meth:`client`; None (with :attr:`error`) when impossible."""
        api = self.client()
        if api is None:
            return None
        cache = PodCache(api, self._node)
        cache.add_listener(listener)
        cache.start()
        self.pod_cache = cache
        self.patcher = AnnotationPatcher(api)
        self.patcher.start()
        return cache

    def publish_inventory(
        self,
        gpus: Sequence[GPUInfo],
        topology: NodeTopology,
        healthy: Callable[[], dict[int, bool]],
        *,
        share_mode: bool,
    ) -> None:
        """Keep the node's ``tencent.com/gpu-inventory`` annotation (the scheduler extender's view) current."""
        if self.api is None:
            return
        self.inventory = InventoryPublisher(self.api, self._node, gpus, topology, healthy, share_mode=share_mode)
        self.inventory.start()

    def gpu_health_changed(self) -> None:
        """A GPU's health changed: the inventory annotation says so."""
        if self.inventory is not None:
            self.inventory.changed()

    def label_node(
        self, labels: dict[str, str], gpu_name: str, *, on_result: Callable[[str], None] | None = None
    ) -> str:
        """Apply ``--node-labels`` (retrying with backoff for :data:`~gpumanager.kube.nodelabels.LABEL_WINDOW`);
        returns the error or ''. Labels the API server did not take in that time (it was down, overloaded) go
        on being tried in the background until it does: ``on_result('')`` then tells that they are applied."""
        if self.api is None or not labels:
            return ""
        resolved = nodelabels.resolve(labels, gpu_name)
        if not resolved:
            return ""
        outcome, problem = nodelabels.label(
            self.api, self._node, resolved, timeout=nodelabels.LABEL_WINDOW, stop=self._stop
        )
        if outcome in ("labelled", "stopped"):
            return ""
        if outcome == "unanswered":
            threading.Thread(
                target=self._label_later, args=(resolved, on_result), name="node-labels", daemon=True
            ).start()
            return f"could not label node {self._node} with {resolved} yet: {problem} (retrying)"
        return f"could not label node {self._node} with {resolved}: {problem}"

    def _label_later(self, labels: dict[str, str], on_result: Callable[[str], None] | None) -> None:
        """Try the labels until the API server takes (or refuses) them, or the agent stops."""
        while not self._stop.is_set():
            outcome, problem = nodelabels.label(
                self.api, self._node, labels, timeout=nodelabels.LABEL_WINDOW, stop=self._stop
            )
            if outcome == "labelled":
                if on_result is not None:
                    on_result("")
                return
            if outcome == "refused":
                message = f"could not label node {self._node} with {labels}: {problem}"
                if on_result is not None:
                    on_result(message)
                else:
                    log.error("%s", message)
                return
            if outcome == "stopped":
                return

    def annotate(self, pod: Pod | None, allocations: Sequence[ContainerAllocation]) -> None:
        """Queue the ready annotations the pod lacks (not awaited)."""
        if pod is None or self.patcher is None:
            return
        wanted = missing_annotations(pod, allocations)
        if wanted:
            meta = pod.get("metadata") or {}
            uid = str(meta.get("uid", ""))
            self.patcher.submit(str(meta.get("namespace", "")), str(meta.get("name", "")), uid, wanted)

    def delete_failed(self, pod: Pod) -> None:
        """Delete a pod that failed to start on its GPUs when a controller owns it."""
        if self.api is not None and cleanup.controller_owned(pod):
            cleanup.delete_pod(self.api, pod)

    def alive(self) -> bool:
        """Whether the pod cache and the patcher loops run (True before they exist)."""
        loops: list[Callable[[], bool]] = []
        if self.pod_cache is not None:
            loops.append(self.pod_cache.alive)
        if self.patcher is not None:
            loops.append(self.patcher.alive)
        return all(alive() for alive in loops)

    def stop(self) -> None:
        """Stop the loops without waiting for a hanging API server."""
        self._stop.set()
        if self.inventory is not None:
            # Its stop() waits for a publication in flight; a hanging API server must not hold ours.
            threading.Thread(target=self.inventory.stop, name="stop-inventory", daemon=True).start()
        if self.patcher is not None:
            self.patcher.stop(timeout=0.5)
        if self.pod_cache is not None:
            self.pod_cache.stop(timeout=0.5)
