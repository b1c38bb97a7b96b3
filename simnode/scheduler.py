"""A kube-scheduler stand-in that calls scheduler extenders over HTTP, as configured for the real one.

It reads the ``extenders`` of a ``KubeSchedulerConfiguration`` (v1: ``urlPrefix``, ``filterVerb``,
``prioritizeVerb``, ``bindVerb``, ``weight``, ``nodeCacheCapable``, ``httpTimeout``,
``ignorable``, ``managedResources``) and schedules the pods whose ``spec.schedulerName`` is its
own, the way kube-scheduler does:

* one scheduling cycle at a time: the in-tree filter (``NodeResourcesFit`` on the resources the
  pod requests, counted as kube-scheduler counts them: app containers and sidecars added up, each
  ordinary init container beside the sidecars before it, ``spec.overhead`` on top; against
  ``status.allocatable`` minus what pods bound or assumed there request; managed resources with
  ``ignoredByScheduler: true`` are left to the extender;
  ``nodeSelector``; Ready and schedulable nodes), then each interested extender's filter (an
  extender is interested when the pod requests one of its managed resources), then - with more
  than one node left - the extenders' prioritize (``score x weight x 10``; errors ignored, as
  kube-scheduler does), the highest total wins, ties broken at random; the nodes go to the extenders
  in a random order (kube-scheduler's parallel filter promises none), from a seed printed on stderr
  that ``SIMNODE_SCHEDULER_SEED`` (or ``seed``) repeats;
* the pod is *assumed* on its node (its requests count there) and bound in the background (each
  in a thread of its own, as kube-scheduler's binding goroutines, up to ``bind_workers`` (1024) at
  once): through the extender that has a bind
  verb, else by POSTing the Binding itself; on failure the assumption is dropped and the pod
  goes back to the queue with a backoff (1 s doubling to 10 s);
* a pod that fits nowhere gets ``PodScheduled=False, reason Unschedulable`` with a
  "0/N nodes are available: <count> <reason>, ..." message (kube-scheduler's: no node named) and
  waits until a pod is deleted or a node changes what scheduling looks at (allocatable, labels,
  annotations, taints, schedulability, conditions) (or ``unschedulable_timeout``, 5 minutes as
  kube-scheduler), then tries again after its backoff; such an event during the pod's own attempt
  sends it back after its backoff at once (kube-scheduler's move request cycle).

An extender's answer naming a node that was not offered is an error, as in kube-scheduler; an
error from a non-ignorable extender fails the attempt. Its HTTP calls are Go's: a POST that went
out is never sent again (a bind the extender got and then dropped the connection of fails), an
answer other than 200 is reported as ``failed <verb> with extender at URL <url>, code <status>``
without its body, and an answer that is not JSON is an error. Not modelled: preemption, in-tree
scoring plugins, taints, affinity, volumes, scheduling gates, PreBind.
"""

from __future__ import annotations

import heapq
import http.client
import itertools
import json
import logging
import os
import random
import select
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.utils import parse_quantity as _parse_quantity

from gpumanager.kube.reflector import Reflector

log = logging.getLogger(__name__)

JSON = dict[str, Any]
DEFAULT_SCHEDULER = "default-scheduler"
MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10


