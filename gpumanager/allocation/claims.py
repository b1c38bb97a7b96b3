"""Prepared ResourceClaims (DRA mode) and their checkpoint form.

A claim prepared on this node holds one or more GPUs; each allocation result of
our driver names one GPU, the capacity it consumes (``cores``, ``memory``) and,
for a device that allows several allocations, a share ID. The records live in
the same checkpoint as the container allocations: each Prepare and Unprepare is
one journal record (``claim-put``, ``claim-del``), and the snapshot holds them
under ``Claims`` (a key upstream gpu-manager ignores)::

    {"PodGPUMapping": {...},
     "Claims": {"<claim uid>": {"Namespace": "ml", "Name": "train-gpu-x2k4",
                                "Devices": [{"Request": "gpu", "Pool": "node-a", "Device": "gpu-0",
                                             "Minor": 0, "ShareID": "…", "Cores": 30,
                                             "Memory": 4294967296, "Whole": false}]}}}

A claim recovered from a damaged checkpoint (whose lost part may have held its release) carries
``"Doubt": true`` until it has been checked against the API server: a start after a check that
could not conclude checks it again.

A result of an admin-access request (``"Admin": true``, written only then) gives its container
the whole GPU but consumes nothing of it: the kube-scheduler does not count such results, so
neither does the allocation state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpumanager.allocation.records import RecordError

#: What a claim UID may be: it names the claim's directory and CDI spec, and goes into the 48-byte
#: name field of its vcuda.config; so a plain name (letters, digits, ``-`` and ``_`` inside, at most
#: 47 characters; the API server's UUIDs are 36).
_CLAIM_UID = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,45}[A-Za-z0-9])?", re.ASCII)


def uid_problem(uid: object) -> str | None:
    """Why ``uid`` cannot be a claim UID (it would not be a plain file name), or None when it can."""
    if not isinstance(uid, str) or _CLAIM_UID.fullmatch(uid) is None:
        return (
            f"UID {uid!r} is not a claim UID (letters, digits, '-' and '_', starting and ending with a letter "
            "or digit, at most 47 characters)"
        )
    return None


def check_uid(uid: str) -> str:
    """``uid`` if it is a claim UID; ValueError naming it otherwise (before it becomes a path)."""
    problem = uid_problem(uid)
    if problem is not None:
        raise ValueError(problem)
    return uid


@dataclass(frozen=True)
class ClaimDevice:
    """One allocation result of a claim: a GPU and what the claim consumes of it."""

    request: str
    pool: str
    device: str  # gpu-<index>
    minor: int
    share_id: str  # "" when the device was allocated whole (no shareID)
    cores: int
    memory: int  # bytes
    whole: bool  # no consumed capacity, or all of it: no limits are enforced
    admin: bool = False  # admin access: the whole GPU, consuming none of it

    @property
    def top_request(self) -> str:
        """The request a container names for this result (``gpus`` for a ``gpus/share`` result)."""
        return self.request.partition("/")[0]

    @property
    def consumes(self) -> bool:
        """Whether the result takes capacity of its GPU (every result but admin access)."""
        return not self.admin

    def to_json(self) -> dict[str, Any]:
        """The checkpoint entry."""
        out: dict[str, Any] = {
            "Request": self.request,
            "Pool": self.pool,
            "Device": self.device,
            "Minor": self.minor,
            "ShareID": self.share_id,
            "Cores": self.cores,
            "Memory": self.memory,
            "Whole": self.whole,
        }
        if self.admin:
            out["Admin"] = True
        return out


@dataclass(frozen=True)
class ClaimAllocation:
    """A ResourceClaim prepared on this node."""

    uid: str
    namespace: str
    name: str
    devices: tuple[ClaimDevice, ...]
    #: GPUs (minors) of the driver's other claims that a container using this one also uses (whole
    #: GPUs, as a container with a share uses no other claim): its CDI spec names them in
    #: ``NVIDIA_VISIBLE_DEVICES`` too, since the runtime keeps only the last spec's variable.
    visible: tuple[int, ...] = ()
    #: Recovered from a damaged checkpoint (which may have lost its release) and not yet checked against
    #: the API server: kept so in the checkpoint (``"Doubt": true``) until the check concludes, so that a
    #: start after a check cut short (a release that could not be written, an API server not answering)
    #: checks it again. Not part of what the claim is (equality ignores it).
    in_doubt: bool = field(default=False, compare=False)

    @property
    def minors(self) -> tuple[int, ...]:
        """The GPUs (device minors) in result order."""
        return tuple(d.minor for d in self.devices)

    @property
    def shared(self) -> bool:
        """Whether any result is a share of its GPU (its limits are enforced)."""
        return any(not d.whole for d in self.devices)

    @property
    def share_requests(self) -> dict[str, tuple[ClaimDevice, ...]]:
        """The claim's shares by the request a container names (a ``firstAvailable`` result
        ``gpus/share`` under ``gpus``), in result order."""
        out: dict[str, list[ClaimDevice]] = {}
        for d in self.devices:
            if not d.whole:
                out.setdefault(d.top_request, []).append(d)
        return {name: tuple(devs) for name, devs in out.items()}

    @property
    def per_request(self) -> bool:
        """Whether the shares belong to several requests: each request is then limited on its own
        (its own vcuda.config), for the containers that name it."""
        return len(self.share_requests) > 1

    @property
    def share_limits(self) -> tuple[int, int] | None:
        """(cores, memory bytes) the claim's shares consume together, None when it holds none. A claim
        holds shares of one GPU only: several (requests the scheduler placed on the same GPU) are
        limited by their sum, what the scheduler charged the GPU for them."""
        shares = [d for d in self.devices if not d.whole]
        if not shares:
            return None
        return sum(d.cores for d in shares), sum(d.memory for d in shares)

    @property
    def key(self) -> str:
        """``<namespace>/<name>``."""
        return f"{self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        """The checkpoint entry."""
        out: dict[str, Any] = {
            "Namespace": self.namespace,
            "Name": self.name,
            "Devices": [d.to_json() for d in self.devices],
        }
        if self.visible:
            out["Visible"] = list(self.visible)
        if self.in_doubt:
            out["Doubt"] = True
        return out


def _field(entry: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = entry.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise RecordError(f"{where}: {name} {value!r} is not a {kind.__name__}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise RecordError(f"{where}: {name} {value!r} is negative")
    return value


def _minors(entry: Mapping[str, Any], name: str, where: str) -> tuple[int, ...]:
    """An optional list of GPU minors (absent: none)."""
    if name not in entry:
        return ()
    value = entry[name]
    if not isinstance(value, list) or any(type(m) is not int or m < 0 for m in value):
        raise RecordError(f"{where}: {name} {value!r} is not a list of GPU minors")
    return tuple(value)


def from_json(data: Any) -> tuple[list[ClaimAllocation], list[str]]:
    """The claims of a checkpoint document (its ``Claims`` key) and problems with skipped entries."""
    raw = data.get("Claims") if isinstance(data, Mapping) else None
    if raw is None:
        return [], []
    if not isinstance(raw, Mapping):
        raise RecordError("Claims is not an object")
    found: list[ClaimAllocation] = []
    problems: list[str] = []
    for uid, entry in raw.items():
        where = f"claim {uid}"
        try:
            problem = uid_problem(uid)
            if problem is not None:
                raise RecordError(f"{where}: {problem}")
            if not isinstance(entry, Mapping):
                raise RecordError(f"{where}: entry is not an object")
            devices = entry.get("Devices")
            if not isinstance(devices, list) or not devices:
                raise RecordError(f"{where}: Devices is not a non-empty list")
            parsed = []
            for i, dev in enumerate(devices):
                at = f"{where} device {i}"
                if not isinstance(dev, Mapping):
                    raise RecordError(f"{at}: not an object")
                parsed.append(
                    ClaimDevice(
                        request=_field(dev, "Request", str, at),
                        pool=_field(dev, "Pool", str, at),
                        device=_field(dev, "Device", str, at),
                        minor=_field(dev, "Minor", int, at),
                        share_id=_field(dev, "ShareID", str, at),
                        cores=_field(dev, "Cores", int, at),
                        memory=_field(dev, "Memory", int, at),
                        whole=_field(dev, "Whole", bool, at),
                        admin="Admin" in dev and _field(dev, "Admin", bool, at),
                    )
                )
            found.append(
                ClaimAllocation(
                    uid=str(uid),
                    namespace=_field(entry, "Namespace", str, where),
                    name=_field(entry, "Name", str, where),
                    devices=tuple(parsed),
                    visible=_minors(entry, "Visible", where),
                    in_doubt="Doubt" in entry and _field(entry, "Doubt", bool, where),
                )
            )
        except RecordError as exc:
            problems.append(str(exc))
    return found, problems


def to_json(claims: Iterable[ClaimAllocation]) -> dict[str, Any]:
    """The ``Claims`` object of the checkpoint."""
    return {c.uid: c.to_json() for c in claims}
