"""filter and prioritize: which candidate nodes can hold a pod's GPU containers, and how well.

Neither writes anything. A pod is judged without its own charges (a pod that carries
predicate annotations from an earlier attempt is judged afresh). A node fails with a reason
naming the container, what it needs and what the node lacks; it is *unresolvable* (preemption
cannot help) when even its GPUs with nothing on them could not hold the pod.

The choices binds of any replica recorded on a node (:mod:`gpumanager.extender.claims`), which
bind counts, fail the node in filter where they leave no room for the pod: the scheduler could only
be refused by bind there (another replica filled it; this replica's pod watch has not shown that
pod's annotations yet). They fail it as *resolvable* (the choice ends when its pod is bound, which
is a cluster event that sends the pod back to the scheduling queue, or lapses), also when no
candidate has room: the pod then stays Pending with every node failed, never passed to a bind
that can only refuse it. The choices are read from the node watch: no API call per request.

While a Binding of the pod got no answer (bind timed out; the API server may still make it), only
that Binding's node passes: the others fail as unresolvable, naming it, since bind refuses them
until the pod shows where it is (at most ``assume_ttl``).

A reason names neither its node (the node is its key in FailedNodes) nor the node's own figures
(free cores and MiB per GPU, which GPUs are unhealthy, the pods whose binds were recorded on it):
the kube-scheduler counts equal reasons together in the pod's condition and FailedScheduling event
("0/500 nodes are available: 480 container 'c0' needs ..."), which a reason per node would make as
long as the list of nodes (the event is cut at 1,024 characters). Nodes that fail for the same cause
(no GPU with that many free cores; that much memory free on the node but on no single GPU; ...)
get the same reason; each failing node's figures are logged at debug level.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import AbstractContextManager, nullcontext

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import GPURequest, PodSpecError
from gpumanager.extender.api import JSON, SHAPE_ERRORS, ExtenderArgs, error_filter_result, filter_result
from gpumanager.extender.charges import init_containers
from gpumanager.extender.claims import ANNOTATION as CLAIMS_ANNOTATION
from gpumanager.extender.nodes import NodeGPUs
from gpumanager.extender.placement import Policy, fits, free_figures, never_served, place
from gpumanager.extender.state import ClusterState

log = logging.getLogger(__name__)


def requests_of(pod: JSON) -> list[GPURequest]:
    """The pod's GPU containers (raises PodSpecError on unreadable quantities)."""
    return podinfo.gpu_containers(pod)


def init_requests_of(pod: JSON) -> list[GPURequest]:
    """The pod's ordinary GPU init containers (raises PodSpecError on unreadable quantities)."""
    return init_containers(pod)[0]


def sidecar_requests_of(pod: JSON) -> list[GPURequest]:
    """The pod's GPU sidecars, init containers with ``restartPolicy: Always`` (raises PodSpecError)."""
    return init_containers(pod)[1]


def all_requests_of(pod: JSON) -> list[GPURequest]:
    """Every container's vcuda requests, init containers first, GPU or not (for :func:`never_served`)."""
    return [*podinfo.init_gpu_requests(pod), *podinfo.gpu_requests(pod)]


def _pod_key(pod: object) -> str:
    """``namespace/name`` of a pod, whatever its shape."""
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(meta, dict):
        return "(unnamed)"
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