def go_duration(text: str | int | float) -> float:
    """Seconds of a Go duration (``10s``, ``500ms``, ``1m30s``) or a plain number."""
    if isinstance(text, int | float):
        return float(text)
    total, number = 0.0, ""
    units = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    i = 0
    while i < len(text):
        ch = text[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = text[i : i + 2] if text[i : i + 2] in units else ch
        if unit not in units or not number:
            raise ValueError(f"{text!r} is not a duration")
        total += float(number) * units[unit]
        number = ""
        i += len(unit)
    if number:
        raise ValueError(f"{text!r} is not a duration (missing unit)")
    return total


@dataclass(frozen=True)
class ExtenderConfig:
    """One ``extenders[]`` entry of a KubeSchedulerConfiguration."""

    url_prefix: str
    filter_verb: str = ""
    prioritize_verb: str = ""
    bind_verb: str = ""
    weight: int = 1
    node_cache_capable: bool = False
    http_timeout: float = 5.0
    ignorable: bool = False
    managed_resources: tuple[str, ...] = ()
    ignored_by_scheduler: tuple[str, ...] = ()
    """Managed resources with ``ignoredByScheduler: true``: the in-tree NodeResourcesFit leaves them to the extender."""

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ExtenderConfig:
        """From the YAML mapping (kube-scheduler's field names)."""
        return cls(
            url_prefix=str(raw["urlPrefix"]),
            filter_verb=str(raw.get("filterVerb", "")),
            prioritize_verb=str(raw.get("prioritizeVerb", "")),
            bind_verb=str(raw.get("bindVerb", "")),
            weight=int(raw.get("weight", 1)),
            node_cache_capable=bool(raw.get("nodeCacheCapable", False)),
            http_timeout=go_duration(raw.get("httpTimeout", "5s")),
            ignorable=bool(raw.get("ignorable", False)),
            managed_resources=tuple(str(m["name"]) for m in raw.get("managedResources") or []),
            ignored_by_scheduler=tuple(
                str(m["name"]) for m in raw.get("managedResources") or [] if m.get("ignoredByScheduler")
            ),
        )

    def interested(self, pod: Mapping[str, Any]) -> bool:
        """kube-scheduler's IsInterested: no managed resources, or the pod requests one of them."""
        if not self.managed_resources:
            return True
        spec = pod.get("spec") or {}
        for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
            resources = c.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            if any(r in asked for r in self.managed_resources):
                return True
        return False


def load_configuration(path: str | Path, *, url_prefix: str | None = None) -> tuple[str, list[ExtenderConfig]]:
    """(scheduler name of the first profile, extenders) of a KubeSchedulerConfiguration file.

    ``url_prefix`` replaces every extender's ``urlPrefix`` (the file names a cluster address).
    """
    doc = yaml.safe_load(Path(path).read_text())
    if doc.get("kind") != "KubeSchedulerConfiguration":
        raise ValueError(f"{path}: kind is {doc.get('kind')!r}, not KubeSchedulerConfiguration")
    profiles = doc.get("profiles") or [{}]
    name = str(profiles[0].get("schedulerName") or DEFAULT_SCHEDULER)
    extenders = []
    for raw in doc.get("extenders") or []:
        if url_prefix is not None:
            raw = {**raw, "urlPrefix": url_prefix}
        extenders.append(ExtenderConfig.from_dict(raw))
    return name, extenders


def profile_names(path: str | Path) -> tuple[str, ...]:
    """The ``schedulerName`` of every profile of a KubeSchedulerConfiguration file (kube-scheduler
    schedules the pods of each; its extenders serve them all)."""
    doc = yaml.safe_load(Path(path).read_text())
    profiles = doc.get("profiles") or [{}]
    return tuple(str(p.get("schedulerName") or DEFAULT_SCHEDULER) for p in profiles)


class ExtenderCallError(Exception):
    """An extender call failed (connection, timeout, status, or an ``Error`` in the answer)."""


class ExtenderClient:
    """HTTP calls to one extender, keeping one connection per thread (as Go's client reuses them)."""

    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        url = urllib.parse.urlsplit(config.url_prefix)
        if url.scheme != "http":
            raise ValueError(f"only http extenders are supported by the stand-in: {config.url_prefix}")
        self._host = url.hostname or "127.0.0.1"
        self._port = url.port or 80
        self._path = url.path.rstrip("/")
        self._local = threading.local()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """(a connection, whether it is a kept-alive one being reused). As Go's transport, whose read
        loop sees an idle connection the server closed and drops it, a kept-alive connection with
        something to read (its end, or bytes nobody asked for) is closed and a new one dialled."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and (conn.sock is None or select.select([conn.sock], [], [], 0)[0]):
            conn.close()
            conn = None
        if conn is not None:
            return conn, True
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.config.http_timeout)
        conn.connect()
        if conn.sock is not None:  # as Go's net/http: no Nagle delay between headers and body
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local.conn = conn
        return conn, False

    def _drop(self, conn: http.client.HTTPConnection | None) -> None:
        if conn is not None:
            conn.close()
        self._local.conn = None

    def call(self, verb: str, body: object) -> Any:
        """POST ``<urlPrefix>/<verb>``; raises :class:`ExtenderCallError`.

        As kube-scheduler's Go client: a POST that went out is never sent again (only one that could
        not be written on a reused connection is), an answer other than 200 is reported by its status
        alone (its body is not read), and an answer that is not JSON is an error.
        """
        data = json.dumps(body).encode()
        where = self.config.url_prefix
        for attempt in (1, 2):
            conn: http.client.HTTPConnection | None = None
            reused = False
            try:
                conn, reused = self._connection()
                conn.request("POST", f"{self._path}/{verb}", body=data, headers={"Content-Type": "application/json"})
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                if attempt == 1 and reused and not isinstance(exc, TimeoutError):
                    continue  # nothing reached the extender: safe to send on a new connection
                raise ExtenderCallError(f"{verb} at {where}: {exc}") from exc
            try:
                resp = conn.getresponse()
                payload = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                self._drop(conn)
                raise ExtenderCallError(f"{verb} at {where}: {exc}") from exc
            if resp.will_close:
                self._drop(conn)
            if resp.status != 200:
                raise ExtenderCallError(f"failed {verb} with extender at URL {where}, code {resp.status}")
            try:
                return json.loads(payload)
            except ValueError as exc:
                raise ExtenderCallError(f"{verb} at {where}: the answer is not JSON: {exc}") from exc
        raise AssertionError("unreachable")


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity (``500m``, ``1Gi``, ``100``) as a Decimal."""
    return Decimal(_parse_quantity(value))  # type: ignore[no-untyped-call]


