"""The extender process: watches of nodes and pods feeding the cluster state, the verbs, the server."""

from __future__ import annotations

import gc
import logging
import threading
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from gpumanager import __version__
from gpumanager.allocation import pods as podinfo
from gpumanager.extender.api import JSON, error_filter_result, parse_args, parse_binding
from gpumanager.extender.binder import Binder, BindError
from gpumanager.extender.charges import is_gpu_pod
from gpumanager.extender.decisions import Decider
from gpumanager.extender.metrics import ExtenderMetrics
from gpumanager.extender.placement import Policy
from gpumanager.extender.server import MAX_BODY, MAX_CONNECTIONS, ExtenderServer, Routes
from gpumanager.extender.state import ClusterState
from gpumanager.extender.watches import Watch

log = logging.getLogger(__name__)

#: The kube-scheduler's own pod informer ignores ended pods the same way.
POD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"
#: Seconds a watch may fail (after its first list) before /readyz says not ready, at most.
WATCH_GRACE = 30.0
#: Seconds the pods' watch waits for the nodes' first list before it starts anyway.
PODS_AFTER_NODES = 10.0
#: Seconds between two passes that take lapsed recorded choices off the nodes (see :meth:`Binder.drop_lapsed`).
SWEEP_EVERY = 5.0


def _gpu_pod(pod: dict[str, Any]) -> bool:
    """Pods worth keeping: not ended, with a GPU container, init containers included (those on or
    chosen for a node hold GPUs; the pending ones are kept so bind starts from the cached pod instead
    of reading it, and so that the watch tells when a pod bind assumed is bound or gone)."""
    return podinfo.phase(pod) not in ("Succeeded", "Failed") and is_gpu_pod(pod)


@dataclass(frozen=True)
class ExtenderSettings:
    """How the extender runs."""

    host: str = "0.0.0.0"
    port: int = 3456
    policy: Policy = "binpack"
    url_prefix: str = "/scheduler"
    tls: tuple[str, str] | None = None
    assume_ttl: float = 300.0
    bind_timeout: float = 4.0
    """Seconds a bind may take in all (below the scheduler's ``httpTimeout``, 5 s by default)."""
    idle_timeout: float = 120.0
    """Seconds a connection may stay silent (longer than Go's 90 s idle keep-alive, so the scheduler closes first)."""
    max_connections: int = MAX_CONNECTIONS
    """Connections served at once (see :data:`~gpumanager.extender.server.MAX_CONNECTIONS`)."""
    max_body: int = MAX_BODY
    """The largest request body taken, and the bytes of large bodies taken at once (see
    :data:`~gpumanager.extender.server.MAX_BODY`)."""
    watch_timeout: int = 60
    """Seconds each watch asks the API server to keep it open: one silent past it (and a few seconds
    more, :func:`~gpumanager.kube.reflector.watch_read_timeout`) is taken for a hung API server."""


