"""Checks on names that become parts of host paths: pod UIDs, container names, container IDs.

A pod's directory is ``<virtual-manager-path>/<pod uid>`` and its containers'
files live in ``<pod dir>/<container name or id>/``. Every such name comes from
outside (the API server, the kubelet, a request on ``vcuda.sock``, a checkpoint
on disk) and is checked before it is joined to a path: pod UIDs must be UUIDs (or,
for a static pod, the kubelet's own UID of it: 32 lowercase hex digits), container
names DNS labels (RFC 1123, as Kubernetes requires) and container IDs plain tokens,
so nothing is ever written outside the pod's own directory.
"""

from __future__ import annotations

import re
from pathlib import Path

# Matched whole (fullmatch): a pattern ending in ``$`` would also take a name followed by a newline.
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
#: The kubelet's UID of a static pod (a pod from a manifest file or URL): the MD5 of the pod, its node and
#: its source, as hex (kubelet config/common.go); its mirror pod's kubernetes.io/config.mirror says the same.
_STATIC_UID = re.compile(r"[0-9a-f]{32}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


class UnsafeNameError(ValueError):
    """A name that must not become part of a path; the message names what and the value."""


def pod_uid(value: str) -> str:
    """``value`` when it is a UUID, or the kubelet's UID of a static pod (:func:`is_static_pod_uid`);
    UnsafeNameError otherwise."""
    if not _UUID.fullmatch(value) and not _STATIC_UID.fullmatch(value):
        raise UnsafeNameError(f"pod UID {value!r} is not a UUID (nor a static pod's UID: 32 lowercase hex digits)")
    return value


def is_static_pod_uid(value: str) -> bool:
    """Whether ``value`` has the form of the kubelet's UID of a static pod (32 lowercase hex digits: the
    config hash its mirror pod carries), which the kubelet's own records key the pod by."""
    return bool(_STATIC_UID.fullmatch(value))


def container_name(value: str) -> str:
    """``value`` when it is a DNS label (what Kubernetes allows as a container name)."""
    if not _DNS_LABEL.fullmatch(value):
        raise UnsafeNameError(f"container name {value!r} is not a DNS label (RFC 1123: a-z, 0-9, '-', at most 63)")
    return value


def container_id(value: str) -> str:
    """``value`` when it is a plain container-ID token (letters, digits, ``_.-``; no ``/``, not ``..``)."""
    if not _CONTAINER_ID.fullmatch(value) or value in (".", ".."):
        raise UnsafeNameError(f"container ID {value!r} is not a plain token")
    return value


def child(base: Path, *parts: str) -> Path:
    """``base/part/...`` after checking that each part is one plain path component inside ``base``."""
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise UnsafeNameError(f"{part!r} is not a single path component under {base}")
    return base.joinpath(*parts)  # one path made, not one per part