def pod_requests(pod: Mapping[str, Any]) -> dict[str, Decimal]:
    """The pod's effective requests, as kube-scheduler's ``PodRequests`` counts them, per resource.

    The app containers and the sidecars (init containers with ``restartPolicy: Always``, which run
    beside them) add up; an ordinary init container runs beside the sidecars started before it, and
    the pod asks for the larger of the two; ``spec.overhead`` adds to it all.
    """
    spec = pod.get("spec") or {}

    def asked(c: Mapping[str, Any]) -> dict[str, Decimal]:
        resources = c.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        return {str(name): parse_quantity(value) for name, value in merged.items()}

    def add(into: dict[str, Decimal], more: Mapping[str, Decimal]) -> None:
        for name, value in more.items():
            into[name] = into.get(name, Decimal(0)) + value

    total: dict[str, Decimal] = {}
    for c in spec.get("containers") or []:
        add(total, asked(c))
    sidecars: dict[str, Decimal] = {}
    inits: dict[str, Decimal] = {}
    for c in spec.get("initContainers") or []:
        own = asked(c)
        if c.get("restartPolicy") == "Always":
            add(total, own)
            add(sidecars, own)
            running = dict(sidecars)
        else:
            running = dict(own)
            add(running, sidecars)
        for name, value in running.items():
            inits[name] = max(inits.get(name, Decimal(0)), value)
    for name, value in inits.items():
        total[name] = max(total.get(name, Decimal(0)), value)
    add(total, {str(k): parse_quantity(v) for k, v in (spec.get("overhead") or {}).items()})
    return total


