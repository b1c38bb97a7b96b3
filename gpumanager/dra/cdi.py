"""CDI specs of prepared claims: the only way a DRA driver gives a container env, mounts and devices.

One spec per claim, ``<cdi-root>/<driver>-<claim uid>.json``, kind ``<driver>/gpu``,
one CDI device per allocation result named from the claim UID, request, device and
share ID. What belongs to one device sits in that device's edits: its
``/dev/nvidia<minor>`` (so a container gets the GPUs of the claims it uses, and no other;
a CDI device without edits would invalidate the file). What is common to the claim sits
in the spec's own ``containerEdits``, which the runtime applies to every container that
uses any device of the spec: ``NVIDIA_VISIBLE_DEVICES=void`` (as NVIDIA's own CDI specs
have it: the GPUs come from the device nodes, and an nvidia-container-runtime in the way,
or an image's ``NVIDIA_VISIBLE_DEVICES=all``, adds none; the same value in every spec, so
the runtime's last-wins merge of env across a container's claims changes nothing), the
interceptor's env, the driver mirror read-only at ``/usr/local/nvidia``, the claim's
directory read-only at ``/etc/vcuda``, the control device nodes and
``extra-config.json``'s. No spec names a GPU of another claim. A claim whose shares belong to
several requests has each request limited on its own: the CDI device of each of its shares also
mounts its request's directory at ``/etc/vcuda``, over the claim's (a container that names a
request gets that request's devices only).
Written atomically (temp file, rename).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpumanager import names
from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice, check_uid, uid_problem
from gpumanager.device.types import GPUInfo
from gpumanager.dra import constants as c
from gpumanager.fileio import atomic_write
from gpumanager.vmanager.claims import REQUEST_DIR_PREFIX

JSON = dict[str, Any]
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]+")
_MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "bind"]
VISIBLE_DEVICES = "void"
"""``NVIDIA_VISIBLE_DEVICES`` of every spec: the device nodes of the CDI devices are the GPUs."""


@dataclass(frozen=True)
class CDISettings:
    """Node-wide inputs of every spec."""

    root: Path
    driver: str
    vdriver_nvidia: str  # host path of the driver mirror with the interceptor (shares)
    vdriver_origin: str  # host path of the untouched mirror (whole GPUs)
    virtual_manager_path: str
    extra_devices: tuple[str, ...] = ()

    @property
    def kind(self) -> str:
        """``<driver>/gpu``."""
        return f"{self.driver}/{c.CDI_CLASS}"


def spec_path(settings: CDISettings, claim_uid: str) -> Path:
    """``<cdi-root>/<driver>-<claim uid>.json``; ValueError when the UID is not a plain name."""
    return settings.root / f"{settings.driver}-{check_uid(claim_uid)}.json"


def device_name(claim_uid: str, dev: ClaimDevice) -> str:
    """The CDI device of one result: ``<claim uid>-<request>-<device>[-<share id>]``."""
    parts = [claim_uid, dev.request, dev.device] + ([dev.share_id] if dev.share_id else [])
    # CDI allows letters, digits, '_', '-', '.', ':' inside, and a letter or digit at both ends.
    return _UNSAFE.sub("_", "-".join(p for p in parts if p)).rstrip("_.:-")


def device_id(settings: CDISettings, claim_uid: str, dev: ClaimDevice) -> str:
    """The fully qualified CDI device ID the kubelet passes to the runtime."""
    return f"{settings.kind}={device_name(claim_uid, dev)}"


def claim_dir(settings: CDISettings, claim_uid: str) -> Path:
    """The claim's directory on the host (limit files), mounted at /etc/vcuda."""
    return Path(settings.virtual_manager_path) / check_uid(claim_uid)


