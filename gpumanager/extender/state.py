"""The extender's view of the cluster: each node's GPUs and what every pod holds, plus assumptions.

Fed by the node and pod watches (:meth:`ClusterState.node_event`, :meth:`ClusterState.pod_event`)
and by bind (:meth:`ClusterState.assume`, :meth:`ClusterState.forget`). A pod's *effective*
charges are its assumption when it has one (bind chose GPUs and the watch has not shown the
pod bound yet), else what the watch shows; only effective charges are held on the nodes.

An assumption lasts until the pod is seen bound (its annotations and ``spec.nodeName`` carry the
charge from then on), deleted or ended, or until the scheduler gave up on it (bind failed: the
Binding was refused, or the annotations could not be written), however long the binding takes
(a slow API server, a watch that lags). A pod bind bound (the API server answered its Binding
with success) keeps its assumption until the pod watch, or a relist of the pods, shows it bound,
ended or gone; it never expires by time. ``assume_ttl`` is a safety net only where nothing else
can tell: a Binding that got no answer (the API server may or may not make it). Every drop is
logged with its reason.

A pod the watch shows chosen for a node (its annotations written) but not bound, with no
assumption, holds its GPUs there for ``assume_ttl`` seconds from when this state first saw it
so, then no longer (gpu-admission chose it, or the extender restarted between its patch and its
Binding: nothing tells whether the scheduler still means to bind it), and not at all when bind
failed with those annotations (the scheduler was told, and places the pod anew). A later choice
(another predicate time) or its binding counts again.

Every method takes :attr:`ClusterState.lock`; callers that read the nodes hold it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from gpumanager.extender.charges import PodCharges, pod_charges, pod_spec
from gpumanager.extender.claims import ANNOTATION as CLAIMS
from gpumanager.extender.claims import Claim, Sightings, parse_claims
from gpumanager.extender.nodes import Node, NodeGPUs, UnusableNodeError, fingerprint, node_gpus, node_name

log = logging.getLogger(__name__)

NEVER = float("inf")
#: How many deleted nodes' UIDs are remembered (see :meth:`ClusterState.deleted_node`).
DELETED_NODES_KEPT = 4096
#: How many deleted or ended pods' UIDs are remembered (see :meth:`ClusterState.counting`).
ENDED_PODS_KEPT = 4096
#: Choices taken off nodes by this replica's binds that the nodes' watch has not shown gone yet, at most.
TAKEN_OFF_KEPT = 4096


@dataclass
class Assumption:
    """GPUs bind chose for a pod, held until the watch shows them."""

    charges: PodCharges
    expires: float = NEVER
    """When the safety net drops it (NEVER while bind runs); see :meth:`ClusterState.expire`."""
    bound: bool = False
    """Bind made the pod's Binding (False while binding, or when it cannot tell)."""
    seen: bool = False
    """The watch has shown the pod since the assumption was made (so it will show its binding)."""
    made: float = 0.0
    """When bind made it (``time.monotonic()``): a list started later shows the pod unless it is gone."""
    pod: str = ""
    """The pod's namespace/name (for logs; the watch may never have shown it)."""