class Decider:
    """Answers filter and prioritize from a :class:`ClusterState`."""

    def __init__(self, state: ClusterState, policy: Policy) -> None:
        self.state = state
        self.policy = policy

    def _claimed(self, name: str, uid: str) -> AbstractContextManager[None]:
        """Within the block the node also holds the choices binds of any replica recorded on it (as the
        node watch shows them), as bind counts them."""
        claims = self.state.node_claims(name)
        return self.state.counting(name, claims, uid) if claims else nullcontext()

    def _node(self, name: str, args: ExtenderArgs) -> NodeGPUs | None:
        return self._known(name, args)[0]

    def _known(self, name: str, args: ExtenderArgs) -> tuple[NodeGPUs | None, str]:
        """The node's GPUs, or None with why ("" when the node has none)."""
        gpus = self.state.node(name)
        if gpus is None and name in args.raw_nodes and not self.state.seen_node(name):
            # The scheduler may know a node the watch has not shown yet, or still one the watch has
            # shown deleted (its cache lags): that one is not brought back. A node the watch shows
            # (without GPUs, or unusable) is judged as the watch shows it: the scheduler's copy may
            # be older (GPUs since gone) and would otherwise replace it until the node's next event.
            obj = args.node_object(name)
            if obj is not None:
                if self.state.deleted_node(obj):
                    log.debug("node %s (UID %s) has been deleted", name, (obj.get("metadata") or {}).get("uid"))
                    return None, "the node has been deleted (the extender's node watch showed it deleted)"
                gpus = self.state.add_node(obj)
        unusable = self.state.unusable(name) if gpus is None else ""
        if unusable:
            return None, unusable
        if gpus is None and name not in args.raw_nodes and self.state.deleted_name(name):
            return None, "the node has been deleted (the extender's node watch showed it deleted)"
        if gpus is None and not self.state.seen_node(name):
            return None, (
                "the node is not known to the extender: its node watch has not shown it (yet), "
                "or its object could not be read"
            )
        return gpus, ""

    def judge(
        self,
        gpus: NodeGPUs | None,
        requests: list[GPURequest],
        inits: list[GPURequest] | None = None,
        sidecars: list[GPURequest] | None = None,
    ) -> tuple[str, str]:
        """``("pass"|"fail"|"unresolvable", reason)`` for one node (``inits``: the ordinary GPU init
        containers, each of which must fit beside the others' choice; ``sidecars``: the GPU init
        containers that run beside the others, placed with them)."""
        if gpus is None:
            return "unresolvable", f"node has no {names.VCORE_RESOURCE}"
        inits = inits or []
        sidecars = sidecars or []
        problem = fits(gpus, requests, self.policy, inits=inits, sidecars=sidecars)
        if not problem:
            return "pass", ""
        if gpus.basis:
            problem += f"; {gpus.basis}"
        never = fits(gpus, requests, self.policy, empty=True, inits=inits, sidecars=sidecars)
        return ("unresolvable" if never else "fail"), problem

    def _claimed_problem(
        self,
        name: str,
        uid: str,
        gpus: NodeGPUs,
        requests: list[GPURequest],
        inits: list[GPURequest],
        sidecars: list[GPURequest],
    ) -> str:
        """Why the pod, which fits the node as the watches show it, does not fit once the choices binds
        recorded on the node (and the watch does not show yet) are counted; "" when it fits (lock held)."""
        recorded = self.state.uncounted(name, self.state.node_claims(name), uid)
        if not recorded:
            return ""  # none, or each already counted from the pods' own annotations
        with self.state.counting(name, recorded, uid):
            problem = fits(gpus, requests, self.policy, inits=inits, sidecars=sidecars)
            if problem and log.isEnabledFor(logging.DEBUG):
                pods = sorted({c.pod or u for u, c in recorded.items()})
                log.debug(
                    "filter: node %s: %s, counting the choices binds recorded for pods %s (%s)",
                    name,
                    problem,
                    ", ".join(pods),
                    free_figures(gpus.tree),
                )
        if not problem:
            return ""
        return f"{problem}, counting the choices binds recorded on the node (annotation {CLAIMS_ANNOTATION})"

    def filter(self, args: ExtenderArgs) -> tuple[JSON, Counter[str]]:
        """``ExtenderFilterResult`` for the candidates, and the count of each outcome. A pod or node
        object of an unexpected shape gets an error naming the pod, not a failed call."""
        try:
            return self._filter(args)
        except SHAPE_ERRORS as exc:
            why = f"pod {_pod_key(args.pod)}: the pod or a node has an unexpected shape ({type(exc).__name__}: {exc})"
            log.warning("filter: %s", why)
            return error_filter_result(why), Counter(error=1)

    def _filter(self, args: ExtenderArgs) -> tuple[JSON, Counter[str]]:
        outcomes: Counter[str] = Counter()
        try:
            requests = requests_of(args.pod)
            inits, sidecars = init_containers(args.pod)
            never = never_served(all_requests_of(args.pod))
        except PodSpecError as exc:
            return error_filter_result(str(exc)), Counter(error=1)
        node_names = args.names
        if never:
            outcomes["unresolvable"] += len(node_names)
            return filter_result(args, [], {}, dict.fromkeys(node_names, never)), outcomes
        if not requests and not inits and not sidecars:
            outcomes["pass"] += len(node_names)
            return filter_result(args, node_names, {}, {}), outcomes
        passed: list[str] = []
        failed: dict[str, str] = {}
        unresolvable: dict[str, str] = {}
        # Nodes that pass but where the choices binds recorded leave no room: node -> why.
        claimed: dict[str, str] = {}
        uid = podinfo.uid(args.pod)
        debug = log.isEnabledFor(logging.DEBUG)
        key = podinfo.pod_key(args.pod) if debug else ""
        with self.state.lock:
            self.state.expire()
            # A Binding of the pod that got no answer may still be made: bind refuses every other node
            # until the pod shows where it is, so filter passes none of them (preempting cannot help).
            earlier = self.state.unanswered_binding(uid) if uid else None
            elsewhere = (
                f"an earlier Binding of the pod to node {earlier} got no answer and may still be made: no other "
                f"node can take the pod until it shows where it is (at most {self.state.assume_ttl:g} s)"
            )
            with self.state.without(uid):
                for name in node_names:
                    if earlier is not None and name != earlier:
                        outcomes["unresolvable"] += 1
                        unresolvable[name] = elsewhere
                        continue
                    gpus, gone = self._known(name, args)
                    verdict, reason = ("unresolvable", gone) if gone else self.judge(gpus, requests, inits, sidecars)
                    if verdict == "pass" and gpus is not None:
                        reason = self._claimed_problem(name, uid, gpus, requests, inits, sidecars)
                        if reason:
                            claimed[name] = reason
                    if debug and verdict != "pass":  # what the reason leaves out: the node's own figures
                        log.debug(
                            "filter %s: node %s: %s (%s)",
                            key,
                            name,
                            reason,
                            free_figures(gpus.tree) if gpus is not None else "no GPUs",
                        )
                    outcomes[verdict] += 1
                    if verdict == "pass":
                        passed.append(name)
                    elif verdict == "fail":
                        failed[name] = reason
                    else:
                        unresolvable[name] = reason
        if claimed:
            # The scheduler is not sent to a bind that can only refuse the pod, even when no node has room.
            passed = [name for name in passed if name not in claimed]
            failed.update(claimed)
            outcomes["pass"] -= len(claimed)
            outcomes["fail"] += len(claimed)
        log.debug(
            "filter %s: %d pass, %d fail, %d unresolvable",
            podinfo.pod_key(args.pod),
            len(passed),
            len(failed),
            len(unresolvable),
        )
        return filter_result(args, passed, failed, unresolvable), outcomes

    def prioritize(self, args: ExtenderArgs) -> list[JSON]:
        """``HostPriorityList``: 0-10 per candidate (0 where the pod does not fit now, or where the pod or
        node has an unexpected shape)."""
        try:
            return self._prioritize(args)
        except SHAPE_ERRORS as exc:
            log.warning(
                "prioritize: pod %s: unexpected shape (%s: %s); every node scores 0",
                _pod_key(args.pod),
                type(exc).__name__,
                exc,
            )
            return [{"Host": name, "Score": 0} for name in args.names]

    def _prioritize(self, args: ExtenderArgs) -> list[JSON]:
        try:
            requests = requests_of(args.pod)
            sidecars = sidecar_requests_of(args.pod)
        except PodSpecError:
            requests, sidecars = [], []
        node_names = args.names
        if not requests and not sidecars:
            return [{"Host": name, "Score": 0} for name in node_names]
        scores: list[JSON] = []
        uid = podinfo.uid(args.pod)
        with self.state.lock:
            self.state.expire()
            with self.state.without(uid):
                for name in node_names:
                    gpus = self._node(name, args)
                    with self._claimed(name, uid):
                        placement = place(gpus, requests, self.policy, sidecars=sidecars) if gpus is not None else None
                    score = placement.score if placement is not None and placement.ok else 0
                    scores.append({"Host": name, "Score": score})
        return scores
