"""The node's record of recent binds: what makes several extender replicas safe.

Each replica counts GPU shares from its own watch of pods, which lags behind what another replica
has just written. So before a bind writes a pod's annotations it records its choice on the Node
object, in the annotation :data:`ANNOTATION`, with the node's ``metadata.resourceVersion`` as
precondition: of two replicas choosing GPUs on one node at once, one write wins, the other gets
409 Conflict, reads the node again and chooses again with the winner's choice counted. A choice
is kept there :data:`CLAIM_TTL` seconds (long past the time every watch shows the pod's own
annotations), then dropped by the next bind on the node. Nothing is held across calls, so a
replica that dies mid-bind blocks nobody: at worst its choice holds the GPUs for the rest of
:data:`CLAIM_TTL`.

The value is a JSON object: pod UID -> ``{"pod": "<ns>/<name>", "at": <unix seconds>,
"time": "<predicate-time>", "gpus": [[minor, cores, memory bytes], ...]}``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpumanager.extender.nodes import Charge

log = logging.getLogger(__name__)

ANNOTATION = "tencent.com/gpu-extender-binds"
#: Seconds a recorded choice counts (wall clock: replicas are different processes, on different hosts).
CLAIM_TTL = 30.0


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


def _claim(value: Any) -> Claim | None:
    if not isinstance(value, dict):
        return None
    at, gpus = value.get("at"), value.get("gpus")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at) or not isinstance(gpus, list):
        return None
    charges = []
    for g in gpus:
        if not (isinstance(g, list) and len(g) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in g)):
            return None
        charges.append(Charge(g[0], g[1], g[2]))
    return Claim(str(value.get("pod") or ""), float(at), str(value.get("time") or ""), tuple(charges))


def read_claims(node: Mapping[str, Any], now: float) -> dict[str, Claim]:
    """The claims recorded on the node object that still count at ``now`` (unix seconds), by pod UID.
    An unreadable value (logged) counts as none: the next bind's write replaces it."""
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
        if claim is not None and now - claim.at <= CLAIM_TTL:
            out[str(uid)] = claim
    return out


def encode_claims(claims: Mapping[str, Claim]) -> str:
    """The annotation's value for ``claims``."""
    return json.dumps({uid: c.to_json() for uid, c in sorted(claims.items())}, separators=(",", ":"))