class Extender:
    """Owns the watches, the state, the verbs and the HTTP server."""

    def __init__(self, api: client.ApiClient, settings: ExtenderSettings) -> None:
        self.settings = settings
        self.state = ClusterState(assume_ttl=settings.assume_ttl)
        self._stopping = threading.Event()
        self._sweep_errors: dict[str, str] = {}
        self.decider = Decider(self.state, settings.policy)
        self.metrics = ExtenderMetrics(self._sizes)
        self.binder = Binder(
            api,
            self.state,
            settings.policy,
            timeout=settings.bind_timeout,
            on_conflict=self.metrics.conflicts.inc,
            cached=self._cached_pod,
        )
        core = client.CoreV1Api(api)
        self.nodes = Watch("nodes", core.list_node, watch_timeout=settings.watch_timeout)
        # A relist that no longer shows a pod bind bound (deleted or ended during a watch gap, and
        # never shown by the watch) releases it: no event of it will come.
        self.pods = Watch(
            "pods",
            core.list_pod_for_all_namespaces,
            field_selector=POD_SELECTOR,
            keep=_gpu_pod,
            watch_timeout=settings.watch_timeout,
            on_relist=lambda since, uids: self.state.relisted(uids, since),
        )
        self.nodes.add_listener(lambda kind, obj, _prev: self.state.node_event(kind, obj))
        self.pods.add_listener(lambda kind, obj, _prev: self.state.pod_event(kind, obj))
        routes = Routes(
            verbs={"filter": self.filter, "prioritize": self.prioritize, "bind": self.bind},
            ready=self.ready,
            version={"version": __version__, "component": "gpu-manager-extender", "policy": settings.policy},
        )
        self.server = ExtenderServer(
            settings.host,
            settings.port,
            routes,
            self.metrics,
            url_prefix=settings.url_prefix,
            tls=settings.tls,
            idle_timeout=settings.idle_timeout,
            max_connections=settings.max_connections,
            max_body=settings.max_body,
        )

    def _cached_pod(self, uid: str) -> dict[str, Any] | None:
        return self.pods.get(uid) if uid else None

    def start(self) -> None:
        """Start watching and serving (verbs answer once the watches have listed). The pods are listed
        once the nodes have been (or after :data:`PODS_AFTER_NODES` seconds): a choice recorded on a node
        for a pod that list no longer shows was one of a pod deleted or ended since, and holds nothing."""
        self.nodes.start()
        threading.Thread(target=self._start_pods, name="pods-after-nodes", daemon=True).start()
        self.server.start()
        threading.Thread(target=self._settle, name="gc-freeze", daemon=True).start()
        threading.Thread(target=self._sweep, name="lapsed-choices", daemon=True).start()
        log.info("policy %s; watching nodes and pods", self.settings.policy)

    def _start_pods(self) -> None:
        self.nodes.wait_synced(PODS_AFTER_NODES)
        self.pods.start()

    def _settle(self) -> None:
        """Once the first lists are in, move them out of the garbage collector's way: a full collection
        would otherwise walk every cached node and pod (tens of milliseconds at a few thousand pods)
        in the middle of some request. Objects replaced later are still freed by reference counting."""
        if self.nodes.wait_synced(600) and self.pods.wait_synced(600):
            gc.collect()
            gc.freeze()
            log.info(
                "caches synced: %d nodes with GPUs, %d pods counted",
                len(self.state.node_names()),
                self.state.pod_count(),
            )

    def _sweep(self) -> None:
        """Every :data:`SWEEP_EVERY` seconds, take the recorded choices that lapsed off their nodes."""
        while not self._stopping.wait(SWEEP_EVERY):
            if not self.synced():
                continue
            for name in self.state.nodes_with_lapsed_claims():
                try:
                    self.binder.drop_lapsed(name)
                except Exception as exc:  # the API server's answer, a timeout: the next pass tries again
                    text = f"{type(exc).__name__}: {exc}"
                    # A conflict is a bind writing meanwhile (it drops them too); other errors once each.
                    quiet = getattr(exc, "status", None) == 409 or self._sweep_errors.get(name) == text
                    self._sweep_errors[name] = text
                    (log.debug if quiet else log.warning)(
                        "node %s: cannot take the lapsed choices recorded on it off: %s", name, text[:300]
                    )

    def stop(self) -> None:
        """Stop serving and watching."""
        self._stopping.set()
        # The binds being answered finish first (each within --bind-timeout), the watches still running.
        self.server.stop(drain=self.settings.bind_timeout + 1.0)
        self.pods.stop()
        self.nodes.stop()

    def synced(self) -> bool:
        """Whether both watches have listed once."""
        return self.nodes.synced() and self.pods.synced()

    def ready(self) -> tuple[bool, dict[str, object]]:
        """/readyz: the caches are synced, and neither watch has been failing for longer than
        :attr:`watch_grace` seconds (the state would go stale unseen)."""
        ok = self.synced()
        detail: dict[str, object] = {"nodes_synced": self.nodes.synced(), "pods_synced": self.pods.synced()}
        for watch in (self.nodes, self.pods):
            failing = watch.failing()
            if failing is not None and failing[0] > self.watch_grace:
                ok = False
                detail[f"{watch.name}_watch_failing_s"] = round(failing[0], 1)
                detail[f"{watch.name}_watch_error"] = failing[1]
        return ok, detail

    @property
    def watch_grace(self) -> float:
        """Seconds a watch may fail before /readyz says not ready: 30, or ``assume_ttl`` when shorter."""
        return min(WATCH_GRACE, self.settings.assume_ttl)

    def _sizes(self) -> dict[str, float]:
        return {
            "assumed_pods": self.state.assumed_count(),
            "pods": self.state.pod_count(),
            "unplaced_containers": self.state.unplaced(),
            "nodes": len(self.state.node_names()),
            "caches_synced": 1.0 if self.synced() else 0.0,
        }

    # -- verbs ------------------------------------------------------------------------------------

    def _not_ready(self) -> str:
        return "" if self.synced() else "the extender has not listed nodes and pods yet; try again"

    def filter(self, body: bytes) -> tuple[JSON, int]:
        """POST <prefix>/filter."""
        args = parse_args(body)
        problem = self._not_ready()
        if problem:
            self.metrics.decisions.labels("filter", "error").inc()
            return error_filter_result(problem), 200
        result, outcomes = self.decider.filter(args)
        for outcome, n in outcomes.items():
            self.metrics.decisions.labels("filter", outcome).inc(n)
        return result, 200

    def prioritize(self, body: bytes) -> tuple[list[JSON], int]:
        """POST <prefix>/prioritize."""
        args = parse_args(body)
        if self._not_ready():
            return [{"Host": name, "Score": 0} for name in args.names], 200
        return self.decider.prioritize(args), 200

    def bind(self, body: bytes) -> tuple[JSON, int]:
        """POST <prefix>/bind."""
        args = parse_binding(body)
        problem = self._not_ready()
        if problem:
            self.metrics.decisions.labels("bind", "error").inc()
            return {"Error": problem}, 200
        try:
            outcome = self.binder.bind(args)
        except BindError as exc:
            log.warning("bind %s/%s to %s: %s", args.pod_namespace, args.pod_name, args.node, exc)
            self.metrics.decisions.labels("bind", exc.outcome).inc()
            return {"Error": str(exc)}, 200
        self.metrics.decisions.labels("bind", outcome).inc()
        return {"Error": ""}, 200