def build_spec(settings: CDISettings, claim: ClaimAllocation, gpus: Sequence[GPUInfo]) -> JSON:
    """The CDI spec of a claim."""
    by_minor = {g.minor: g for g in gpus}
    # Never a GPU list: spec-level edits reach every container using any device of the spec (a
    # container using only this claim would be told another claim's GPUs), and env is merged
    # last-wins across a container's claims. A record's ``visible`` (older agents) is not used.
    env = [
        f"NVIDIA_VISIBLE_DEVICES={VISIBLE_DEVICES}",
        f"LD_LIBRARY_PATH={names.DRIVER_MOUNTPOINT}/lib64",
        f"{names.VCUDA_CONFIG_ENV}={names.VCUDA_MOUNTPOINT}/{names.VCUDA_CONFIG_FILE}",
    ]
    driver = settings.vdriver_nvidia if claim.shared else settings.vdriver_origin
    common = ["/dev/nvidiactl", "/dev/nvidia-uvm", *settings.extra_devices]
    edits: JSON = {
        "env": env,
        "deviceNodes": [{"path": p, "hostPath": p, "permissions": "rwm"} for p in dict.fromkeys(common)],
        "mounts": [
            {"hostPath": driver, "containerPath": names.DRIVER_MOUNTPOINT, "type": "bind", "options": _MOUNT_OPTIONS},
            {
                "hostPath": str(claim_dir(settings, claim.uid)),
                "containerPath": names.VCUDA_MOUNTPOINT,
                "type": "bind",
                "options": _MOUNT_OPTIONS,
            },
        ],
    }
    devices: list[JSON] = []
    for dev in claim.devices:
        node = by_minor[dev.minor].device_path
        own: JSON = {"deviceNodes": [{"path": node, "hostPath": node, "permissions": "rwm"}]}
        if claim.per_request and not dev.whole:
            # Its request's limits over the claim's: the runtime applies a device's edits after the
            # spec's, and a container that names this request gets only this request's devices.
            own["mounts"] = [
                {
                    "hostPath": str(claim_dir(settings, claim.uid) / f"{REQUEST_DIR_PREFIX}{dev.top_request}"),
                    "containerPath": names.VCUDA_MOUNTPOINT,
                    "type": "bind",
                    "options": _MOUNT_OPTIONS,
                }
            ]
        devices.append({"name": device_name(claim.uid, dev), "containerEdits": own})
    return {"cdiVersion": c.CDI_VERSION, "kind": settings.kind, "devices": devices, "containerEdits": edits}


def write_spec(settings: CDISettings, claim: ClaimAllocation, gpus: Sequence[GPUInfo]) -> Path:
    """Write (or replace) the claim's spec atomically; returns its path.

    Not fsynced: the claim itself is in the (durable) checkpoint, and a spec lost with a power
    failure is written again when the agent starts or the kubelet prepares the claim again.
    """
    path = spec_path(settings, claim.uid)
    data = json.dumps(build_spec(settings, claim, gpus), indent=2, sort_keys=True).encode() + b"\n"
    atomic_write(path, data)
    return path


def spec_current(settings: CDISettings, claim: ClaimAllocation, gpus: Sequence[GPUInfo]) -> bool:
    """Whether the claim's spec on disk is what :func:`build_spec` gives now."""
    try:
        return bool(json.loads(spec_path(settings, claim.uid).read_text()) == build_spec(settings, claim, gpus))
    except (OSError, ValueError):
        return False


def spec_gpus(settings: CDISettings, claim_uid: str, gpus: Sequence[GPUInfo]) -> frozenset[int]:
    """The GPUs (minors) whose device nodes the claim's spec on disk gives; all of ``gpus`` when the
    spec cannot be read (a claim that may hold any of them)."""
    paths = {g.device_path: g.minor for g in gpus}
    try:
        spec = json.loads(spec_path(settings, claim_uid).read_text())
        found = {
            paths[node["path"]]
            for dev in spec["devices"]
            for node in dev["containerEdits"].get("deviceNodes") or []
            if node.get("path") in paths
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return frozenset(paths.values())
    return frozenset(found)


def remove_spec(settings: CDISettings, claim_uid: str) -> bool:
    """Remove the claim's spec; returns whether there was one."""
    with contextlib.suppress(FileNotFoundError):
        spec_path(settings, claim_uid).unlink()
        return True
    return False


def specs_on_disk(settings: CDISettings) -> list[str]:
    """Claim UIDs of this driver's specs in the CDI root (names that hold no claim UID are not ours)."""
    prefix = f"{settings.driver}-"
    try:
        entries = sorted(settings.root.iterdir())
    except OSError:
        return []
    uids = [p.name[len(prefix) : -len(".json")] for p in entries if p.name.startswith(prefix) and p.suffix == ".json"]
    return [u for u in uids if uid_problem(u) is None]


def unfinished_writes(settings: CDISettings) -> list[Path]:
    """Temp files of this driver's specs left in the CDI root by a write that did not finish (the
    agent was killed between creating and renaming one)."""
    prefix = f".{settings.driver}-"
    try:
        return sorted(p for p in settings.root.iterdir() if p.name.startswith(prefix) and ".json." in p.name)
    except OSError:
        return []
