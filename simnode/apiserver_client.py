"""The pod calls of the cluster stand-ins (kubelet side, harnesses), over HTTP with the real client.

:class:`HttpPodApi` offers the same pod methods as the in-process helpers of
:class:`~simnode.apiserver.ApiServerSimulator` (``create_pod``, ``get_pod``, ``set_pod_phase``,
``delete_pod``, ``request_deletion``, ``finish_deletion``, ``pod_events``), for an API server in
another process or where the stand-in's calls should travel as a kubelet's do.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes import client as k8s_client

from gpumanager.kube.reflector import Reflector


class HttpPodApi:
    """Pod calls through ``core`` (a ``CoreV1Api``; set it before the first call when given None)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._feeds: dict[int, Reflector] = {}

    def create_pod(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """POST the pod."""
        ns = str(manifest["metadata"].get("namespace", "default"))
        resp = self.core.create_namespaced_pod(ns, dict(manifest), _preload_content=False)
        return dict(json.loads(resp.data))

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """GET the pod."""
        return _unless_absent(lambda: self.core.read_namespaced_pod(name, namespace, _preload_content=False))

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> None:
        """Merge-patch the pod's status."""
        body = {"status": {"phase": phase, **status}}
        self.core.patch_namespaced_pod_status(
            name, namespace, body, _content_type="application/merge-patch+json", _preload_content=False
        )

    def delete_pod(self, namespace: str, name: str) -> None:
        """DELETE the pod at once (grace 0)."""
        self.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0, _preload_content=False)

    def request_deletion(self, namespace: str, name: str) -> dict[str, Any] | None:
        """DELETE the pod as a user does (graceful when it runs on a node); None when absent."""
        return _unless_absent(lambda: self.core.delete_namespaced_pod(name, namespace, _preload_content=False))

    def finish_deletion(self, namespace: str, name: str, uid: str | None = None) -> None:
        """DELETE with grace 0 (and ``uid`` as precondition), as the kubelet ends a graceful deletion."""
        body = {"gracePeriodSeconds": 0, **({"preconditions": {"uid": uid}} if uid else {})}
        try:
            self.core.delete_namespaced_pod(name, namespace, body=body, _preload_content=False)
        except k8s_client.exceptions.ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def pod_events(self) -> queue.Queue[tuple[str, dict[str, Any]]]:
        """Every pod (as ADDED) and every later change, through a list and watch of the API server."""
        events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        feed = Reflector("sim-kubelet-pods", self.core.list_pod_for_all_namespaces)
        feed.add_listener(lambda kind, pod, _prev: events.put((kind, pod)))
        self._feeds[id(events)] = feed
        feed.start()
        return events

    def close_pod_events(self, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
        """Stop the watch behind a queue from :meth:`pod_events`."""
        feed = self._feeds.pop(id(events), None)
        if feed is not None:
            feed.stop()


def _unless_absent(call: Callable[[], Any]) -> dict[str, Any] | None:
    """The JSON answer of ``call`` (made with _preload_content=False); None when it answers 404."""
    try:
        resp = call()
    except k8s_client.exceptions.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return dict(json.loads(resp.data))
