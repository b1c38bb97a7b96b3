"""bind: choose the GPUs again, write gpu-admission's annotations, then bind the pod to the node.

1. Take the pod from the watch cache (else GET it; a recreated pod, a different UID, is refused).
   A pod already bound to this node, or bound by an earlier bind the watch does not show yet, is
   done (a repeated bind is idempotent); bound to another node, refused.
2. Read the node (a current read, not the watch) and the choices other binds, of this replica
   or another one, recorded on it (:mod:`gpumanager.extender.claims`). Under the cluster state's
   lock, choose GPUs on the node with the pod's own old charges left out and those recorded
   choices counted, and *assume* them (the next filter and bind see them taken). Record the
   choice on the node with its ``metadata.resourceVersion`` as precondition; on 409 Conflict
   (another bind recorded one meanwhile) put back what the pod held and start over from 2.
   Binds of one replica to one node take these steps one at a time.
3. Merge-patch the annotations with ``metadata.resourceVersion`` set (a precondition):
   ``predicate-gpu-idx-<i>`` per GPU container, ``predicate-gpu-idx--<k>`` per GPU init container
   (``-1`` for the first of ``spec.initContainers``: the index under which the agent asks for it),
   when the pod has any GPU container (an ordinary init container alone counts: the agent places it
   where it is named), ``predicate-node``, ``predicate-time`` (ns),
   ``gpu-assigned=false``, and stale ``predicate-gpu-idx-*`` removed. On 409 Conflict: put back
   what the pod held before, GET again and start over from 2 (at most ``max_conflicts`` times).
   Whenever bind gives up after recording its choice, it removes the choice from the node again
   (best effort: else it lapses :data:`~gpumanager.extender.claims.CLAIM_TTL` after each replica first
   read it).
4. POST the pod's Binding (with the pod's UID as precondition). If the API server refuses it and
   the pod is not bound to the node after all, drop the assumption and remove the annotations
   again. If the pod is gone (deleted, or recreated under its name: another UID, or the API
   server refused the Binding's UID precondition), drop the assumption at once. If it does not
   answer, the Binding may still be made: the GPUs stay assumed (until the watch shows the pod
   bound or gone, or ``assume_ttl``) and the annotations stay, so whatever the
   API server does, the pod's GPUs are never handed out twice. A Binding made keeps the GPUs
   assumed until the watch (or a relist) shows the pod bound, deleted or ended, however late that is.

A bind answers within ``timeout`` seconds in all (every API call, and the wait for another bind
of the same pod, get what is left of it), so that the scheduler, whose ``httpTimeout`` is 5 s by
default, hears why instead of timing out. No lock is held during API calls except the pod's own
and, while the choice is made and recorded, the node's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, overload

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError
from urllib3.exceptions import TimeoutError as Urllib3TimeoutError

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import GPURequest, PodSpecError
from gpumanager.extender import claims as claims_module
from gpumanager.extender.api import SHAPE_ERRORS, BindingArgs
from gpumanager.extender.charges import PodCharges, count_inits, init_containers
from gpumanager.extender.claims import ANNOTATION as CLAIMS
from gpumanager.extender.claims import Claim, encode_claims, parse_claims
from gpumanager.extender.placement import Policy, free_figures, never_served, place
from gpumanager.extender.state import Assumption, ClusterState
from gpumanager.kube.apierror import unreachable

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
#: How many times one bind chooses again because another bind recorded a choice on the node first
#: (the bind's deadline ends it sooner under a long burst).
_NODE_CONFLICTS = 50
JSON = dict[str, Any]


class BindError(Exception):
    """Bind refused or failed; ``outcome`` is ``refused`` (does not fit, wrong pod) or ``error``."""

    def __init__(self, message: str, outcome: str = "error") -> None:
        super().__init__(message)
        self.outcome = outcome


class _OutOfTimeError(Exception):
    """The bind's time is spent before an API call could be made."""


