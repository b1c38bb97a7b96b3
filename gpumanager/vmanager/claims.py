"""Limit files of prepared ResourceClaims (DRA mode), in the formats the device plugin writes.

A claim's directory ``<vm>/<claim uid>`` is mounted read-only at ``/etc/vcuda`` in
every container that uses the claim; it holds ``vcuda.config`` (``gpu_memory`` and
``utilization`` = the consumed memory and cores of its shares, summed; ``enable=0`` for whole
GPUs) and, for a share, ``pids.config``: the host PIDs of every container using the
claim, so they are held to the claim's limits together.
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
        utilization=share[0],
        limit=0,
        hard_limit=1,
        driver_major=major,
        driver_minor=minor,
        enable=1,
    )


def write_config(vm_path: Path, claim: ClaimAllocation, driver_version: str) -> Path:
    """Write the claim's vcuda.config; returns its path."""
    path = claim_dir(vm_path, claim.uid) / names.VCUDA_CONFIG_FILE
    files.write_config(path, config_for(claim, driver_version))
    return path


def config_current(vm_path: Path, claim: ClaimAllocation, driver_version: str) -> bool:
    """Whether the claim's vcuda.config on disk holds today's values."""
    try:
        data = (claim_dir(vm_path, claim.uid) / names.VCUDA_CONFIG_FILE).read_bytes()
        return files.unpack(data) == config_for(claim, driver_version)
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


def write_pids(vm_path: Path, claim_uid: str, pids: Iterable[int]) -> list[int]:
    """Write the claim's pids.config."""
    return files.write_pids(claim_dir(vm_path, claim_uid) / names.PIDS_CONFIG_FILE, pids)


def remove(vm_path: Path, claim_uid: str) -> bool:
    """Remove the claim's directory; returns whether it existed."""
    directory = claim_dir(vm_path, claim_uid)
    if not directory.exists():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True
