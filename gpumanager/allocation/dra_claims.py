"""DRA claims prepared on this node: recording a claim and occupying its GPUs, dropping it at Unprepare, and taking
over claims from the checkpoint or rebuilt. The public functions take the allocator's lock themselves; the others
are called with it held."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation import gpu_charges
from gpumanager.allocation.claims import ClaimAllocation
from gpumanager.allocation.model import (
    AllocationError,
    _claim_del,
    _claim_device_text,
    _claim_put,
    _oserror,
)
from gpumanager.faults import crash_point

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def claims(allocator: Allocator) -> list[ClaimAllocation]:
    """Every prepared claim, ordered by UID."""
    with allocator._lock:
        return [allocator._claims[uid] for uid in sorted(allocator._claims)]


def claim(allocator: Allocator, uid: str) -> ClaimAllocation | None:
    """A prepared claim by UID."""
    with allocator._lock:
        return allocator._claims.get(uid)


def prepare_claim(
    allocator: Allocator, claim: ClaimAllocation, *, allow_unhealthy: frozenset[int] = frozenset()
) -> bool:
    """Record a claim and occupy its GPUs; one journal record, durable before returning. Returns False
    when it was already prepared (a repeated Prepare: nothing changes).

    Refused (AllocationError naming the claim, the device and the amounts, nothing changed) when
    a GPU is not on this node, is unhealthy (unless its minor is in ``allow_unhealthy``: the
    result tolerates the taint), or cannot hold what the claim consumes next to the claims
    already prepared.
    """
    who = f"claim {claim.key} ({claim.uid})"
    with allocator._lock:
        known = allocator._claims.get(claim.uid)
        if known is not None:
            return False
        wanted: dict[int, tuple[int, int, bool]] = {}
        for dev in claim.devices:
            try:
                leaf = allocator._tree.leaf_by_minor(dev.minor)
            except (KeyError, ValueError):
                raise AllocationError(
                    f"{who}: device {dev.device}: GPU minor {dev.minor} is not on this node"
                ) from None
            if not leaf.healthy and dev.minor not in allow_unhealthy:
                raise AllocationError(f"{who}: device {dev.device} is unhealthy", "unavailable")
            if not dev.consumes:
                continue
            cores, memory, whole = wanted.get(dev.minor, (0, 0, False))
            wanted[dev.minor] = (cores + dev.cores, memory + dev.memory, whole or dev.whole)
        for minor, (cores, memory, whole) in sorted(wanted.items()):
            leaf = allocator._tree.leaf_by_minor(minor)
            name = next(d.device for d in claim.devices if d.minor == minor)
            free_cores, free_memory = leaf.allocatable_cores, leaf.allocatable_memory
            if whole and free_cores < names.HUNDRED_CORES:
                raise AllocationError(
                    f"{who}: device {name} is asked for whole but holds {names.HUNDRED_CORES - free_cores} cores "
                    f"of other allocations",
                    "exhausted",
                )
            if cores > free_cores or memory > free_memory:
                raise AllocationError(
                    f"{who}: device {name}: consumed capacity cores={cores} memory={memory} is more than the "
                    f"device has left (cores={free_cores} memory={free_memory})",
                    "exhausted",
                )
        occupy_claim(allocator, claim)
        allocator._claims[claim.uid] = claim
        allocator._generation += 1
        crash_point("prepare-before-checkpoint")
        try:
            ticket = allocator._stage([_claim_put(claim)])
        except OSError as exc:
            drop_claim(allocator, claim.uid)
            raise AllocationError(
                f"{who}: {allocator._checkpoint_error}; no claim is prepared until it can be written", "unavailable"
            ) from exc
    try:
        allocator._sync_or_undo(
            ticket, lambda: allocator._claims.get(claim.uid) is claim and drop_claim(allocator, claim.uid) is not None
        )
    except OSError as exc:
        raise AllocationError(
            f"{who}: cannot write checkpoint {allocator._checkpoint_path}: {_oserror(exc)}; no claim is prepared "
            "until it can be written",
            "unavailable",
        ) from exc
    crash_point("prepare-after-checkpoint")
    allocator._notify()
    log.info(
        "prepared %s: %s",
        who,
        ", ".join(f"{d.device} ({_claim_device_text(d)})" for d in claim.devices),
    )
    return True


def drop_claim(allocator: Allocator, uid: str) -> ClaimAllocation | None:
    """Forget a prepared claim and free its GPUs; returns it, or None when none has ``uid``. Called with the
    allocator's lock held."""
    claim = allocator._claims.pop(uid, None)
    if claim is None:
        return None
    allocator._generation += 1
    if allocator._overcommitted.intersection(d.minor for d in claim.devices):
        gpu_charges.recharge(allocator, tuple(d.minor for d in claim.devices))
        return claim
    for dev in claim.devices:
        if not dev.consumes:
            continue
        try:
            leaf = allocator._tree.leaf_by_minor(dev.minor)
        except (KeyError, ValueError):
            continue
        allocator._tree.free(leaf.index, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)
    return claim


def occupy_claim(allocator: Allocator, claim: ClaimAllocation) -> None:
    """Take what the claim's results consume of their GPUs (admin access takes nothing)."""
    for dev in claim.devices:
        if dev.consumes:
            leaf = allocator._tree.leaf_by_minor(dev.minor)
            allocator._note_beyond(leaf, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)
            allocator._tree.occupy(leaf.index, names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory)