class _Deadline:
    """What is left of a bind's time."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (<= 0 when spent)."""
        return self._end - time.monotonic()

    def call_timeout(self) -> float:
        """The timeout of the next API call; raises :class:`_OutOfTimeError` when nothing is left."""
        left = self.left()
        if left <= 0.01:
            raise _OutOfTimeError()
        return left


def _timed_out(exc: BaseException) -> bool:
    if isinstance(exc, MaxRetryError):
        return isinstance(exc.reason, Urllib3TimeoutError)
    return isinstance(exc, (Urllib3TimeoutError, TimeoutError, _OutOfTimeError))


class _BadAnswerError(Exception):
    """The API server (or a proxy before it) answered with something other than a JSON object."""


#: How much of an unexpected answer an error shows.
_SHOWN = 200


def _json_object(response: Any) -> JSON:
    """The JSON object of an API answer; :class:`_BadAnswerError` naming what came back (cut short) otherwise."""
    data = getattr(response, "data", b"")
    try:
        found = json.loads(data)
    except (ValueError, TypeError, RecursionError):
        found = None
    if isinstance(found, dict):
        return found
    text = data.decode("utf-8", "replace") if isinstance(data, (bytes, bytearray)) else str(data)
    shown = repr(text[:_SHOWN]) + (f" (cut short, {len(text)} characters in all)" if len(text) > _SHOWN else "")
    status = getattr(response, "status", None)
    raise _BadAnswerError(
        f"the API server answered{f' {status}' if status is not None else ''} with something that is not a "
        f"JSON object: {shown}"
    )


def _api_text(exc: Exception, deadline: _Deadline | None = None) -> str:
    if isinstance(exc, _BadAnswerError):
        return str(exc)
    if deadline is not None and _timed_out(exc):
        return f"the API server did not answer within {deadline.seconds:g} s"
    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = ""
        return f"{exc.status} {exc.reason}" + (f": {message}" if message else "")
    return unreachable(exc) or f"{type(exc).__name__}: {exc}"


def _predicate_time(claims: Mapping[str, Claim], uid: str) -> int:
    """The predicate time of a choice made now, after the choices ``claims`` recorded on the node (not
    of pod ``uid``): this replica's clock in nanoseconds, or past the largest of theirs when that is
    later. The node agent matches each Allocate to the waiting pod of the smallest predicate time;
    replicas' clocks may disagree, and a pod bound after another must not read as chosen before it."""
    now = time.time_ns()
    for other, claim in claims.items():
        value = claim.predicate_time
        if other != uid and value.isascii() and value.isdigit() and len(value) <= 19:
            now = max(now, int(value) + 1)
    return now


def _uid_precondition_failed(exc: Exception) -> bool:
    """Whether the API server refused a request because the object's UID is no longer the one asked for."""
    return isinstance(exc, ApiException) and exc.status == 409 and "Precondition failed: UID" in _api_text(exc)


class _PodLocks:
    """One lock per pod being bound (binds of different pods never wait for each other)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}

    @contextmanager
    def hold(self, key: str, timeout: float) -> Iterator[bool]:
        """Yields whether the pod's lock was taken within ``timeout`` seconds."""
        with self._mutex:
            lock, users = self._locks.get(key, (threading.Lock(), 0))
            self._locks[key] = (lock, users + 1)
        taken = lock.acquire(timeout=max(timeout, 0.0))
        try:
            yield taken
        finally:
            if taken:
                lock.release()
            with self._mutex:
                lock, users = self._locks[key]
                if users <= 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)


