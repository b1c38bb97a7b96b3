"""bind: choose the GPUs again, write gpu-admission's annotations, then bind the pod to the node.

1. Take the pod from the watch cache (else GET it; a recreated pod, a different UID, is refused).
   A pod already bound to this node is done (a repeated bind is idempotent); to another, refused.
2. Under the cluster state's lock, choose GPUs on the node with the pod's own old charges left
   out, and *assume* them (the next filter and bind see them taken).
3. Merge-patch the annotations with ``metadata.resourceVersion`` set (a precondition):
   ``predicate-gpu-idx-<i>`` per GPU container, ``predicate-node``, ``predicate-time`` (ns),
   ``gpu-assigned=false``, and stale ``predicate-gpu-idx-*`` removed. On 409 Conflict: drop the
   assumption, GET again and start over from 2 (at most ``max_conflicts`` times).
4. POST the pod's Binding (with the pod's UID as precondition). If it fails and the pod is not
   bound to the node after all, drop the assumption and remove the annotations again.

No lock is held during API calls except the pod's own (concurrent binds of one pod queue up).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import GPURequest, PodSpecError
from gpumanager.extender.api import BindingArgs
from gpumanager.extender.charges import PodCharges
from gpumanager.extender.placement import Policy, place
from gpumanager.extender.state import ClusterState

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
JSON = dict[str, Any]


class BindError(Exception):
    """Bind refused or failed; ``outcome`` is ``refused`` (does not fit, wrong pod) or ``error``."""

    def __init__(self, message: str, outcome: str = "error") -> None:
        super().__init__(message)
        self.outcome = outcome


def _api_text(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return f"{type(exc).__name__}: {exc}"


class Binder:
    """The bind verb. Thread-safe."""

    def __init__(
        self,
        api: client.ApiClient,
        state: ClusterState,
        policy: Policy,
        *,
        max_conflicts: int = 5,
        request_timeout: float = 10.0,
        on_conflict: Callable[[], None] | None = None,
        cached: Callable[[str], JSON | None] | None = None,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._state = state
        self._policy = policy
        self._max_conflicts = max_conflicts
        self._timeout = request_timeout
        self._stripes = [threading.Lock() for _ in range(64)]
        self._on_conflict = on_conflict or (lambda: None)
        self._cached = cached or (lambda _uid: None)

    def bind(self, args: BindingArgs) -> str:
        """Bind the pod; returns the outcome (``bound``, ``already_bound``); raises :class:`BindError`."""
        key = args.pod_uid or f"{args.pod_namespace}/{args.pod_name}"
        with self._stripes[zlib.crc32(key.encode()) % len(self._stripes)]:
            return self._bind(args)

    # -- API calls --------------------------------------------------------------------------------

    def _get(self, args: BindingArgs) -> JSON:
        try:
            response: Any = self._core.read_namespaced_pod(
                args.pod_name, args.pod_namespace, _preload_content=False, _request_timeout=self._timeout
            )
        except ApiException as exc:
            if exc.status == 404:
                raise BindError(f"pod {args.pod_namespace}/{args.pod_name} not found", "refused") from exc
            raise BindError(f"cannot read pod {args.pod_namespace}/{args.pod_name}: {_api_text(exc)}") from exc
        except Exception as exc:
            raise BindError(f"cannot read pod {args.pod_namespace}/{args.pod_name}: {_api_text(exc)}") from exc
        pod: JSON = json.loads(response.data)
        if args.pod_uid and podinfo.uid(pod) != args.pod_uid:
            raise BindError(
                f"pod {args.pod_namespace}/{args.pod_name} has UID {podinfo.uid(pod)}, not {args.pod_uid} "
                "(it was recreated)",
                "refused",
            )
        return pod

    def _patch(self, args: BindingArgs, rv: str, annotations: Mapping[str, str | None]) -> JSON:
        body = {"metadata": {"resourceVersion": rv, "annotations": dict(annotations)}}
        response: Any = self._core.patch_namespaced_pod(
            args.pod_name,
            args.pod_namespace,
            body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=self._timeout,
        )
        patched: JSON = json.loads(response.data)
        return patched

    def _post_binding(self, args: BindingArgs, uid: str) -> None:
        body: Any = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        }
        self._core.create_namespaced_pod_binding(
            args.pod_name, args.pod_namespace, body, _preload_content=False, _request_timeout=self._timeout
        )

    # -- the verb ---------------------------------------------------------------------------------

    def _bound_already(self, args: BindingArgs, pod: JSON) -> bool:
        bound = str((pod.get("spec") or {}).get("nodeName") or "")
        if not bound:
            return False
        if bound == args.node:
            log.info("pod %s/%s is already bound to %s", args.pod_namespace, args.pod_name, bound)
            return True
        raise BindError(f"pod {args.pod_namespace}/{args.pod_name} is already bound to node {bound}", "refused")

    def _choose(self, args: BindingArgs, pod: JSON, requests: list[GPURequest]) -> dict[str, str | None]:
        """Choose GPUs under the state lock and assume them; returns the annotation patch."""
        uid = podinfo.uid(pod)
        who = f"pod {args.pod_namespace}/{args.pod_name}"
        state = self._state
        with state.lock:
            state.expire()
            gpus = state.node(args.node)
            if gpus is None:
                raise BindError(f"{who}: node {args.node} has no GPUs the extender knows of", "refused")
            with state.without(uid):
                placement = place(gpus, requests, self._policy)
            if not placement.ok:
                raise BindError(f"{who} no longer fits on node {args.node}: {placement.failed}", "refused")
            now = str(time.time_ns())
            charges = tuple(c for choice in placement.choices for c in choice.charges())
            state.assume(uid, PodCharges(args.node, charges, 0, now))
        patch: dict[str, str | None] = {
            f"{names.PREDICATE_GPU_IDX_PREFIX}{choice.request.index}": ",".join(map(str, choice.minors))
            for choice in placement.choices
        }
        for key in podinfo.pod_annotations(pod):
            if key.startswith(names.PREDICATE_GPU_IDX_PREFIX) and key not in patch:
                patch[key] = None
        patch[names.PREDICATE_NODE] = args.node
        patch[names.PREDICATE_TIME] = now
        patch[names.GPU_ASSIGNED] = "false"
        return patch

    def _start(self, args: BindingArgs) -> JSON:
        """The pod from the watch cache when it has it (a stale copy fails the patch's precondition
        and is read again), else from the API server."""
        pod = self._cached(args.pod_uid)
        meta = (pod or {}).get("metadata") or {}
        if pod is not None and meta.get("name") == args.pod_name and meta.get("namespace") == args.pod_namespace:
            return pod
        return self._get(args)

    def _bind(self, args: BindingArgs) -> str:
        who = f"pod {args.pod_namespace}/{args.pod_name}"
        pod = self._start(args)
        uid = podinfo.uid(pod)
        if self._bound_already(args, pod):
            return "already_bound"
        try:
            requests = podinfo.gpu_containers(pod)
        except PodSpecError as exc:
            raise BindError(str(exc), "refused") from exc
        if not requests:
            self._binding(args, uid, None, {})
            return "bound"
        conflicts = 0
        while True:
            patch = self._choose(args, pod, requests)
            try:
                patched = self._patch(args, str((pod.get("metadata") or {}).get("resourceVersion", "")), patch)
                break
            except Exception as exc:
                self._state.forget(uid)
                if isinstance(exc, ApiException) and exc.status == 409 and conflicts < self._max_conflicts:
                    conflicts += 1
                    self._on_conflict()
                    log.info("%s changed while binding (conflict %d); reading it again", who, conflicts)
                    pod = self._get(args)
                    if self._bound_already(args, pod):
                        return "already_bound"
                    continue
                raise BindError(f"cannot annotate {who}: {_api_text(exc)}") from exc
        self._binding(args, uid, patched, patch)
        log.info(
            "bound %s to %s: %s",
            who,
            args.node,
            ", ".join(f"{k.rsplit('/', 1)[-1]}={v}" for k, v in patch.items() if v is not None),
        )
        return "bound"

    def _binding(self, args: BindingArgs, uid: str, patched: JSON | None, patch: Mapping[str, str | None]) -> None:
        who = f"pod {args.pod_namespace}/{args.pod_name}"
        try:
            self._post_binding(args, uid)
        except Exception as exc:
            # The Binding may have been made even though the answer was lost: look before undoing.
            try:
                current = self._get(args)
            except BindError:
                current = None
            if current is not None and (current.get("spec") or {}).get("nodeName") == args.node:
                self._state.assumed_bound(uid)
                return
            self._state.forget(uid)
            if patched is not None:
                self._undo(args, patched, patch)
            raise BindError(f"cannot bind {who} to node {args.node}: {_api_text(exc)}; its GPUs are released") from exc
        self._state.assumed_bound(uid)

    def _undo(self, args: BindingArgs, patched: JSON, patch: Mapping[str, str | None]) -> None:
        """Remove the annotations this bind wrote, unless the pod moved on since."""
        who = f"pod {args.pod_namespace}/{args.pod_name}"
        ours = {k: None for k, v in patch.items() if v is not None}
        when = patch.get(names.PREDICATE_TIME)
        pod: JSON | None = patched
        for _ in range(self._max_conflicts + 1):
            if pod is None or podinfo.pod_annotations(pod).get(names.PREDICATE_TIME) != when:
                return
            if (pod.get("spec") or {}).get("nodeName"):
                return
            try:
                self._patch(args, str((pod.get("metadata") or {}).get("resourceVersion", "")), ours)
                return
            except ApiException as exc:
                if exc.status != 409:
                    log.warning(
                        "cannot remove annotations from pod %s/%s: %s",
                        args.pod_namespace,
                        args.pod_name,
                        _api_text(exc),
                    )
                    return
            except Exception as exc:
                log.warning("cannot remove annotations from %s: %s", who, _api_text(exc))
                return
            try:
                pod = self._get(args)
            except BindError:
                return