class ClusterState:
    """Nodes, pods and assumptions. Thread-safe through :attr:`lock`."""

    def __init__(self, *, assume_ttl: float = 300.0) -> None:
        self.lock = threading.RLock()
        self.assume_ttl = assume_ttl
        self._nodes: dict[str, NodeGPUs] = {}
        self._fingerprints: dict[str, tuple[str, str, str]] = {}
        # Node name -> UID of the node object last seen by that name (a node recreated under the same
        # name has another UID: the old one's deletion must not remove it).
        self._node_uids: dict[str, str] = {}
        # UIDs of nodes the watch showed deleted, oldest first (bounded): a scheduler whose cache lags
        # may still send one, which must not be brought back (it would stay for ever: no event of it comes).
        self._deleted_nodes: dict[str, str] = {}
        # Node name -> why its object, as last seen, cannot be judged (see UnusableNodeError).
        self._unusable: dict[str, str] = {}
        self._watched: dict[str, PodCharges] = {}
        self._assumed: dict[str, Assumption] = {}
        self._applied: dict[str, PodCharges] = {}
        self._by_node: dict[str, set[str]] = {}
        # Pod UID -> namespace/name (for logs), of pods the watch shows.
        self._keys: dict[str, str] = {}
        # Pods shown chosen for a node but not bound: UID -> (predicate time, when first seen so, namespace/name).
        self._unbound: dict[str, tuple[str, float, str]] = {}
        # Bindings bind sent without an answer: UID -> (node, until when the API server may still make it).
        self._unanswered: dict[str, tuple[str, float]] = {}
        # Pods whose bind failed after choosing: UID -> that choice's predicate time (holds nothing).
        self._given_up: dict[str, str] = {}
        # When each entry of _given_up was made (a pod deleted before its bind failed leaves one that
        # no pod event will clear).
        self._given_up_at: dict[str, float] = {}
        # UIDs of pods the watch showed deleted or ended, oldest first (bounded): a choice another
        # bind recorded on a node for one of them holds nothing any more.
        self._ended: dict[str, None] = {}
        #: When this replica first read each choice recorded on a node (see :mod:`gpumanager.extender.claims`).
        self.sightings = Sightings()
        # Node name -> (the choices annotation as the watch last showed it, its claims).
        self._node_claims: dict[str, tuple[str, dict[str, Claim]]] = {}
        # (node, pod UID) -> the predicate time of a choice a bind of this replica took off the node, until the
        # node's watch shows it gone.
        self._taken_off: dict[tuple[str, str], str] = {}

    # -- reading ----------------------------------------------------------------------------------

    def node(self, name: str) -> NodeGPUs | None:
        """A node's GPUs (hold :attr:`lock` while using them)."""
        with self.lock:
            return self._nodes.get(name)

    def node_names(self) -> list[str]:
        """Nodes with GPUs."""
        with self.lock:
            return sorted(self._nodes)

    def assumed_count(self) -> int:
        """Pods in the assume cache."""
        with self.lock:
            return len(self._assumed)

    def is_assumed(self, uid: str) -> bool:
        """Whether the pod has an assumption."""
        with self.lock:
            return uid in self._assumed

    def pod_count(self) -> int:
        """Pods holding (or about to hold) GPUs."""
        with self.lock:
            return len(self._applied)

    def unplaced(self) -> int:
        """GPU containers on nodes whose GPUs are not named yet."""
        with self.lock:
            return sum(c.unplaced for c in self._applied.values())

    def over_committed(self) -> dict[str, list[int]]:
        """Node -> minors of GPUs holding more than they have (empty when all is well)."""
        with self.lock:
            found = {name: n.over_committed() for name, n in self._nodes.items()}
        return {k: v for k, v in found.items() if v}

    # -- nodes ------------------------------------------------------------------------------------

    def node_claims(self, name: str) -> dict[str, Claim]:
        """The choices binds (of any replica) recorded on the node, as its watch last showed it, that
        still count (:class:`~gpumanager.extender.claims.Sightings`; not one a bind of this replica took off,
        :meth:`taken_off`), by pod UID."""
        with self.lock:
            found = self._node_claims.get(name)
            if not found:
                return {}
            taken = {uid: self._taken_off[(name, uid)] for uid in found[1] if (name, uid) in self._taken_off}
        live = self.sightings.live(found[1])
        return {uid: c for uid, c in live.items() if taken.get(uid) != c.predicate_time}

    def recorded(self, name: str, uid: str) -> None:
        """A bind of this replica recorded the pod's choice on node ``name``: one it took off before, perhaps of the
        same predicate time, counts again."""
        with self.lock:
            self._taken_off.pop((name, uid), None)

    def taken_off(self, name: str, uid: str, predicate_time: str) -> None:
        """A bind of this replica took the pod's choice of ``predicate_time`` off node ``name``: it holds nothing
        from now, though the node's watch may show it a while longer (a filter then refused the node for GPUs that
        were free)."""
        with self.lock:
            self._taken_off[(name, uid)] = predicate_time
            while len(self._taken_off) > TAKEN_OFF_KEPT:
                del self._taken_off[next(iter(self._taken_off))]

    def nodes_with_lapsed_claims(self) -> list[str]:
        """Nodes whose recorded choices, as the watch last showed them, include some that lapsed here
        and that held GPUs while they counted (not of a pod the watch showed ended, nor a choice the
        pod's own annotations count here): their lapse freed room that no cluster event announced."""
        with self.lock:
            found = [(name, parsed) for name, (_raw, parsed) in self._node_claims.items()]
        out = []
        for name, parsed in found:
            live = self.sightings.live(parsed)
            lapsed = {uid: c for uid, c in parsed.items() if uid not in live}
            if lapsed and self.uncounted(name, lapsed, ""):
                out.append(name)
        return out

    def _note_claims(self, name: str, node: Node) -> None:
        meta = node.get("metadata")
        notes = meta.get("annotations") if isinstance(meta, dict) else None
        raw = notes.get(CLAIMS) if isinstance(notes, dict) else None
        if not isinstance(raw, str) or not raw:
            self._node_claims.pop(name, None)
        elif name not in self._node_claims or self._node_claims[name][0] != raw:
            parsed = parse_claims(node)
            self._node_claims[name] = (raw, parsed)
            self.sightings.live(parsed)  # read now: a list of the pods started later shows them, or they are gone
        shown = self._node_claims.get(name, ("", {}))[1]
        for key in [k for k in self._taken_off if k[0] == name]:
            claim = shown.get(key[1])
            if claim is None or claim.predicate_time != self._taken_off[key]:
                del self._taken_off[key]  # the watch shows it gone

    def node_event(self, kind: str, node: Node) -> None:
        """A node was added, changed or deleted."""
        name = node_name(node)
        with self.lock:
            if kind != "DELETED":
                self._note_claims(name, node)
            if kind == "DELETED":
                uid, current = _node_uid(node), self._node_uids.get(name, "")
                if uid:
                    self._deleted_nodes[uid] = name
                    while len(self._deleted_nodes) > DELETED_NODES_KEPT:
                        del self._deleted_nodes[next(iter(self._deleted_nodes))]
                if uid and current and uid != current:
                    # A relist delivers the node recreated under this name before the old one's end.
                    log.info("node %s: the deleted object (UID %s) was replaced by UID %s; kept", name, uid, current)
                    return
                self._node_uids.pop(name, None)
                self._node_claims.pop(name, None)
                self._fingerprints.pop(name, None)
                self._unusable.pop(name, None)
                if self._nodes.pop(name, None) is not None:
                    log.info("node %s removed", name)
                return
            self.add_node(node)

    def unusable(self, name: str) -> str:
        """Why the node's object, as last seen, cannot be judged ("" when it can)."""
        with self.lock:
            return self._unusable.get(name, "")

    def seen_node(self, name: str) -> bool:
        """Whether a usable object of the node is known (with GPUs or without), as the watch or a
        scheduler's request showed it."""
        with self.lock:
            return name in self._fingerprints

    def deleted_name(self, name: str) -> bool:
        """Whether the watch has shown a node of this name deleted (and none of it since)."""
        with self.lock:
            return name not in self._fingerprints and name in self._deleted_nodes.values()

    def deleted_node(self, node: Node) -> bool:
        """Whether the watch has shown this node object (by UID) deleted."""
        uid = _node_uid(node)
        with self.lock:
            return bool(uid) and uid in self._deleted_nodes

    def add_node(self, node: Node) -> NodeGPUs | None:
        """Build (or rebuild, when its GPUs changed) a node's GPUs and hold its pods' charges on them;
        None for a node without GPUs, or one the watch has shown deleted (not added)."""
        name = node_name(node)
        mark = fingerprint(node)
        with self.lock:
            uid = _node_uid(node)
            if uid and uid in self._deleted_nodes:
                log.debug("node %s (UID %s) was deleted; not added again", name, uid)
                return None
            if uid:
                self._node_uids[name] = uid
            if self._fingerprints.get(name) == mark:
                return self._nodes.get(name)
            try:
                gpus = node_gpus(node)
            except UnusableNodeError as exc:
                # Remembered: judged again only when its GPUs' fields change (warned once per change).
                log.warning("node %s: %s; not used", name, exc)
                self._fingerprints[name] = mark
                self._unusable[name] = str(exc)
                self._nodes.pop(name, None)
                return None
            except (AttributeError, TypeError, ValueError, RecursionError) as exc:
                # Not remembered as seen: the node's next event is looked at again.
                log.warning(
                    "node %s: its object has an unexpected shape (%s: %s); not used", name, type(exc).__name__, exc
                )
                return self._nodes.get(name)
            self._fingerprints[name] = mark
            self._unusable.pop(name, None)
            if gpus is None:
                self._nodes.pop(name, None)
                return None
            for uid in self._by_node.get(name, ()):
                gpus.charge(self._applied[uid].charges, pod=self._key(uid))
            self._nodes[name] = gpus
            unhealthy = [leaf.minor for leaf in gpus.tree.leaves if not leaf.healthy]
            log.info(
                "node %s: %d GPUs%s%s",
                name,
                gpus.gpu_count,
                f", unhealthy: {unhealthy}" if unhealthy else "",
                f" ({gpus.note})" if gpus.note else "",
            )
            return gpus

    # -- pods -------------------------------------------------------------------------------------

    def pod_event(self, kind: str, pod: Pod) -> None:
        """A pod was added, changed or deleted (as the watch shows it)."""
        uid = podinfo.uid(pod)
        with self.lock:
            bound_to = str(pod_spec(pod).get("nodeName") or "")
            if kind == "DELETED" or bound_to:
                self._unanswered.pop(uid, None)  # bound (or gone): no Binding is pending any more
                self._given_up.pop(uid, None)
                self._given_up_at.pop(uid, None)
            charges = None if kind == "DELETED" else pod_charges(pod)
            assumption = self._assumed.get(uid)
            if charges is not None and not charges.bound:
                seen = self._unbound.get(uid)
                if seen is None or seen[0] != charges.predicate_time:
                    self._unbound[uid] = (charges.predicate_time, time.monotonic(), podinfo.pod_key(pod))
                elif assumption is None and time.monotonic() - seen[1] > self.assume_ttl:
                    charges = None  # chosen long ago and never bound: it holds nothing
                if charges is not None and self._given_up.get(uid) == charges.predicate_time:
                    charges = None  # bind failed with this choice: the scheduler places the pod anew
            else:
                self._unbound.pop(uid, None)
            if charges is None:
                self._watched.pop(uid, None)
            else:
                self._watched[uid] = charges
            if assumption is not None:
                why = ""
                if kind == "DELETED":
                    why = "it was deleted"
                elif podinfo.phase(pod) in ("Succeeded", "Failed"):
                    why = f"it has ended ({podinfo.phase(pod)})"
                elif bound_to:
                    why = "bound"
                else:
                    assumption.seen = True
                if why == "bound" and bound_to == assumption.charges.node:
                    log.debug(
                        "pod %s (%s) is bound to %s: its annotations hold its GPUs", podinfo.pod_key(pod), uid, bound_to
                    )
                elif why == "bound":
                    log.warning(
                        "pod %s (%s) is bound to node %s, not %s where bind chose its GPUs: no longer held there",
                        podinfo.pod_key(pod),
                        uid,
                        bound_to,
                        assumption.charges.node,
                    )
                elif why:
                    log.info(
                        "pod %s (%s): %s before the watch showed it bound; its GPUs on node %s are no longer held",
                        podinfo.pod_key(pod),
                        uid,
                        why,
                        assumption.charges.node,
                    )
                if why:
                    del self._assumed[uid]
            if kind == "DELETED" or podinfo.phase(pod) in ("Succeeded", "Failed"):
                self._ended[uid] = None
                while len(self._ended) > ENDED_PODS_KEPT:
                    del self._ended[next(iter(self._ended))]
            if kind == "DELETED":
                self._keys.pop(uid, None)
            else:
                self._keys[uid] = podinfo.pod_key(pod)
            self._reapply(uid)

    def _key(self, uid: str, assumption: Assumption | None = None) -> str:
        """The pod's namespace/name (as the watch showed it, else as bind named it) and UID, else its UID."""
        key = self._keys.get(uid) or (assumption.pod if assumption is not None else "")
        return f"{key} ({uid})" if key else uid

    def assumption(self, uid: str) -> Assumption | None:
        """A copy of the pod's assumption (None without one)."""
        with self.lock:
            found = self._assumed.get(uid)
            return None if found is None else replace(found)

    def bound_to(self, uid: str) -> str | None:
        """The node bind bound the pod to, while its assumption lasts (None when no bind has made one)."""
        with self.lock:
            found = self._assumed.get(uid)
            return found.charges.node if found is not None and found.bound else None

    def restore(self, uid: str, previous: Assumption | None) -> None:
        """Put back the assumption the pod had before a bind that failed (drop it when it had none, or
        when the watch has shown the pod with it meanwhile)."""
        with self.lock:
            watched = self._watched.get(uid)
            if previous is None or (
                watched is not None and watched.bound and watched.predicate_time == previous.charges.predicate_time
            ):
                self._assumed.pop(uid, None)
            else:
                self._assumed[uid] = replace(previous)
            self._reapply(uid)

    def assume(self, uid: str, charges: PodCharges, pod: str = "") -> None:
        """Hold ``charges`` for the pod (``pod``: its namespace/name, for logs) from now on (bind chose them)."""
        with self.lock:
            self._assumed[uid] = Assumption(charges, made=time.monotonic(), pod=pod)
            self._reapply(uid)

    def assumed_bound(self, uid: str, *, bound: bool = True, node: str = "") -> None:
        """Bind finished: the assumption lasts until the watch (or a relist) shows the pod bound,
        deleted or ended, however late that is.

        ``bound=False``: bind could not tell whether the API server made the Binding (it did not
        answer in time); the GPUs stay held all the same, but a later bind of the pod is no repeat,
        and the assumption ends ``assume_ttl`` seconds from now unless the watch showed the pod bound
        before.
        """
        with self.lock:
            until = time.monotonic() + self.assume_ttl
            assumption = self._assumed.get(uid)
            if assumption is not None:
                assumption.expires = NEVER if bound else until
                assumption.bound = bound
                node = node or assumption.charges.node
            if not bound and node:  # remembered even when the watch has ended the assumption already
                self._unanswered[uid] = (node, until)

    def unanswered_binding(self, uid: str) -> str | None:
        """The node of a Binding of the pod that got no answer and may still be made (within
        ``assume_ttl``, until the watch shows the pod bound or gone); None without one."""
        with self.lock:
            found = self._unanswered.get(uid)
            if found is None:
                return None
            if time.monotonic() > found[1]:
                del self._unanswered[uid]
                return None
            return found[0]

    def forget(self, uid: str) -> None:
        """Drop the pod's assumption: bind failed, the scheduler was told and places the pod anew.

        Annotations of that choice left on the pod (they could not be removed) hold nothing either."""
        with self.lock:
            found = self._assumed.pop(uid, None)
            if found is None:
                return
            log.info(
                "pod %s: bind to node %s failed; its GPUs there (predicate time %s) are no longer held",
                self._key(uid, found),
                found.charges.node,
                found.charges.predicate_time,
            )
            self.given_up(uid, found.charges.predicate_time)
            self._reapply(uid)

    def given_up(self, uid: str, predicate_time: str) -> None:
        """Bind failed after writing (or trying to write) the choice of ``predicate_time``: while the
        pod is not bound, annotations carrying it hold nothing (the scheduler places the pod anew)."""
        with self.lock:
            self._given_up[uid] = predicate_time
            self._given_up_at[uid] = time.monotonic()
            watched = self._watched.get(uid)
            if watched is not None and not watched.bound and watched.predicate_time == predicate_time:
                del self._watched[uid]
            self._reapply(uid)

    def relisted(self, listed: Collection[str], since: float) -> int:
        """The pods were listed anew (after a watch gap), the list asked for at ``since``
        (``time.monotonic()``), ``listed`` the UIDs it shows: drop the assumptions, made before,
        of pods it no longer shows (deleted or ended while the watch was away: no event of theirs
        will come); returns how many were dropped. Those pods, and the pods of choices recorded on nodes
        that this state read before ``since`` but the list does not show, count as ended: their recorded
        choices hold nothing any more."""
        with self.lock:
            gone = [uid for uid, a in self._assumed.items() if a.made < since and uid not in listed]
            for uid in sorted(set(gone) | self.sightings.pods_read_before(since)):
                if uid not in listed:
                    self._ended[uid] = None
            while len(self._ended) > ENDED_PODS_KEPT:
                del self._ended[next(iter(self._ended))]
            for uid in gone:
                found = self._assumed.pop(uid)
                self._unanswered.pop(uid, None)
                log.info(
                    "pod %s: the pods' list no longer shows it (deleted or ended while the watch was away); "
                    "its GPUs on node %s (predicate time %s) are no longer held",
                    self._key(uid, found),
                    found.charges.node,
                    found.charges.predicate_time,
                )
                self._reapply(uid)
            return len(gone)

    def expire(self) -> int:
        """The safety net, where nothing else can tell: drop assumptions whose Binding got no answer
        ``assume_ttl`` seconds ago (never those bind bound), and the charges of pods chosen for a node
        (with no assumption) but not bound for longer than ``assume_ttl``; returns how many
        assumptions were dropped."""
        now = time.monotonic()
        with self.lock:
            gone = [uid for uid, a in self._assumed.items() if a.expires <= now and not a.bound]
            for uid in gone:
                found = self._assumed.pop(uid)
                log.warning(
                    "pod %s: its Binding got no answer, and the watch has not shown the pod bound since "
                    "(%g s): its GPUs on node %s (predicate time %s) are no longer held for it",
                    self._key(uid, found),
                    self.assume_ttl,
                    found.charges.node,
                    found.charges.predicate_time,
                )
                self._reapply(uid)
            for uid, (when, seen, key) in list(self._unbound.items()):
                watched = self._watched.get(uid)
                if watched is None or watched.bound or uid in self._assumed or now - seen <= self.assume_ttl:
                    continue
                log.warning(
                    "pod %s (%s) was chosen for node %s (predicate time %s) but not bound within %g s: "
                    "its GPUs there are no longer held for it",
                    key,
                    uid,
                    watched.node,
                    when or "none",
                    self.assume_ttl,
                )
                del self._watched[uid]
                self._reapply(uid)
            # Entries of pods that may be gone: an unanswered Binding past its time, a failed choice the
            # watch has not shown chosen for longer than assume_ttl (the pod was deleted before bind
            # failed, or its annotations were removed): no pod event would ever clear them.
            for uid in [u for u, (_node, until) in self._unanswered.items() if now > until]:
                del self._unanswered[uid]
            for uid, at in list(self._given_up_at.items()):
                shown = self._unbound.get(uid)
                if now - at > self.assume_ttl and (shown is None or shown[0] != self._given_up.get(uid)):
                    del self._given_up_at[uid]
                    self._given_up.pop(uid, None)
            return len(gone)

    @contextmanager
    def without(self, uid: str) -> Iterator[None]:
        """Within the block the pod's own charges are not held (a pod is judged against the others)."""
        with self.lock:
            mine = self._applied.get(uid)
            node = self._nodes.get(mine.node) if mine is not None else None
            if mine is None or node is None:
                yield
                return
            node.charge(mine.charges, -1)
            try:
                yield
            finally:
                node.charge(mine.charges, pod=self._key(uid))

    @contextmanager
    def counting(self, node_name: str, claims: Mapping[str, Claim], skip: str) -> Iterator[None]:
        """Within the block the node also holds the choices other binds (of any replica) recorded on
        it (``claims``, by pod UID; ``skip``: the pod being bound), where this state does not count
        that very choice (the same predicate time) there already, and where the watch has not shown the
        pod deleted or ended. Where this state counts another choice of the pod there, both count: the
        predicate times come from different replicas' clocks, which may disagree, so neither can be
        told to be the later one (at worst a pod is refused and tried again while the watch lags)."""
        with self.lock:
            node = self._nodes.get(node_name)
            extra = [(uid, c.charges) for uid, c in self.uncounted(node_name, claims, skip).items()]
            for uid, charges in extra:
                assert node is not None
                node.charge(charges, pod=self._key(uid))
            try:
                yield
            finally:
                for _uid, charges in extra:
                    assert node is not None
                    node.charge(charges, -1)

    def uncounted(self, node_name: str, claims: Mapping[str, Claim], skip: str) -> dict[str, Claim]:
        """The choices among ``claims`` (recorded on the node) that :meth:`counting` adds to what the node
        holds: not of ``skip``, not of a pod the watch has shown deleted or ended, not that very choice
        (the same predicate time) counted there already; empty for a node this state does not hold."""
        with self.lock:
            if node_name not in self._nodes:
                return {}
            out: dict[str, Claim] = {}
            for uid, claim in claims.items():
                mine = self._applied.get(uid)
                here = mine if mine is not None and mine.node == node_name else None
                if (
                    uid == skip
                    or uid in self._ended
                    or (here is not None and here.predicate_time == claim.predicate_time)
                ):
                    continue
                out[uid] = claim
            return out

    def ended(self, uid: str) -> bool:
        """Whether the watch showed the pod deleted or ended (among the last :data:`ENDED_PODS_KEPT`)."""
        with self.lock:
            return uid in self._ended

    def _reapply(self, uid: str) -> None:
        assumption = self._assumed.get(uid)
        wanted = assumption.charges if assumption is not None else self._watched.get(uid)
        current = self._applied.get(uid)
        if wanted == current:
            return
        if current is not None:
            node = self._nodes.get(current.node)
            if node is not None:
                node.charge(current.charges, -1)
            members = self._by_node.get(current.node)
            if members is not None:
                members.discard(uid)
                if not members:
                    del self._by_node[current.node]
            del self._applied[uid]
        if wanted is not None:
            node = self._nodes.get(wanted.node)
            if node is not None:
                node.charge(wanted.charges, pod=self._key(uid))
            self._by_node.setdefault(wanted.node, set()).add(uid)
            self._applied[uid] = wanted


def _node_uid(node: Node) -> str:
    """``metadata.uid`` of a node object ("" when absent or of another shape)."""
    meta = node.get("metadata")
    uid = meta.get("uid") if isinstance(meta, dict) else None
    return uid if isinstance(uid, str) else ""
