"""The node's record of recent binds: what makes several extender replicas safe.

Each replica counts GPU shares from its own watch of pods, which lags behind what another replica
has just written. So before a bind writes a pod's annotations it records its choice on the Node
object, in the annotation :data:`ANNOTATION`, with the node's ``metadata.resourceVersion`` as
precondition: of two replicas choosing GPUs on one node at once, one write wins, the other gets
409 Conflict, reads the node again and chooses again with the winner's choice counted. A choice
counts :data:`CLAIM_TTL` seconds (long past the time every watch shows the pod's own annotations)
from when *this* replica first read it (:class:`Sightings`), then no more, and the next bind on the
node drops it. The replicas' clocks are not compared: a replica whose clock is behind writes an
``at`` that reads as long past elsewhere, one whose clock is ahead an ``at`` in the future, so
``at`` is for people reading the node only. Nothing is held across calls, so a replica that dies
mid-bind blocks nobody: at worst its choice holds the GPUs for :data:`CLAIM_TTL` after each other
replica first read it.

The value is a JSON object: pod UID -> ``{"pod": "<ns>/<name>", "at": <unix seconds>,
"time": "<predicate-time>", "gpus": [[minor, cores, memory bytes], ...]}``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumanager.extender.nodes import Charge

log = logging.getLogger(__name__)

ANNOTATION = "tencent.com/gpu-extender-binds"
#: Seconds a recorded choice counts, from when a replica first read it (each replica's own monotonic
#: clock: replicas are different processes, on different hosts, whose wall clocks may disagree).
CLAIM_TTL = 30.0
#: A sighting not renewed for this many times :data:`CLAIM_TTL` is forgotten (its choice left the node).
_FORGET_AFTER = 4
#: Seconds between two passes that forget such sightings.
_PRUNE_EVERY = 30.0


@dataclass(frozen=True)
class Claim:
    """One bind's choice on the node."""

    pod: str
    at: float
    predicate_time: str
    charges: tuple[Charge, ...]

    def to_json(self) -> dict[str, Any]:
        """The annotation's form of the claim."""
        return {
            "pod": self.pod,
            "at": self.at,
            "time": self.predicate_time,
            "gpus": [[c.minor, c.cores, c.memory] for c in self.charges],
        }


#: The largest number a claim holds (its writers' Go peers read int64s).
_INT64_MAX = 2**63 - 1


def _claim(value: Any) -> Claim | None:
    if not isinstance(value, dict):
        return None
    at, gpus = value.get("at"), value.get("gpus")
    if isinstance(at, int) and not isinstance(at, bool) and abs(at) <= _INT64_MAX:
        at = float(at)  # math.isfinite() of a larger int raises OverflowError
    if not isinstance(at, float) or not math.isfinite(at) or not isinstance(gpus, list):
        return None
    charges = []
    for g in gpus:
        if not (
            isinstance(g, list)
            and len(g) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _INT64_MAX for x in g)
        ):
            # A negative number would take charges off the GPU, one past an int64 is no one's: not read.
            return None
        charges.append(Charge(g[0], g[1], g[2]))
    return Claim(str(value.get("pod") or ""), float(at), str(value.get("time") or ""), tuple(charges))


def read_claims(node: Mapping[str, Any], now: float) -> dict[str, Claim]:
    """The claims recorded on the node object whose writer's ``at`` is at most :data:`CLAIM_TTL` before
    ``now`` (unix seconds), by pod UID: for inspecting a node. Binds and filters go by
    :meth:`Sightings.live` of :func:`parse_claims` instead, since writers' clocks may disagree."""
    return {uid: c for uid, c in parse_claims(node).items() if now - c.at <= CLAIM_TTL}


def parse_claims(node: Mapping[str, Any]) -> dict[str, Claim]:
    """Every claim recorded on the node object, by pod UID, however old. An unreadable value
    (logged) counts as none: the next bind's write replaces it."""
    meta = node.get("metadata")
    notes = meta.get("annotations") if isinstance(meta, dict) else None
    raw = notes.get(ANNOTATION) if isinstance(notes, dict) else None
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        data = None
    if not isinstance(data, dict):
        name = meta.get("name") if isinstance(meta, dict) else ""
        log.warning("node %s: annotation %s is not a JSON object (%.80r); ignored", name, ANNOTATION, raw)
        return {}
    out: dict[str, Claim] = {}
    for uid, value in data.items():
        claim = _claim(value)
        if claim is not None:
            out[str(uid)] = claim
    return out


class Sightings:
    """When this replica first read each recorded choice (by pod UID and predicate time), on its own
    monotonic clock: a choice counts :data:`CLAIM_TTL` seconds from then. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (pod UID, predicate time) -> (first read, last read), time.monotonic().
        self._seen: dict[tuple[str, str], tuple[float, float]] = {}
        self._pruned = time.monotonic()  # when sightings not renewed were last forgotten

    def live(self, claims: Mapping[str, Claim], now: float | None = None) -> dict[str, Claim]:
        """The claims among ``claims`` (read just now) that still count; records their sighting."""
        at = time.monotonic() if now is None else now
        ttl = CLAIM_TTL
        out: dict[str, Claim] = {}
        with self._lock:
            for uid, claim in claims.items():
                key = (uid, claim.predicate_time)
                first = self._seen.get(key, (at, at))[0]
                self._seen[key] = (first, at)
                if at - first <= ttl:
                    out[uid] = claim
            if at - self._pruned >= _PRUNE_EVERY:
                self._pruned = at
                horizon = at - _FORGET_AFTER * ttl
                self._seen = {k: v for k, v in self._seen.items() if v[1] >= horizon}
        return out

    def pods_read_before(self, since: float) -> set[str]:
        """UIDs of the pods whose recorded choices this replica first read before ``since`` (monotonic)."""
        with self._lock:
            return {uid for (uid, _), (first, _) in self._seen.items() if first < since}

    def written(self, uid: str, claim: Claim, now: float | None = None) -> None:
        """This replica recorded ``claim`` itself: it counts from now."""
        at = time.monotonic() if now is None else now
        with self._lock:
            self._seen.setdefault((uid, claim.predicate_time), (at, at))


def encode_claims(claims: Mapping[str, Claim]) -> str:
    """The annotation's value for ``claims``."""
    return json.dumps({uid: c.to_json() for uid, c in sorted(claims.items())}, separators=(",", ":"))
