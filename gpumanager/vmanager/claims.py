"""Limit files of prepared ResourceClaims (DRA mode), in the formats the device plugin writes.

A claim's directory ``<vm>/<claim uid>`` is mounted read-only at ``/etc/vcuda`` in
every container that uses the claim; it holds ``vcuda.config`` (``gpu_memory`` and
``utilization`` = the consumed memory and cores of its shares, summed; ``enable=0`` for whole
GPUs) and, for a share, ``pids.config``: the host PIDs of every container using the
claim, so they are held to the claim's limits together. A claim whose shares belong to several
requests also has a directory per request, ``request-<name>``, with that request's limits and
the PIDs of the containers that name it; the CDI device of each of its results mounts it at
``/etc/vcuda`` over the claim's.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable
from pathlib import Path

from gpumanager import names
from gpumanager.allocation.claims import ClaimAllocation, check_uid
from gpumanager.vmanager import files

log = logging.getLogger(__name__)


def claim_dir(vm_path: Path, claim_uid: str) -> Path:
    """``<vm>/<claim uid>``; ValueError when the UID is not a plain name (it would leave ``<vm>``)."""
    return vm_path / check_uid(claim_uid)


REQUEST_DIR_PREFIX = "request-"


def request_dir(vm_path: Path, claim_uid: str, request: str) -> Path:
    """``<vm>/<claim uid>/request-<request>``: the limit files of one request of a claim whose shares
    belong to several requests (``request`` is a DNS label, checked when the claim was read)."""
    if not request or "/" in request or request.startswith("."):
        raise ValueError(f"request name {request!r} cannot name a directory")
    return claim_dir(vm_path, claim_uid) / f"{REQUEST_DIR_PREFIX}{request}"


def request_configs(claim: ClaimAllocation, driver_version: str) -> dict[str, files.VcudaConfig]:
    """Request -> its vcuda.config, for a claim whose shares belong to several requests (else none):
    each request's shares (on one GPU) are limited by their sum, for the containers that name it."""
    if not claim.per_request:
        return {}
    major, minor = files.driver_version_fields(driver_version)
    return {
        request: files.VcudaConfig(
            pod_uid=claim.uid,
            container_name=claim.key,
            gpu_memory=sum(d.memory for d in held),
            utilization=sum(d.cores for d in held),
            limit=0,
            hard_limit=1,
            driver_major=major,
            driver_minor=minor,
            enable=1,
        )
        for request, held in claim.share_requests.items()
    }


def config_for(claim: ClaimAllocation, driver_version: str) -> files.VcudaConfig:
    """The claim's vcuda.config values."""
    major, minor = files.driver_version_fields(driver_version)
    share = claim.share_limits
    if share is None:
        return files.VcudaConfig(
            pod_uid=claim.uid,
            container_name=claim.key,
            gpu_memory=sum(d.memory for d in claim.devices),
            utilization=names.HUNDRED_CORES * len(claim.devices),
            driver_major=major,
            driver_minor=minor,
            enable=0,
        )
    return files.VcudaConfig(
        pod_uid=claim.uid,
        container_name=claim.key,
        gpu_memory=share[1],
        # Over 100 only for a claim whose requests' shares sit on several GPUs: each device of such a
        # claim mounts its request's directory over this one, and the interceptor refuses a config
        # above 100 (it fails closed), so it says 100.
        utilization=min(share[0], names.HUNDRED_CORES),
        limit=0,
        hard_limit=1,
        driver_major=major,
        driver_minor=minor,
        enable=1,
    )


def write_config(vm_path: Path, claim: ClaimAllocation, driver_version: str) -> Path:
    """Write the claim's vcuda.config (and each request's, :func:`request_configs`); returns the
    claim's path."""
    for request, config in request_configs(claim, driver_version).items():
        files.write_config(request_dir(vm_path, claim.uid, request) / names.VCUDA_CONFIG_FILE, config)
    path = claim_dir(vm_path, claim.uid) / names.VCUDA_CONFIG_FILE
    files.write_config(path, config_for(claim, driver_version))
    return path


def config_current(vm_path: Path, claim: ClaimAllocation, driver_version: str) -> bool:
    """Whether the claim's vcuda.config files on disk hold today's values."""
    wanted = {claim_dir(vm_path, claim.uid): config_for(claim, driver_version)}
    for request, config in request_configs(claim, driver_version).items():
        wanted[request_dir(vm_path, claim.uid, request)] = config
    try:
        return all(
            files.unpack((directory / names.VCUDA_CONFIG_FILE).read_bytes()) == config
            for directory, config in wanted.items()
        )
    except (OSError, ValueError):
        return False


def recorded_key(vm_path: Path, claim_uid: str) -> str | None:
    """The ``<namespace>/<name>`` the claim's vcuda.config names (None when it cannot be read)."""
    try:
        data = (claim_dir(vm_path, claim_uid) / names.VCUDA_CONFIG_FILE).read_bytes()
        key = files.unpack(data).container_name
    except (OSError, ValueError):
        return None
    namespace, sep, name = key.partition("/")
    return key if sep and namespace and name else None


def write_pids(vm_path: Path, claim_uid: str, pids: Iterable[int], request: str | None = None) -> list[int]:
    """Write the claim's pids.config (``request``: that request's, in its directory)."""
    directory = claim_dir(vm_path, claim_uid) if request is None else request_dir(vm_path, claim_uid, request)
    return files.write_pids(directory / names.PIDS_CONFIG_FILE, pids)


def remove(vm_path: Path, claim_uid: str) -> bool:
    """Remove the claim's directory; returns whether it existed."""
    directory = claim_dir(vm_path, claim_uid)
    if not directory.exists():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True