class Binder:
    """The bind verb. Thread-safe."""

    def __init__(
        self,
        api: client.ApiClient,
        state: ClusterState,
        policy: Policy,
        *,
        max_conflicts: int = 5,
        timeout: float = 4.0,
        on_conflict: Callable[[], None] | None = None,
        cached: Callable[[str], JSON | None] | None = None,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._state = state
        self._policy = policy
        self._max_conflicts = max_conflicts
        self._timeout = timeout
        self._locks = _PodLocks()
        self._node_locks = _PodLocks()
        self._on_conflict = on_conflict or (lambda: None)
        self._cached = cached or (lambda _uid: None)

    def bind(self, args: BindingArgs) -> str:
        """Bind the pod; returns the outcome (``bound``, ``already_bound``); raises :class:`BindError`."""
        deadline = _Deadline(self._timeout)
        # By name, not UID: a call without PodUID and one with it are binds of the same pod.
        with self._locks.hold(f"{args.pod_namespace}/{args.pod_name}", deadline.left()) as taken:
            if not taken:
                raise BindError(
                    f"pod {args.pod_namespace}/{args.pod_name}: another bind of it did not finish within "
                    f"{self._timeout:g} s"
                )
            return _Bind(self, args, deadline).run()

    def drop_lapsed(self, node_name: str) -> int:
        """Take off the node the recorded choices that no longer count here (lapsed, or of pods the watch
        showed ended); returns how many. A lapse changes nothing in the cluster by itself, so a pod the
        scheduler failed on such a choice waited for an unrelated event: this Node update sends it back
        to the scheduling queue. One try, with the node's ``resourceVersion`` as precondition (a bind
        writing meanwhile wins; the next pass tries again); no lock is taken, so no bind waits for it.
        Raises ApiException and urllib3 errors."""
        deadline = _Deadline(self._timeout)
        response = self._core.read_node(node_name, _preload_content=False, _request_timeout=deadline.call_timeout())
        node = _json_object(response)
        recorded = parse_claims(node)
        if not recorded:
            return 0
        live = self._state.sightings.live(recorded)
        keep = {uid: c for uid, c in live.items() if not self._state.ended(uid)}
        if len(keep) == len(recorded):
            return 0
        rv = str((node.get("metadata") or {}).get("resourceVersion", ""))
        value: str | None = encode_claims(keep) if keep else None
        body = {"metadata": {"resourceVersion": rv, "annotations": {CLAIMS: value}}}
        self._core.patch_node(
            node_name,
            body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=deadline.call_timeout(),
        )
        dropped = sorted(c.pod or uid for uid, c in recorded.items() if uid not in keep)
        log.info("node %s: took off the choices recorded for pods %s (lapsed or ended)", node_name, ", ".join(dropped))
        return len(recorded) - len(keep)


class _Bind:
    """One bind call."""

    def __init__(self, binder: Binder, args: BindingArgs, deadline: _Deadline) -> None:
        self._core = binder._core
        self._state = binder._state
        self._policy = binder._policy
        self._max_conflicts = binder._max_conflicts
        self._on_conflict = binder._on_conflict
        self._cached = binder._cached
        self._node_locks = binder._node_locks
        self._claimed: tuple[str, str] | None = None
        # The record of the pod that this bind's first record replaced (another bind's, of any replica,
        # of the same pod): put back when this bind takes its own off.
        self._replaced: Claim | None = None
        self._node_conflicts = 0
        """(pod UID, predicate time) of the choice this bind recorded on the node."""
        self.args = args
        self.deadline = deadline
        self.who = f"pod {args.pod_namespace}/{args.pod_name}"

    # -- API calls --------------------------------------------------------------------------------

    def _get(self) -> JSON:
        args = self.args
        pod = self._read()
        if pod is None:
            raise BindError(f"{self.who} not found", "refused")
        if args.pod_uid and podinfo.uid(pod) != args.pod_uid:
            raise BindError(f"{self.who} has UID {podinfo.uid(pod)}, not {args.pod_uid} (it was recreated)", "refused")
        return pod

    def _read(self) -> JSON | None:
        """The pod by name from the API server, whatever its UID; None when there is none."""
        args = self.args
        return self._read_object(
            lambda: self._core.read_namespaced_pod(
                args.pod_name,
                args.pod_namespace,
                _preload_content=False,
                _request_timeout=self.deadline.call_timeout(),
            ),
            f"cannot read {self.who}",
        )

    @overload
    def _read_object(self, read: Callable[[], Any], failed: str, missing: str) -> JSON: ...

    @overload
    def _read_object(self, read: Callable[[], Any], failed: str, missing: None = None) -> JSON | None: ...

    def _read_object(self, read: Callable[[], Any], failed: str, missing: str | None = None) -> JSON | None:
        """One read from the API server (``read``), its answer as a JSON object.

        Not found (404): None, or with ``missing`` a refusal with that message. Any other failure, or an
        answer that is not a JSON object: a BindError ``<failed>: <why>``."""
        try:
            response: Any = read()
        except ApiException as exc:
            if exc.status == 404:
                if missing is None:
                    return None
                raise BindError(missing, "refused") from exc
            raise BindError(f"{failed}: {_api_text(exc, self.deadline)}") from exc
        except Exception as exc:
            raise BindError(f"{failed}: {_api_text(exc, self.deadline)}") from exc
        try:
            return _json_object(response)
        except _BadAnswerError as exc:
            raise BindError(f"{failed}: {exc}") from exc

    def _patch(self, rv: str, annotations: Mapping[str, str | None]) -> JSON:
        body = {"metadata": {"resourceVersion": rv, "annotations": dict(annotations)}}
        response: Any = self._core.patch_namespaced_pod(
            self.args.pod_name,
            self.args.pod_namespace,
            body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=self.deadline.call_timeout(),
        )
        return _json_object(response)

    def _post_binding(self, uid: str) -> None:
        args = self.args
        body: Any = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": args.pod_name, "namespace": args.pod_namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": args.node},
        }
        self._core.create_namespaced_pod_binding(
            args.pod_name,
            args.pod_namespace,
            body,
            _preload_content=False,
            _request_timeout=self.deadline.call_timeout(),
        )

    # -- the verb ---------------------------------------------------------------------------------

    def _bound_already(self, pod: JSON) -> bool:
        bound = str((pod.get("spec") or {}).get("nodeName") or "")
        if not bound:
            return False
        if bound == self.args.node:
            log.info("%s is already bound to %s", self.who, bound)
            return True
        raise BindError(f"{self.who} is already bound to node {bound}", "refused")

    def _bound_by_us(self, uid: str) -> bool:
        """Whether an earlier bind bound the pod (the watch may not show it yet; neither may the cached pod)."""
        node = self._state.bound_to(uid)
        if node is None:
            return False
        if node == self.args.node:
            log.info("%s was bound to %s already", self.who, node)
            return True
        raise BindError(f"{self.who} is already bound to node {node}", "refused")

    def _choose(
        self,
        pod: JSON,
        requests: list[GPURequest],
        inits: list[GPURequest],
        sidecars: list[GPURequest],
        claims: Mapping[str, Claim],
        current: JSON,
    ) -> dict[str, str | None]:
        """Choose GPUs under the state lock and assume what the pod holds (its ordinary init containers as
        the agent counts them, :func:`~gpumanager.extender.charges.count_inits`); returns
        the annotation patch (naming the init containers' GPUs too). The node's GPUs are taken from
        ``current``, the node as just read (the node watch may lag: a GPU the agent has since marked
        unhealthy, or GPUs since gone)."""
        uid = podinfo.uid(pod)
        node = self.args.node
        state = self._state
        with state.lock:
            state.expire()
            gpus = state.add_node(current)
            if gpus is None:
                raise BindError(f"{self.who}: node {node} has no GPUs the extender knows of", "refused")
            with state.without(uid), state.counting(node, claims, uid):
                placement = place(gpus, requests, self._policy, inits=inits, sidecars=sidecars)
                figures = "" if placement.ok else free_figures(gpus.tree)
            if not placement.ok:  # about one node: its own figures too
                raise BindError(f"{self.who} no longer fits on node {node}: {placement.failed} ({figures})", "refused")
            now = str(_predicate_time(claims, uid))
            charges = tuple(
                count_inits(
                    [c for choice in placement.choices for c in choice.charges()],
                    [c for choice in placement.inits for c in choice.charges()],
                )
            )
            state.assume(uid, PodCharges(node, charges, 0, now), podinfo.pod_key(pod))
        patch: dict[str, str | None] = {
            f"{names.PREDICATE_GPU_IDX_PREFIX}{choice.request.index}": ",".join(map(str, choice.minors))
            for choice in (*placement.choices, *placement.inits)
        }
        for key in podinfo.pod_annotations(pod):
            if key.startswith(names.PREDICATE_GPU_IDX_PREFIX) and key not in patch:
                patch[key] = None
        patch[names.PREDICATE_NODE] = node
        patch[names.PREDICATE_TIME] = now
        patch[names.GPU_ASSIGNED] = "false"
        return patch

    def _start(self) -> JSON:
        """The pod from the watch cache when it has it (a stale copy fails the patch's precondition
        and is read again), else from the API server."""
        args = self.args
        pod = self._cached(args.pod_uid)
        meta = (pod or {}).get("metadata") or {}
        if pod is not None and meta.get("name") == args.pod_name and meta.get("namespace") == args.pod_namespace:
            return pod
        return self._get()

    def run(self) -> str:
        """Bind; returns the outcome (``bound``, ``already_bound``); raises :class:`BindError`."""
        pod = self._start()
        if self._bound_already(pod) or self._bound_by_us(podinfo.uid(pod)):
            return "already_bound"
        try:
            requests = podinfo.gpu_containers(pod)
            inits, sidecars = init_containers(pod)
            never = never_served([*podinfo.init_gpu_requests(pod), *podinfo.gpu_requests(pod)])
        except PodSpecError as exc:
            raise BindError(str(exc), "refused") from exc
        except SHAPE_ERRORS as exc:
            raise BindError(
                f"{self.who}: its spec has an unexpected shape ({type(exc).__name__}: {exc})", "refused"
            ) from exc
        if never:
            raise BindError(f"{self.who}: {never}", "refused")
        if not requests and not sidecars and not inits:
            self._binding(podinfo.uid(pod), None, {})
            return "bound"
        if self._check_earlier_binding(pod):
            return "already_bound"
        try:
            found = self._annotate(pod, requests, inits, sidecars)
        except BaseException:
            # Whatever ends the bind before its Binding (a refusal on a later turn, a failed read after a
            # conflict) takes the choice an earlier turn recorded off the node: it holds nothing now.
            self._unclaim()
            raise
        if found is None:
            self._unclaim()  # an earlier bind made the Binding: this turn's choice holds nothing
            return "already_bound"
        uid, patched, patch = found
        self._binding(uid, patched, patch)
        log.info(
            "bound %s to %s: %s",
            self.who,
            self.args.node,
            ", ".join(f"{k.rsplit('/', 1)[-1]}={v}" for k, v in patch.items() if v is not None),
        )
        return "bound"

    def _annotate(
        self,
        pod: JSON,
        requests: list[GPURequest],
        inits: list[GPURequest],
        sidecars: list[GPURequest],
    ) -> tuple[str, JSON, dict[str, str | None]] | None:
        """Choose and record the GPUs, and write the pod's annotations; returns (pod UID, the patched pod,
        the patch), or None when the pod turns out bound to the node by an earlier bind."""
        conflicts = 0
        while True:
            uid = podinfo.uid(pod)
            self._check_other_choice(pod)  # refused: run() takes off a choice recorded at an earlier turn
            previous = self._state.assumption(uid)
            with self._node_locks.hold(self.args.node, self.deadline.left()) as taken:
                if not taken:
                    raise BindError(
                        f"{self.who}: other binds to node {self.args.node} did not finish within "
                        f"{self.deadline.seconds:g} s"
                    )
                patch = self._claim(pod, previous, requests, inits, sidecars)
            if patch is None:
                continue
            try:
                patched = self._patch(str((pod.get("metadata") or {}).get("resourceVersion", "")), patch)
                break
            except Exception as exc:
                # Not answered in time, the patch may still be made: then the watch shows the pod
                # chosen for the node, and the pod holds the GPUs there until it is bound elsewhere.
                self._state.restore(uid, previous)
                if isinstance(exc, ApiException) and exc.status == 409 and conflicts < self._max_conflicts:
                    conflicts += 1
                    self._on_conflict()
                    log.info("%s changed while binding (conflict %d); reading it again", self.who, conflicts)
                    pod = self._get()
                    if self._bound_already(pod):
                        mine = self._state.assumption(uid)
                        if mine is not None and mine.charges.node == self.args.node:
                            self._state.assumed_bound(uid)  # an earlier bind that could not tell made it
                        return None
                    continue
                # The scheduler hears of the failure and places the pod anew: should the patch be made
                # after all, that choice holds nothing while the pod is not bound.
                self._state.given_up(uid, str(patch[names.PREDICATE_TIME]))
                self._unclaim()
                if isinstance(exc, ApiException) and exc.status == 404:
                    # Deleted since the scheduler filtered it (the watch had not shown that yet).
                    raise BindError(f"{self.who} (UID {uid}) was deleted before it could be bound", "refused") from exc
                raise BindError(f"cannot annotate {self.who}: {_api_text(exc, self.deadline)}") from exc
        return uid, patched, patch

    def _read_node(self) -> JSON:
        """The bind's node from the API server (a current read: the watch may lag)."""
        node = self.args.node
        return self._read_object(
            lambda: self._core.read_node(node, _preload_content=False, _request_timeout=self.deadline.call_timeout()),
            f"{self.who}: cannot read node {node}",
            f"{self.who}: node {node} not found",
        )

    def _record(self, node: JSON, claims: Mapping[str, Claim]) -> None:
        """Write ``claims`` on the node, on condition that it has not changed since it was read."""
        rv = str((node.get("metadata") or {}).get("resourceVersion", ""))
        body = {"metadata": {"resourceVersion": rv, "annotations": {CLAIMS: encode_claims(claims)}}}
        self._core.patch_node(
            self.args.node,
            body,
            _content_type=MERGE_PATCH,
            _preload_content=False,
            _request_timeout=self.deadline.call_timeout(),
        )

    def _claim(
        self,
        pod: JSON,
        previous: Assumption | None,
        requests: list[GPURequest],
        inits: list[GPURequest],
        sidecars: list[GPURequest],
    ) -> dict[str, str | None] | None:
        """Choose GPUs with the choices recorded on the node counted, and record this one there;
        returns the pod's annotation patch, or None when another bind recorded a choice meanwhile
        (choose again)."""
        uid = podinfo.uid(pod)
        node = self._read_node()
        claims = self._state.sightings.live(parse_claims(node))
        patch = self._choose(pod, requests, inits, sidecars, claims, node)
        mine = self._state.assumption(uid)
        when = str(patch[names.PREDICATE_TIME])
        charges = mine.charges.charges if mine is not None else ()
        claims = {u: c for u, c in claims.items() if not self._state.ended(u)}  # kept small
        if self._claimed is None:  # this bind's first record: what it replaces is another bind's
            self._replaced = claims.get(uid)
        claims[uid] = Claim(podinfo.pod_key(pod), time.time(), when, charges)
        self._state.sightings.written(uid, claims[uid])
        self._state.recorded(self.args.node, uid)
        try:
            self._record(node, claims)
        except Exception as exc:
            self._state.restore(uid, previous)
            if isinstance(exc, ApiException) and exc.status == 409 and self._node_conflicts < _NODE_CONFLICTS:
                self._node_conflicts += 1
                self._on_conflict()
                log.debug("node %s changed while binding %s; choosing again", self.args.node, self.who)
                return None
            self._state.given_up(uid, when)
            refused = "refused" if isinstance(exc, ApiException) and exc.status == 404 else "error"
            raise BindError(
                f"{self.who}: cannot record its GPUs on node {self.args.node}: {_api_text(exc, self.deadline)}",
                refused,
            ) from exc
        self._claimed = (uid, when)
        return patch

    def _unclaim(self) -> None:
        """Remove the choice this bind recorded on the node, putting back the record of the pod it
        replaced, if any (best effort, in the time left; else it lapses by itself)."""
        if self._claimed is None:
            return
        uid, when = self._claimed
        self._claimed = None
        for _ in range(self._max_conflicts + 1):
            try:
                node = self._read_node()
            except BindError:
                return
            claims = self._state.sightings.live(parse_claims(node))
            found = claims.pop(uid, None)
            if found is None or found.predicate_time != when:
                return
            if self._replaced is not None and self._replaced.predicate_time != when:
                # Another bind's record of the pod, which this one replaced: that bind may have bound it.
                claims[uid] = self._replaced
            try:
                self._record(node, claims)
                self._state.taken_off(self.args.node, uid, when)
                return
            except ApiException as exc:
                if exc.status != 409:
                    log.warning(
                        "%s: cannot remove its GPUs' record from node %s: %s",
                        self.who,
                        self.args.node,
                        _api_text(exc, self.deadline),
                    )
                    return
            except Exception as exc:
                log.warning(
                    "%s: cannot remove its GPUs' record from node %s: %s",
                    self.who,
                    self.args.node,
                    _api_text(exc, self.deadline),
                )
                return

    def _check_other_choice(self, pod: JSON) -> None:
        """Refuse while another bind, of any replica, may still bind the pod to another node: the pod
        carries that bind's choice of the other node (not bound yet) and the choice is recorded there and
        counts still (read from the API server: one call, only for a pod chosen for another node).
        Overwritten here, a Binding that bind then made would leave the pod on that node with annotations
        naming this one: counted on no GPU there, its GPUs chosen by the agent alone."""
        notes = podinfo.pod_annotations(pod)
        other, when = notes.get(names.PREDICATE_NODE), notes.get(names.PREDICATE_TIME)
        if not isinstance(other, str) or not other or other == self.args.node or not isinstance(when, str):
            return
        try:
            found = self._read_object(
                lambda: self._core.read_node(
                    other, _preload_content=False, _request_timeout=self.deadline.call_timeout()
                ),
                f"{self.who}: cannot read node {other}, for which another bind chose it",
            )
        except BindError as exc:
            # Cannot tell (a name no node can have, an API error): bound as before this look, not refused
            # at every retry.
            log.info("%s; binding it to %s all the same", exc, self.args.node)
            return
        if found is None:
            return  # that node is gone: no Binding there will be made
        claim = self._state.sightings.live(parse_claims(found)).get(podinfo.uid(pod))
        if claim is None or claim.predicate_time != when:
            return  # that bind failed (it removed its record) or its record lapsed
        raise BindError(
            f"{self.who}: another bind chose node {other} for it (predicate time {when}, recorded on that node) "
            f"and may still bind it there; refused until that bind ends or its record lapses "
            f"({claims_module.CLAIM_TTL:g} s after this extender first read it)",
            "refused",
        )

    def _check_earlier_binding(self, pod: JSON) -> bool:
        """Refuse to bind a pod elsewhere while a Binding of it to another node got no answer: the API
        server may still make it, and the GPUs held there would be let go while the pod lands there.
        True when the pod turns out bound to this bind's node already."""
        earlier = self._state.unanswered_binding(podinfo.uid(pod))
        if earlier is None or earlier == self.args.node:
            return False
        current = self._get()  # from the API server: has the earlier Binding been made meanwhile?
        if self._bound_already(current):  # raises when it is bound to another node
            return True
        raise BindError(
            f"{self.who}: an earlier Binding to node {earlier} got no answer and may still be made; "
            f"its GPUs stay held there until the pod shows where it is (at most {self._state.assume_ttl:g} s)",
            "refused",
        )

    def _binding(self, uid: str, patched: JSON | None, patch: Mapping[str, str | None]) -> None:
        node = self.args.node
        try:
            self._post_binding(uid)
        except Exception as exc:
            try:
                self._binding_failed(uid, exc, patched, patch)
            except BindError:
                raise
            except Exception as unexpected:
                # Never leave the assumption without an end: held as for a Binding that got no answer.
                self._state.assumed_bound(uid, bound=False, node=node)
                raise BindError(
                    f"cannot bind {self.who} to node {node}: {_api_text(exc, self.deadline)}, then "
                    f"{type(unexpected).__name__}: {unexpected}; the binding may still be made: its GPUs stay "
                    f"held until the pod shows where it is (at most {self._state.assume_ttl:g} s)"
                ) from unexpected
            return
        self._state.assumed_bound(uid)

    def _binding_failed(self, uid: str, exc: Exception, patched: JSON | None, patch: Mapping[str, str | None]) -> None:
        """The Binding failed (``exc``): returns when the pod turns out bound to the node after all,
        else releases or keeps (for ``assume_ttl``) the assumption and raises :class:`BindError`."""
        node = self.args.node
        # The Binding may have been made even though the answer was lost: look before undoing.
        unread = ""
        try:
            current: JSON | None = self._read()
            gone = current is None or podinfo.uid(current) != uid
        except BindError as err:
            current, unread = None, f" (reading the pod back failed too: {err})"
            gone = False
        if gone or _uid_precondition_failed(exc):
            # Deleted (and maybe recreated under its name): no Binding of this pod will ever be made.
            self._state.forget(uid)
            self._unclaim()
            now = "" if current is None else f" and recreated under its name (UID now {podinfo.uid(current)})"
            raise BindError(
                f"cannot bind {self.who} to node {node}: {_api_text(exc, self.deadline)}; the pod (UID {uid}) "
                f"was deleted{now}: its GPUs on node {node} are released",
                "refused",
            ) from exc
        if current is not None and (current.get("spec") or {}).get("nodeName") == node:
            self._state.assumed_bound(uid)
            return
        refused = isinstance(exc, ApiException) and exc.status != 409
        if current is None and not refused:
            # No answer either way: the API server may still make the Binding. Keep the GPUs
            # held and the annotations in place, so the pod never holds GPUs nobody counts.
            self._state.assumed_bound(uid, bound=False, node=node)
            raise BindError(
                f"cannot bind {self.who} to node {node}: {_api_text(exc, self.deadline)}{unread}; the binding may "
                f"still be made: its GPUs stay held until the pod shows where it is (at most "
                f"{self._state.assume_ttl:g} s)"
            ) from exc
        self._state.forget(uid)
        if patched is not None:
            self._undo(patched, patch)
        self._unclaim()
        raise BindError(
            f"cannot bind {self.who} to node {node}: {_api_text(exc, self.deadline)}; its GPUs are released"
        ) from exc

    def _undo(self, patched: JSON, patch: Mapping[str, str | None]) -> None:
        """Remove the annotations this bind wrote, unless the pod moved on since (best effort, in the
        time left)."""
        ours = {k: None for k, v in patch.items() if v is not None}
        when = patch.get(names.PREDICATE_TIME)
        pod: JSON | None = patched
        for _ in range(self._max_conflicts + 1):
            if pod is None or podinfo.pod_annotations(pod).get(names.PREDICATE_TIME) != when:
                return
            if (pod.get("spec") or {}).get("nodeName"):
                return
            try:
                self._patch(str((pod.get("metadata") or {}).get("resourceVersion", "")), ours)
                return
            except ApiException as exc:
                if exc.status != 409:
                    log.warning("cannot remove annotations from %s: %s", self.who, _api_text(exc, self.deadline))
                    return
            except Exception as exc:
                log.warning("cannot remove annotations from %s: %s", self.who, _api_text(exc, self.deadline))
                return
            try:
                pod = self._get()
            except BindError:
                return
