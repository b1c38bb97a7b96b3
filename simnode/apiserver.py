"""A Kubernetes API-server simulator that the real ``kubernetes`` Python client talks to.

It serves core/v1 ``pods`` (namespaced) and ``nodes``, and the ``resource.k8s.io/v1`` kinds of
:mod:`simnode.apiserver_resource` (DeviceClass, ResourceSlice, ResourceClaim with ``/status``,
ResourceClaimTemplate: list, watch, get, create, update, patch, delete), over plain HTTP on 127.0.0.1, with the
real server's JSON shapes, so a client built from :meth:`ApiServerSimulator.write_kubeconfig`
deserialises its answers into ``V1Pod``, ``V1PodList``, ``V1Node``, ``V1Status`` as usual.
Used by end-to-end tests, benchmarks and the demo of the node agent.

Served (see :mod:`~simnode.apiserver_http` for the routing):

* ``GET /api/v1/pods``, ``GET|POST|DELETE /api/v1/namespaces/{ns}/pods``: list (``labelSelector``,
  ``fieldSelector``, ``resourceVersion``/``resourceVersionMatch``, ``limit``/``continue``), watch
  (``watch=true`` or ``/api/v1/watch/...``; ``resourceVersion``, ``timeoutSeconds``,
  ``allowWatchBookmarks``, ``sendInitialEvents``), create, delete-collection;
* ``GET|PUT|PATCH|DELETE /api/v1/namespaces/{ns}/pods/{name}``, ``GET|PUT|PATCH .../status``,
  ``POST .../binding``;
* the same for ``/api/v1/nodes`` (cluster-scoped; delete answers a ``Status``);
* ``/version``, ``/api``, ``/api/v1``, ``/apis``, ``/healthz``, ``/livez``, ``/readyz``.

Semantics kept from the real server: one cluster-wide resourceVersion counter (a write bumps it;
a write that changes nothing does not); optimistic concurrency (a stale
``metadata.resourceVersion`` in a PUT or a patch answers 409 Conflict); watch from a
resourceVersion no longer in the bounded history answers HTTP 200 with one ``ERROR`` event
carrying a 410 ``Expired`` Status; a watch without resourceVersion (or ``"0"``) starts with an
``ADDED`` event per existing object; selectors apply to watches, and an object that stops (starts)
matching arrives as ``DELETED`` (``ADDED``); ``Status`` objects for errors with the real codes,
reasons and messages; pod defaulting and validation
(:mod:`~simnode.apiserver_objects`); graceful pod deletion: a DELETE of a scheduled, non-terminal pod
only sets ``deletionTimestamp`` and ``deletionGracePeriodSeconds`` (the grace given, else the pod's
``terminationGracePeriodSeconds``), and the pod stays until a DELETE with grace 0 (what the kubelet
sends once it has stopped the containers; :meth:`ApiServerSimulator.finish_deletion`); an unscheduled
or terminal pod, or a DELETE with grace 0, goes at once (``graceful_delete=False`` deletes every pod at
once, as no real server does); finalizers; authentication and RBAC: a bearer token of a service
account (:meth:`ApiServerSimulator.add_service_account`) is held to its rules, decided before the
resource is looked up (a refused request is 403 even for a resource not served here), a bearer token
no one issued answers 401, and a request without credentials is the simulator's own user, who may do
anything (the cluster harnesses run the agent and the extender as the service accounts of their
shipped manifests: :func:`simnode.apiserver_rbac.shipped_rules`); a watch without ``timeoutSeconds``
ends after ``[1, 2) x min_request_timeout`` (1800 s, the real server's ``--min-request-timeout``).

Differences a client may notice:

* namespaces are not objects: any namespace exists; only pods, nodes and the resource.k8s.io
  kinds are served (other resources answer 404);
* strategic merge patch is approximated (see :mod:`~simnode.apiserver_patch`);
  server-side apply (``application/apply-patch+yaml``) answers 415;
* no ``managedFields``, no ``metadata.generation``; quantities (pod resources and the
  resource.k8s.io kinds) are answered in canonical form as the real server does (``1000`` reads
  back as ``1k``, ``1000m`` as ``1``);
* only JSON (no protobuf/CBOR/YAML, no ``Table`` output, ``pretty`` ignored);
* a watch from a resourceVersion newer than the current one waits for it silently;
  bookmarks come every ``bookmark_interval`` seconds when ``allowWatchBookmarks`` is set;
* the direct helpers (:meth:`ApiServerSimulator.create_pod` ...) bypass validation of updates, keep
  a given ``metadata.uid`` and status on create, and :meth:`~ApiServerSimulator.update_pod`
  always writes (new resourceVersion and a MODIFIED event) even when nothing changed;
* ``set_down(True)`` answers 503 without ``Retry-After`` (urllib3 would otherwise retry it).

Run as a process for demos (serves until SIGTERM/SIGINT)::

    python -m simnode.apiserver --kubeconfig /tmp/kubeconfig [--node node-1] [--port N]
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

import kubernetes.client
import kubernetes.config
from urllib3.util.retry import Retry

from simnode.apiserver_errors import ApiError
from simnode.apiserver_faults import DownMode, Faults, RequestLog, RequestRecord
from simnode.apiserver_http import HttpContext, SimHTTPServer, version_info
from simnode.apiserver_objects import NODES, PODS, meta, node_object, pod_manifest
from simnode.apiserver_ops import Operations
from simnode.apiserver_rbac import Attributes, ServiceAccount, make_rules, shipped_account, shipped_rules
from simnode.apiserver_store import Change, Store, StoreBackup

log = logging.getLogger(__name__)

JSON = dict[str, Any]

__all__ = ["ApiError", "ApiServerSimulator", "DownMode", "RequestRecord", "main", "pod_manifest"]

CONTEXT_NAME = "gpumanager-sim"


class ApiServerSimulator:
    """An in-process Kubernetes API server for pods and nodes (thread-safe).

    Use as a context manager, or :meth:`start` / :meth:`stop`::

        with ApiServerSimulator() as sim:
            sim.add_node("node-1")
            sim.create_pod(pod_manifest("p0"))
            v1 = kubernetes.client.CoreV1Api(sim.client())
            v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=node-1")

    ``history``: changes kept for watch resumption (older resourceVersions answer 410).
    ``token``: when set, requests must carry ``Authorization: Bearer <token>`` (401 otherwise;
    none at all is the anonymous user, who may read only ``/version`` and the health paths).
    :meth:`add_service_account` adds users whose requests RBAC rules decide (403 otherwise, as the
    real server answers; :mod:`simnode.apiserver_rbac`); the simulator's own user may do anything.
    ``graceful_delete``: pod deletion as on a real cluster (see the module docstring); False
    removes every pod at once. ``bookmark_interval``: seconds between BOOKMARK
    events on watches that allow them (60 s, about what a real server does: an idle watch is
    silent that long). ``version``: the ``gitVersion`` of ``/version``. ``disabled_features``: feature
    gates that are off (as on Kubernetes 1.35, where ``DRADeviceTaints`` is alpha): the fields they
    guard are dropped from what is written, as the real server does (see
    :func:`simnode.apiserver_resource.drop_disabled_slice_fields`). ``min_request_timeout``: a watch
    without ``timeoutSeconds`` ends (cleanly) after a random ``[1, 2)`` times this many seconds, as the
    real server's ``--min-request-timeout`` (1800 s) ends it; 0 keeps it open until closed.
    ``resource_api``: False for a server that does not serve ``resource.k8s.io/v1`` (Kubernetes 1.33 and
    older, or ``--runtime-config=resource.k8s.io/v1=false``): its paths answer 404 with the Status of an
    unknown resource and ``/apis`` does not list the group.
    """

    def __init__(
        self,
        *,
        history: int = 1000,
        token: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        graceful_delete: bool = True,
        bookmark_interval: float = 60.0,
        version: str = "v1.31.4",
        disabled_features: Sequence[str] = (),
        min_request_timeout: float = 1800.0,
        resource_api: bool = True,
    ) -> None:
        self._host = host
        self._port = port
        self._store = Store(history)
        self._faults = Faults()
        self._requests = RequestLog()
        self._ops = Operations(
            self._store,
            graceful_delete=graceful_delete,
            disabled_features=frozenset(disabled_features),
            min_request_timeout=min_request_timeout,
        )
        self._ctx = HttpContext(
            store=self._store,
            ops=self._ops,
            faults=self._faults,
            requests=self._requests,
            version=version_info(version),
            token=token,
            bookmark_interval=bookmark_interval,
            resource_api=resource_api,
        )
        self._lock = threading.Lock()
        self._component_tokens: dict[str, str] = {}
        self._server: SimHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._started = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Listen (on a free port unless one was given) and serve in a background thread."""
        with self._lock:
            if self._started:
                return self
            self._ctx.stopping.clear()
            self._listen()
            self._started = True
        log.info("API-server simulator listening on %s", self.url)
        return self

    def _listen(self) -> None:
        server = SimHTTPServer((self._host, self._port), self._ctx)
        self._port = int(server.server_address[1])
        self._ctx.server_address = f"{self._host}:{self._port}"
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=f"apiserver-sim-{self._port}", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread

    def _unlisten(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.drop_connections()
        if thread is not None:
            thread.join(timeout=5)

    def stop(self) -> None:
        """Close every watch and connection and stop listening. Safe to call twice."""
        with self._lock:
            if not self._started:
                return
            self._started = False
            self._ctx.stopping.set()
            self._store.close_watches()
            self._unlisten()
        log.info("API-server simulator on port %d stopped", self._port)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The TCP port (known once started)."""
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        if not self._port:
            raise RuntimeError("the API-server simulator is not started")
        return f"http://{self._host}:{self._port}"

    # ------------------------------------------------------------------ clients

    def add_service_account(
        self, namespace: str, name: str, rules: Sequence[Mapping[str, Any]], *, token: str | None = None
    ) -> str:
        """Accept a bearer token (returned; made up unless given) as the service account
        ``namespace/name``, whose requests are then allowed only as ``rules`` (a ClusterRole's
        ``rules``) grant them, and answered 403 otherwise (:mod:`simnode.apiserver_rbac`). Write a
        kubeconfig for it with :meth:`write_kubeconfig` ``(token=...)``."""
        token = token or f"sa-{namespace}-{name}-{uuid.uuid4().hex}"
        self._ctx.rbac.add(token, ServiceAccount(namespace, name, make_rules(rules)))
        return token

    def authorized(self) -> list[tuple[str, Attributes]]:
        """``(user, attributes)`` of every request a service account's rules allowed so far."""
        with self._ctx.rbac._lock:
            return list(self._ctx.rbac.seen)

    def forbidden(self) -> list[tuple[str, Attributes]]:
        """``(user, attributes)`` of every request answered 403 by RBAC so far."""
        with self._ctx.rbac._lock:
            return list(self._ctx.rbac.refused)

    def kubeconfig(self, namespace: str = "default", *, token: str | None = None) -> JSON:
        """The kubeconfig document pointing at this server (token user when a token is set, or
        the given ``token``: a service account's, see :meth:`add_service_account`)."""
        token = token or self._ctx.token
        user: JSON = {"token": token} if token else {}
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [{"name": CONTEXT_NAME, "cluster": {"server": self.url}}],
            "users": [{"name": CONTEXT_NAME, "user": user}],
            "contexts": [
                {
                    "name": CONTEXT_NAME,
                    "context": {"cluster": CONTEXT_NAME, "user": CONTEXT_NAME, "namespace": namespace},
                }
            ],
            "current-context": CONTEXT_NAME,
        }

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default", token: str | None = None) -> Path:
        """Write :meth:`kubeconfig` to ``path`` (JSON, which is YAML) and return the path."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self.kubeconfig(namespace, token=token), indent=2) + "\n")
        return target

    def write_component_kubeconfig(self, path: str | Path, component: str) -> Path:
        """Write a kubeconfig for ``component`` (``device-plugin``, ``dra``, ``extender``) as the service
        account its shipped manifest binds, held to the rules that manifest grants it
        (:func:`simnode.apiserver_rbac.shipped_rules`), and return the path."""
        token = self.add_service_account("kube-system", shipped_account(component), shipped_rules(component))
        return self.write_kubeconfig(path, token=token)

    def component_client(self, component: str, *, retries: int | bool | None = None) -> Any:
        """A ``kubernetes.client.ApiClient`` for ``component`` (``device-plugin``, ``dra``, ``extender``)
        as the service account its shipped manifest binds, held to the rules that manifest grants it
        (one account per component and server)."""
        with self._lock:
            token = self._component_tokens.get(component)
        if token is None:
            token = self.add_service_account("kube-system", shipped_account(component), shipped_rules(component))
            with self._lock:
                token = self._component_tokens.setdefault(component, token)
        return self.client(retries=retries, token=token)

    def client(self, *, retries: int | bool | Retry | None = None, token: str | None = None) -> Any:
        """A ``kubernetes.client.ApiClient`` configured from :meth:`kubeconfig` (``token``: a service
        account's, see :meth:`add_service_account`; the simulator's own user otherwise).

        ``retries`` is urllib3's (a count of connection errors only, ``False``/``0`` for none, or a
        ``Retry``); the client's default is 3.
        """
        cfg = kubernetes.client.Configuration()
        config = self.kubeconfig(token=token)
        kubernetes.config.load_kube_config_from_dict(config_dict=config, client_configuration=cfg)  # type: ignore[no-untyped-call]
        if retries is not None:
            cfg.retries = retries
        return kubernetes.client.ApiClient(cfg)

    # ------------------------------------------------------------------ pods

    def create_pod(self, manifest: Mapping[str, Any]) -> JSON:
        """Store a pod as if created through the API (ADDED), keeping a given uid and status.

        Defaults and validation apply as on ``POST``; errors raise :class:`ApiError`.
        """
        body = copy.deepcopy(dict(manifest))
        namespace = str(meta(body).get("namespace") or "default")
        return self._ops.create(PODS, namespace, body, {}, from_api=False)

    def get_pod(self, namespace: str, name: str) -> JSON | None:
        """A copy of the stored pod, or None."""
        return self._store.get(PODS, (namespace, name))

    def update_pod(self, namespace: str, name: str, fn: Callable[[JSON], None]) -> JSON:
        """Change a pod in place with ``fn(pod)``; always a new resourceVersion and MODIFIED.

        No update rules apply (``spec.nodeName`` may be set, for instance). Raises
        :class:`ApiError` 404 when the pod does not exist.
        """

        def mutate(pod: JSON) -> JSON:
            fn(pod)
            meta(pod).pop("resourceVersion", None)
            return pod

        return self._store.update(PODS, (namespace, name), mutate, always_write=True)

    def set_pod_phase(self, namespace: str, name: str, phase: str, **status: Any) -> JSON:
        """Set ``status.phase`` (and any other status fields given, e.g. ``podIP="10.0.0.5"``)."""

        def change(pod: JSON) -> None:
            st = pod.setdefault("status", {})
            st["phase"] = phase
            st.update(copy.deepcopy(status))

        return self.update_pod(namespace, name, change)

    def delete_pod(self, namespace: str, name: str) -> JSON | None:
        """Remove a pod at once (DELETED), ignoring grace and finalizers; None when absent."""
        return self._store.remove_now(PODS, (namespace, name))

    def request_deletion(self, namespace: str, name: str, grace_seconds: int | None = None) -> JSON | None:
        """Delete a pod as a client's DELETE does: a scheduled, running pod only gets its
        ``deletionTimestamp`` (see the module docstring). Returns the pod's state, None when absent."""
        body: JSON = {} if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        try:
            return self._ops.delete(PODS, (namespace, name), body, {})
        except ApiError as err:
            if err.code == 404:
                return None
            raise

    def finish_deletion(self, namespace: str, name: str, uid: str | None = None) -> JSON | None:
        """Complete a graceful deletion as the kubelet does (a DELETE with grace 0 and, given ``uid``,
        that UID as precondition).

        The pod goes away unless finalizers hold it; returns the last state, None when absent (or,
        given ``uid``, when the pod of that name is another one).
        """
        try:
            obj, _deleted = self._store.delete(
                PODS, (namespace, name), grace_seconds=0, preconditions={"uid": uid} if uid else None
            )
        except ApiError as err:
            if err.code in (404, 409):
                return None
            raise
        return obj

    def pod_events(self) -> queue.Queue[tuple[str, JSON]]:
        """A queue of every later pod change, ``(ADDED|MODIFIED|DELETED, pod)``, fed in process: for
        stand-ins of other cluster components (the kubelet) whose own watch must not count among the
        watches and requests the tests look at. End it with :meth:`close_pod_events`."""
        events: queue.Queue[tuple[str, JSON]] = queue.Queue()

        def listener(change: Change) -> None:
            if change.kind is PODS:
                events.put((change.type, change.obj))

        self._store.add_listener(id(events), listener)
        return events

    def close_pod_events(self, events: queue.Queue[tuple[str, JSON]]) -> None:
        """Stop feeding a queue from :meth:`pod_events`."""
        self._store.remove_listener(id(events))

    def pods(self, namespace: str | None = None) -> list[JSON]:
        """Copies of every pod (of one namespace), ordered by namespace and name."""
        return [p for p in self._store.iter_objects(PODS) if namespace is None or meta(p).get("namespace") == namespace]

    # ------------------------------------------------------------------ nodes

    def add_node(
        self,
        name: str,
        labels: Mapping[str, str] | None = None,
        capacity: Mapping[str, str | int] | None = None,
        *,
        allocatable: Mapping[str, str | int] | None = None,
        annotations: Mapping[str, str] | None = None,
        ready: bool = True,
    ) -> JSON:
        """Register a node as a kubelet would (default labels, capacity, Ready condition)."""
        node = node_object(
            name, labels=labels, capacity=capacity, allocatable=allocatable, annotations=annotations, ready=ready
        )
        return self._ops.create(NODES, None, node, {}, from_api=False)

    def get_node(self, name: str) -> JSON | None:
        """A copy of the stored node, or None."""
        return self._store.get(NODES, ("", name))

    def update_node(self, name: str, fn: Callable[[JSON], None]) -> JSON:
        """Change a node in place with ``fn(node)``; always a new resourceVersion and MODIFIED."""

        def mutate(node: JSON) -> JSON:
            fn(node)
            meta(node).pop("resourceVersion", None)
            return node

        return self._store.update(NODES, ("", name), mutate, always_write=True)

    def delete_node(self, name: str) -> JSON | None:
        """Remove a node at once (DELETED); None when absent."""
        return self._store.remove_now(NODES, ("", name))

    def nodes(self) -> list[JSON]:
        """Copies of every node, ordered by name."""
        return list(self._store.iter_objects(NODES))

    # ------------------------------------------------------------------ history and log

    @property
    def resource_version(self) -> int:
        """The current cluster-wide resourceVersion."""
        return self._store.rv

    def compact(self, before_rv: int | str | None = None) -> int:
        """Drop history before ``before_rv`` (default: all of it), as etcd compaction does.

        A watch or exact list from a resourceVersion older than ``before_rv - 1`` then gets 410.
        Returns the oldest resourceVersion still usable.
        """
        return self._store.compact(int(before_rv) if before_rv is not None else None)

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request answered so far (method, path, query, status, content type, body)."""
        return self._requests.snapshot()

    def clear_requests(self) -> None:
        """Empty :attr:`requests`."""
        self._requests.clear()

    def backup(self) -> StoreBackup:
        """A snapshot of every object and the resourceVersion (what an etcd backup holds)."""
        return self._store.backup()

    def restore(self, backup: StoreBackup) -> None:
        """Go back to ``backup`` as a cluster whose etcd was restored from it does: its objects, its
        (lower) resourceVersion, no history, every watch dropped. A client resuming a watch from a
        resourceVersion seen since is answered 504 "Too large resource version" after a 3 s wait."""
        self._store.restore(backup)
        log.info("API-server simulator restored to resourceVersion %d", backup.rv)

    # ------------------------------------------------------------------ faults

    def set_down(self, down: bool, mode: DownMode = "503") -> None:
        """Take the server down or bring it back.

        ``mode="503"``: every request is answered 503 ServiceUnavailable and open watches end.
        ``mode="refuse"``: the listening socket closes (connections are refused) and open
        connections and watches are dropped; coming back listens on the same port.
        ``mode="hang"``: connections are accepted and requests read but not answered until the
        server is back (as an overloaded or partitioned API server does); open watches stay
        open and silent.
        """
        with self._lock:
            was = self._faults.down
            if down:
                if mode not in ("503", "refuse", "hang"):
                    raise ValueError(f"mode must be '503', 'refuse' or 'hang', got {mode!r}")
                self._faults.down = mode
                if mode == "hang":
                    pass
                elif mode == "refuse":
                    self._store.close_watches(abrupt=True)
                    if self._started:
                        self._unlisten()
                else:
                    self._store.close_watches()
                    if was == "refuse" and self._started:
                        self._listen()
            else:
                self._faults.down = None
                if was == "refuse" and self._started:
                    self._listen()
        log.info("API-server simulator %s", f"down ({mode})" if down else "up")

    def fail_next(
        self,
        method: str | None,
        path_regex: str,
        status: int = 500,
        count: int = 1,
        *,
        message: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        """Answer the next ``count`` requests matching ``method`` (None or ``*``: any) and
        ``path_regex`` (``re.search`` on the path, no query) with a ``status`` Status object.

        ``retry_after`` adds a ``Retry-After`` header; urllib3 (the client's transport) retries
        413/429/503 answers carrying one by itself, up to its retry limit.
        """
        self._faults.fail_next(method, path_regex, status, count, message, retry_after)

    def delay(self, path_regex: str, seconds: float, *, method: str | None = None, count: int | None = None) -> None:
        """Hold matching requests ``seconds`` before answering (``seconds <= 0`` removes the rule);
        ``count`` limits how many requests are held."""
        self._faults.delay(method, path_regex, seconds, count)

    def hold_watches(self, held: bool) -> None:
        """Keep every watch's events back (``True``) or send them on, in order (``False``): a watch
        lagging behind the writes, as a loaded API server's watch cache does, while reads are current."""
        self._faults.watches_held = held

    def set_disabled_features(self, gates: Sequence[str]) -> None:
        """The feature gates that are off from now on (the API server restarted with other
        ``--feature-gates``, or upgraded): later writes drop the fields of these gates only."""
        self._ops.disabled_features = frozenset(gates)

    def clear_faults(self) -> None:
        """Forget every :meth:`fail_next` and :meth:`delay` rule."""
        self._faults.clear()

    def close_watches(self, *, abrupt: bool = False) -> int:
        """End every open watch stream; returns how many were open.

        Cleanly (the chunked response ends, as on a server-side timeout) by default; ``abrupt``
        drops the connections instead. Either way the client has to watch again.
        """
        return self._store.close_watches(abrupt=abrupt)

    def watch_count(self) -> int:
        """How many watch streams are open."""
        return self._store.watcher_count()

    def wait_for_watches(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Wait until at least ``count`` watch streams are open; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._store.watcher_count() >= count:
                return True
            time.sleep(0.01)
        return self._store.watcher_count() >= count


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT, with a kubeconfig written for clients."""
    parser = argparse.ArgumentParser(prog="python -m simnode.apiserver", description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True, help="where to write the kubeconfig for clients")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--token", default=None, help="require this bearer token")
    parser.add_argument("--node", action="append", default=[], help="register a node (repeatable)")
    parser.add_argument("--history", type=int, default=1000, help="changes kept for watch resumption")
    parser.add_argument(
        "--graceful-delete",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a scheduled pod gets deletionTimestamp first and stays until its kubelet deletes it with grace 0",
    )
    parser.add_argument("--bookmark-interval", type=float, default=60.0, help="seconds between watch bookmarks")
    parser.add_argument(
        "--min-request-timeout",
        type=float,
        default=1800.0,
        help="a watch without timeoutSeconds ends after [1, 2) times this many seconds (0: never)",
    )
    parser.add_argument(
        "--service-accounts",
        type=Path,
        default=None,
        help="JSON file: a list of {namespace, name, token, rules}, users whose requests these RBAC rules decide",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log every request")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    done = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sim = ApiServerSimulator(
        history=args.history,
        token=args.token,
        port=args.port,
        graceful_delete=args.graceful_delete,
        bookmark_interval=args.bookmark_interval,
        min_request_timeout=args.min_request_timeout,
    )
    if args.service_accounts is not None:
        for account in json.loads(args.service_accounts.read_text()):
            sim.add_service_account(account["namespace"], account["name"], account["rules"], token=account["token"])
    with sim:
        for name in args.node:
            sim.add_node(name)
        path = sim.write_kubeconfig(args.kubeconfig)
        log.info("kubeconfig for %s written to %s", sim.url, path)
        done.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