def unprepare_claim(allocator: Allocator, uid: str, *, keep_unwritten: bool = True) -> ClaimAllocation | None:
    """Free a claim's GPUs (one journal record); None when it was not prepared (a repeated Unprepare).

    AllocationError when the record cannot be written; the claim is then kept prepared, its GPUs held, as
    the checkpoint still has it: the kubelet retries an Unprepare that failed, and that retry writes the
    release. (Freed in memory only, the claim would come back from the checkpoint at the next start while
    the kubelet, told by its retry that the claim was unprepared, never unprepares it again.)
    ``keep_unwritten=False``: freed all the same (a release no one retries; the next write, a whole
    snapshot after a failure, records it).
    """
    with allocator._lock:
        claim = drop_claim(allocator, uid)
        if claim is None:
            return None
        try:
            ticket = allocator._stage([_claim_del(uid)])
        except OSError as exc:
            if keep_unwritten:
                keep_claim(allocator, claim)
            raise AllocationError(
                f"claim {claim.key} ({uid}): {allocator._checkpoint_error}{_unwritten(keep_unwritten)}", "unavailable"
            ) from exc
    try:
        if keep_unwritten:
            allocator._sync_or_undo(ticket, lambda: keep_claim(allocator, claim))
        else:
            allocator._sync(ticket)
    except OSError as exc:
        raise AllocationError(
            f"claim {claim.key} ({uid}): cannot write checkpoint {allocator._checkpoint_path}: {_oserror(exc)}"
            f"{_unwritten(keep_unwritten)}",
            "unavailable",
        ) from exc
    allocator._notify()
    log.info("unprepared claim %s (%s)", claim.key, uid)
    return claim


def _unwritten(kept: bool) -> str:
    return "; kept prepared until its release can be written" if kept else "; freed all the same"


def keep_claim(allocator: Allocator, claim: ClaimAllocation) -> bool:
    """Take back a claim whose release could not be written: it holds its GPUs again. False (nothing done)
    when its UID was prepared again meanwhile. Takes the allocator's lock (held by the caller or not)."""
    with allocator._lock:
        if claim.uid in allocator._claims:
            return False
        occupy_claim(allocator, claim)
        allocator._claims[claim.uid] = claim
        allocator._generation += 1
        return True


def in_doubt(allocator: Allocator) -> list[ClaimAllocation]:
    """The prepared claims still in doubt (recovered from a damaged checkpoint, not yet checked), by UID."""
    with allocator._lock:
        return [c for uid in sorted(allocator._claims) if (c := allocator._claims[uid]).in_doubt]


def settle_doubt(allocator: Allocator, uid: str) -> None:
    """A claim in doubt was checked and stays prepared: its record loses the mark (one journal record; when it
    cannot be written, the next start checks the claim again, which keeps it again)."""
    with allocator._changing():
        claim = allocator._claims.get(uid)
        if claim is None or not claim.in_doubt:
            return
        settled = replace(claim, in_doubt=False)
        allocator._claims[uid] = settled
        allocator._save_or_report([_claim_put(settled)])


#: A result's device: ``gpu-<the agent's index of the GPU>``.
_DEVICE = re.compile(r"gpu-(\d+)", re.ASCII)


def _current_minors(allocator: Allocator, claim: ClaimAllocation) -> ClaimAllocation:
    """``claim`` with each result's minor that of its device's GPU now.

    A result names its GPU by device (``gpu-<index>``: the agent's index stays with the GPU, by UUID), and
    the record keeps the GPU's minor as it was at Prepare. After a reboot the driver may have numbered the
    GPUs otherwise (a GPU no longer found moves the ones after it one lower): the record's minor is then
    another GPU's, whose device node the claim's CDI spec would give and whose capacity it would take."""
    by_index = {g.index: g for g in allocator._gpus}
    devices = []
    for dev in claim.devices:
        found = _DEVICE.fullmatch(dev.device)
        gpu = by_index.get(int(found.group(1))) if found else None
        if gpu is not None and gpu.minor != dev.minor:
            log.warning(
                "claim %s (%s): %s is minor %d now (was %d when it was prepared): the driver numbered the GPUs "
                "otherwise since; the claim follows its device",
                claim.key,
                claim.uid,
                dev.device,
                gpu.minor,
                dev.minor,
            )
            dev = replace(dev, minor=gpu.minor)
        devices.append(dev)
    return replace(claim, devices=tuple(devices)) if tuple(devices) != claim.devices else claim


def adopt_claims(allocator: Allocator, claims: Sequence[ClaimAllocation], *, source: str, save: bool = True) -> int:
    """Take over prepared claims (from the checkpoint, or rebuilt); returns how many. A result whose GPU
    has another minor now (:func:`_current_minors`) follows its device, and its record is written again."""
    taken: list[ClaimAllocation] = []
    moved: list[ClaimAllocation] = []
    with allocator._changing():
        for recorded in claims:
            claim = _current_minors(allocator, recorded)
            unknown = [m for m in claim.minors if m not in allocator._by_minor]
            if unknown:
                log.warning("%s: dropping claim %s: GPU(s) %s not on this node", source, claim.key, unknown)
                continue
            if claim.uid in allocator._claims:
                continue
            occupy_claim(allocator, claim)
            allocator._claims[claim.uid] = claim
            allocator._generation += 1
            taken.append(claim)
            if claim is not recorded:
                moved.append(claim)
        if taken and save:
            allocator._save_or_report([_claim_put(c) for c in taken])
        elif moved:
            allocator._save_or_report([_claim_put(c) for c in moved])
    if taken:
        allocator._notify()
    return len(taken)