def node_fit_failure(
    pod: Mapping[str, Any],
    node: Mapping[str, Any],
    used: Mapping[str, Decimal],
    ignored: frozenset[str] = frozenset(),
) -> str:
    """ "" when the in-tree filters pass, else the reason (as kube-scheduler words it)."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return "node(s) were unschedulable"
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    if not ready or ready[0].get("status") != "True":
        return "node(s) were not ready"
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    labels = _meta(node).get("labels") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return "node(s) didn't match Pod's node affinity/selector"
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    asked = pod_requests(pod)
    asked["pods"] = Decimal(1)
    for name, value in sorted(asked.items()):
        if value <= 0 or name in ignored:
            continue
        have = parse_quantity(allocatable[name]) if name in allocatable else Decimal(0)
        if used.get(name, Decimal(0)) + value > have:
            return "Too many pods" if name == "pods" else f"Insufficient {name}"
    return ""


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _key(pod: Mapping[str, Any]) -> str:
    return f"{_meta(pod).get('namespace', 'default')}/{_meta(pod).get('name', '')}"


def _scheduling_properties(node: Mapping[str, Any]) -> tuple[object, ...]:
    """What of a node, changed, makes kube-scheduler move unschedulable pods back to its queue: its
    allocatable, labels, annotations, taints, schedulability, and conditions (not their heartbeat times)."""
    status = node.get("status") or {}
    spec = node.get("spec") or {}
    conditions = sorted(
        (str(c.get("type")), str(c.get("status")), str(c.get("reason", ""))) for c in status.get("conditions") or []
    )
    return (
        status.get("allocatable"),
        _meta(node).get("labels"),
        _meta(node).get("annotations"),
        spec.get("taints"),
        bool(spec.get("unschedulable")),
        conditions,
    )


def _terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


@dataclass
class _Queued:
    attempts: int = 0
    unschedulable_since: float | None = None
    last_message: str = ""
    cycle: int = 0  # the scheduling cycle of its latest attempt


@dataclass
class SchedulerStats:
    """What the stand-in did."""

    scheduled: int = 0
    attempts: int = 0
    unschedulable: int = 0
    bind_failures: int = 0
    extender_errors: int = 0
    messages: dict[str, str] = field(default_factory=dict)
    """Pod (namespace/name) -> the last reason it could not be scheduled or bound."""


class SchedulerStandIn:
    """Schedules the pods of ``scheduler_name`` (one name, or the names of every profile) with
    ``extenders``. Thread-safe; start/stop."""

    def __init__(
        self,
        api: client.ApiClient,
        extenders: Sequence[ExtenderConfig] = (),
        *,
        scheduler_name: str | Sequence[str] = DEFAULT_SCHEDULER,
        initial_backoff: float = 1.0,
        max_backoff: float = 10.0,
        unschedulable_timeout: float = 300.0,
        bind_workers: int = 1024,
        seed: int | None = None,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._extenders = [ExtenderClient(e) for e in extenders]
        self._ignored = frozenset(r for e in extenders for r in e.ignored_by_scheduler)
        names = (scheduler_name,) if isinstance(scheduler_name, str) else tuple(scheduler_name)
        self.scheduler_names = names
        self.scheduler_name = names[0]
        """The first profile's name."""
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._unschedulable_timeout = unschedulable_timeout
        if seed is None:
            # A fresh order each run, as kube-scheduler's; named on stderr (shown with a failed test's output) so
            # that SIMNODE_SCHEDULER_SEED repeats it.
            pinned = os.environ.get("SIMNODE_SCHEDULER_SEED", "")
            seed = int(pinned) if pinned.strip() else random.randrange(2**32)
            print(f"scheduler stand-in: seed {seed} (SIMNODE_SCHEDULER_SEED={seed} repeats it)", file=sys.stderr)
        #: The seed of the node order and of the ties between scores.
        self.seed = seed
        self._random = random.Random(seed)
        self.nodes = Reflector("scheduler-nodes", self._core.list_node)
        self.pods = Reflector("scheduler-pods", self._core.list_pod_for_all_namespaces)
        self.nodes.add_listener(self._on_node)
        self.pods.add_listener(self._on_pod)
        self._lock = threading.Condition()
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._queued: dict[str, _Queued] = {}
        self._waiting: set[str] = set()  # unschedulable: wait for a cluster event
        self._in_flight: set[str] = set()  # being scheduled or bound
        # kube-scheduler's scheduling cycle (one a pod taken from the queue) and the cycle of the latest
        # cluster event that moves unschedulable pods: a pod found unschedulable after such an event came
        # during its attempt goes back to the queue after its backoff (the event may have made it fit).
        self._cycle = 0
        self._move_cycle = -1
        self._assumed: dict[str, tuple[str, dict[str, Decimal]]] = {}
        self._binders = ThreadPoolExecutor(max_workers=bind_workers, thread_name_prefix="sched-bind")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = SchedulerStats()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> SchedulerStandIn:
        """Watch nodes and pods and start scheduling."""
        self.nodes.start()
        self.pods.start()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop scheduling (binds in flight finish)."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._binders.shutdown(wait=True)
        self.pods.stop()
        self.nodes.stop()

    def idle(self) -> bool:
        """No pod is queued (ready or backing off), being scheduled or bound."""
        with self._lock:
            return not self._in_flight and all(uid in self._waiting for _, _, uid in self._heap)

    def pending(self) -> int:
        """Pods queued, waiting, or in flight."""
        with self._lock:
            return len(self._queued)

    # -- events -----------------------------------------------------------------------------------

    def _mine(self, pod: Mapping[str, Any]) -> bool:
        spec = pod.get("spec") or {}
        return (
            not spec.get("nodeName")
            and (spec.get("schedulerName") or DEFAULT_SCHEDULER) in self.scheduler_names
            and not _terminal(pod)
            and not _meta(pod).get("deletionTimestamp")
        )

    def _on_pod(self, kind: str, pod: JSON, _prev: JSON | None) -> None:
        uid = str(_meta(pod).get("uid", ""))
        with self._lock:
            if kind != "DELETED" and self._mine(pod):
                if uid not in self._queued:
                    self._queued[uid] = _Queued()
                    self._push(uid, time.monotonic())
                return
            self._queued.pop(uid, None)
            self._waiting.discard(uid)
            # Seen bound (its requests now count from the cache) or gone: no assumption needed.
            self._assumed.pop(uid, None)
            if kind == "DELETED" or _terminal(pod):
                self._wake_waiting()

    def _on_node(self, kind: str, node: JSON, prev: JSON | None) -> None:
        if kind == "MODIFIED" and prev is not None and _scheduling_properties(prev) == _scheduling_properties(node):
            return
        with self._lock:
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        """A cluster event: unschedulable pods go back to the queue (after their backoff)."""
        self._move_cycle = self._cycle
        for uid in list(self._waiting):
            self._waiting.discard(uid)
            queued = self._queued.get(uid)
            if queued is not None:
                queued.unschedulable_since = None
                self._push(uid, time.monotonic() + self._backoff(queued.attempts))
        self._lock.notify_all()

    def _push(self, uid: str, when: float) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), uid))
        self._lock.notify_all()

    def _backoff(self, attempts: int) -> float:
        if attempts <= 0:
            return 0.0
        return float(min(self._initial_backoff * 2 ** (attempts - 1), self._max_backoff))

    # -- the loop ---------------------------------------------------------------------------------

    def _next(self) -> str | None:
        with self._lock:
            while not self._stop.is_set():
                now = time.monotonic()
                for uid in list(self._waiting):
                    q = self._queued.get(uid)
                    since = q.unschedulable_since if q is not None else None
                    if q is not None and since is not None and now - since >= self._unschedulable_timeout:
                        self._waiting.discard(uid)
                        q.unschedulable_since = None
                        self._push(uid, now)
                if self._heap and self._heap[0][0] <= now:
                    _, _, uid = heapq.heappop(self._heap)
                    if uid in self._queued and uid not in self._waiting and uid not in self._in_flight:
                        self._in_flight.add(uid)
                        self._cycle += 1
                        self._queued[uid].cycle = self._cycle
                        return uid
                    continue
                wait = self._heap[0][0] - now if self._heap else 1.0
                self._lock.wait(timeout=min(max(wait, 0.001), 1.0))
        return None

    def _run(self) -> None:
        self.nodes.wait_synced(30)
        self.pods.wait_synced(30)
        while not self._stop.is_set():
            uid = self._next()
            if uid is None:
                return
            try:
                self._schedule(uid)
            except Exception:
                log.exception("scheduling pod %s failed", uid)
                self._retry(uid, "internal error", unschedulable=False)

    def _retry(self, uid: str, message: str, *, unschedulable: bool) -> None:
        with self._lock:
            self._in_flight.discard(uid)
            queued = self._queued.get(uid)
            if queued is None:
                return
            queued.attempts += 1
            queued.last_message = message
            if unschedulable and self._move_cycle < queued.cycle:
                queued.unschedulable_since = time.monotonic()
                self._waiting.add(uid)
            else:
                self._push(uid, time.monotonic() + self._backoff(queued.attempts))

    def _usage(self) -> dict[str, dict[str, Decimal]]:
        """Node -> requests of the pods bound or assumed there (and a pod count)."""
        used: dict[str, dict[str, Decimal]] = {}
        seen: set[str] = set()
        for pod in self.pods.objects():
            node = (pod.get("spec") or {}).get("nodeName")
            if not node or _terminal(pod):
                continue
            uid = str(_meta(pod).get("uid", ""))
            seen.add(uid)
            into = used.setdefault(node, {})
            for name, value in pod_requests(pod).items():
                into[name] = into.get(name, Decimal(0)) + value
            into["pods"] = into.get("pods", Decimal(0)) + 1
        with self._lock:
            assumed = [(u, a) for u, a in self._assumed.items() if u not in seen]
        for _, (node, requests) in assumed:
            into = used.setdefault(node, {})
            for name, value in requests.items():
                into[name] = into.get(name, Decimal(0)) + value
            into["pods"] = into.get("pods", Decimal(0)) + 1
        return used

    def _schedule(self, uid: str) -> None:
        pod = self.pods.get(uid)
        if pod is None or not self._mine(pod):
            with self._lock:
                self._in_flight.discard(uid)
                self._queued.pop(uid, None)
            return
        self.stats.attempts += 1
        key = _key(pod)
        nodes = {str(_meta(n).get("name")): n for n in self.nodes.objects()}
        used = self._usage()
        reasons: dict[str, str] = {}
        feasible = []
        # kube-scheduler filters the nodes in parallel, from a start that moves on at every cycle: the
        # extenders get the feasible ones in no particular order.
        order = list(nodes)
        self._random.shuffle(order)
        for name in order:
            why = node_fit_failure(pod, nodes[name], used.get(name, {}), self._ignored)
            if why:
                reasons[name] = why
            else:
                feasible.append(name)
        interested = [e for e in self._extenders if e.config.interested(pod)]
        for ext in interested:
            if not feasible or not ext.config.filter_verb:
                continue
            try:
                passed, failed = self._extender_filter(ext, pod, [nodes[n] for n in feasible])
            except ExtenderCallError as exc:
                self.stats.extender_errors += 1
                if ext.config.ignorable:
                    log.warning("ignorable extender failed: %s", exc)
                    continue
                self._failed(uid, key, pod, f"extender error: {exc}", unschedulable=False)
                return
            reasons.update(failed)
            feasible = [n for n in feasible if n in passed]
        if not feasible:
            counts = Counter(reasons.values())
            # kube-scheduler's FitError: each reason counted over the nodes, sorted as text, no node named.
            detail = ", ".join(sorted(f"{n} {why}" for why, n in counts.items()))
            per_node = "; ".join(f"{n}: {why}" for n, why in sorted(reasons.items()))
            log.info("pod %s fits no node: %s", key, per_node)
            self.stats.unschedulable += 1
            message = f"0/{len(nodes)} nodes are available: {detail}."
            self._failed(uid, key, pod, message, unschedulable=True)
            return
        chosen = feasible[0] if len(feasible) == 1 else self._score(pod, interested, [nodes[n] for n in feasible])
        with self._lock:
            self._assumed[uid] = (chosen, pod_requests(pod))
        binder = next((e for e in interested if e.config.bind_verb), None)
        self._binders.submit(self._bind, uid, key, pod, chosen, binder)

    def _extender_filter(self, ext: ExtenderClient, pod: JSON, nodes: list[JSON]) -> tuple[set[str], dict[str, str]]:
        names = [str(_meta(n).get("name")) for n in nodes]
        if ext.config.node_cache_capable:
            args: JSON = {"Pod": pod, "Nodes": None, "NodeNames": names}
        else:
            args = {"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}
        result = ext.call(ext.config.filter_verb, args)
        if result.get("Error"):
            raise ExtenderCallError(str(result["Error"]))
        if ext.config.node_cache_capable:
            passed = list(result.get("NodeNames") or [])
        else:
            passed = [str(_meta(n).get("name")) for n in (result.get("Nodes") or {}).get("items") or []]
        unknown = [n for n in passed if n not in names]
        if unknown:
            raise ExtenderCallError(f"extender claims filtered node(s) {unknown} that were not in the input list")
        failed = {**(result.get("FailedNodes") or {}), **(result.get("FailedAndUnresolvableNodes") or {})}
        return set(passed), {str(k): str(v) for k, v in failed.items()}

    def _score(self, pod: JSON, interested: list[ExtenderClient], nodes: list[JSON]) -> str:
        names = [str(_meta(n).get("name")) for n in nodes]
        totals = dict.fromkeys(names, 0)
        for ext in interested:
            if not ext.config.prioritize_verb:
                continue
            if ext.config.node_cache_capable:
                args: JSON = {"Pod": pod, "Nodes": None, "NodeNames": names}
            else:
                args = {"Pod": pod, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}
            try:
                answer = ext.call(ext.config.prioritize_verb, args)
            except ExtenderCallError as exc:
                log.info("prioritize ignored: %s", exc)  # kube-scheduler ignores prioritize errors
                continue
            for host in answer or []:
                if host.get("Host") in totals:
                    scale = MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY
                    totals[host["Host"]] += int(host.get("Score", 0)) * ext.config.weight * scale
        best = max(totals.values())
        return self._random.choice([n for n in names if totals[n] == best])

    def _bind(self, uid: str, key: str, pod: JSON, node: str, binder: ExtenderClient | None) -> None:
        namespace, name = key.split("/", 1)
        try:
            if binder is not None:
                answer = binder.call(
                    binder.config.bind_verb,
                    {"PodName": name, "PodNamespace": namespace, "PodUID": uid, "Node": node},
                )
                if answer.get("Error"):
                    raise ExtenderCallError(str(answer["Error"]))
            else:
                body: Any = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name, "namespace": namespace, "uid": uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                }
                self._core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)
        except Exception as exc:
            self.stats.bind_failures += 1
            with self._lock:
                self._assumed.pop(uid, None)
            log.info("binding %s to %s failed: %s", key, node, exc)
            self._failed(uid, key, pod, f"binding rejected: {exc}", unschedulable=False)
            return
        self.stats.scheduled += 1
        with self._lock:
            self._in_flight.discard(uid)
            self._queued.pop(uid, None)
        log.debug("bound %s to %s", key, node)

    def _failed(self, uid: str, key: str, pod: JSON, message: str, *, unschedulable: bool) -> None:
        self.stats.messages[key] = message
        if unschedulable:
            namespace, name = key.split("/", 1)
            condition = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastProbeTime": None,
                "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            try:
                self._core.patch_namespaced_pod_status(
                    name,
                    namespace,
                    {"status": {"conditions": [condition]}},
                    _content_type="application/merge-patch+json",
                    _preload_content=False,
                )
            except Exception as exc:
                log.info("cannot record why %s is unschedulable: %s", key, exc)
        self._retry(uid, message, unschedulable=unschedulable)
