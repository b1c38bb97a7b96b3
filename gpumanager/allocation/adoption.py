"""Taking over records at start: loading the checkpoint (its allocations, claims and freed-before-start entries),
setting aside one that cannot be read, and adopting allocations rebuilt from the kubelet's PodResources.
taking_over and with_own_memory are called with the allocator's lock held; the others take it themselves."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpumanager import safenames
from gpumanager.allocation import (
    checkpoint,
    gpu_charges,
    ids,
    journal,
    records,
)
from gpumanager.allocation import claims as claim_records
from gpumanager.allocation.model import (
    _FREED_GUESSES_KEPT,
    AllocationError,
    _del,
    _put,
    _request_of,
    _same_request,
)
from gpumanager.allocation.records import ContainerAllocation

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def load(allocator: Allocator) -> records.Parsed:
    """Load our checkpoint and occupy the tree; returns what was taken and what must be rebuilt.
    (Until it has returned or raised AllocationError, :meth:`close` leaves the files on disk as they are.)

    A file that cannot be read or parsed as a whole is moved aside (when it can be) and
    AllocationError(kind="unavailable") is raised: the caller rebuilds everything from the
    kubelet's records. An entry that cannot be trusted (a bad field, a GPU this node does not
    have, an unsafe name) is listed in ``untrusted`` for the caller to rebuild; a missing file
    recovers nothing.
    """
    try:
        parsed = read_checkpoint(allocator)
    except AllocationError:
        allocator._loaded = True  # set aside: the state rebuilt from the kubelet's records is the one to write
        raise
    allocator._loaded = True
    return parsed


def read_checkpoint(allocator: Allocator) -> records.Parsed:
    """Read the checkpoint and take over its claims, allocations and freed-before-start entries
    (:func:`load`'s work); a file that cannot be read is set aside and AllocationError(kind="unavailable")
    raised. Takes the allocator's lock itself."""
    try:
        with allocator._lock:
            loaded = allocator._store.load()
        data = loaded.document
        if data is None:
            return records.Parsed()
        parsed = records.from_json(data, loaded.origins)
        claims, claim_problems = claim_records.from_json(data)
    except checkpoint.CheckpointError as exc:  # names the file
        set_aside_checkpoint(allocator, str(exc))
        raise AllocationError(str(exc), "unavailable") from exc
    except records.RecordError as exc:
        why = f"checkpoint {allocator._checkpoint_path}: {exc}"
        set_aside_checkpoint(allocator, why)
        raise AllocationError(why, "unavailable") from exc
    except Exception as exc:  # a shape no check foresaw: the same as unreadable, never a failed start
        why = f"checkpoint {allocator._checkpoint_path} cannot be loaded: {type(exc).__name__}: {exc}"
        log.exception("%s", why)
        set_aside_checkpoint(allocator, why)
        raise AllocationError(why, "unavailable") from exc
    parsed.problems.extend(loaded.problems)
    parsed.journal_damaged = bool(loaded.problems)
    damaged = bool(loaded.problems or claim_problems)
    if damaged:
        # A release the damage lost may bring a claim back: each recovered claim is in doubt until checked
        # against the API server, and stays so in the checkpoint (written below, or by its own record) until
        # then, whatever the starts in between (a check cut short is made again at the next one).
        claims = [c if c.in_doubt else replace(c, in_doubt=True) for c in claims]
    allocator.claims_in_doubt = damaged or any(c.in_doubt for c in claims)
    # Claims first, recorded again only when marked in doubt now and no whole state is written below.
    rewrite = bool(loaded.problems or loaded.unnamed)
    allocator.adopt_claims(
        claims, source=str(allocator._checkpoint_path), save=damaged and not rewrite and bool(claims)
    )
    taken, refused = adopt_records(allocator, parsed.allocations, source=str(allocator._checkpoint_path))
    restore_freed(allocator, data)
    # Records named by the minors the driver gave before (:func:`renumber`) follow their GPUs: the whole state
    # is written with the minors of now (the freed-before-start entries too, which no record of theirs
    # writes again), before the next start reads it with no move left to make.
    if rewrite or allocator.renumbered:
        # Segments moved aside held changes (a release too) that are now only in memory; a snapshot
        # naming no segment (upstream's, after an upgrade) would have the next start discard every
        # change journaled over it. The whole state is written at once, before any change.
        with allocator._changing():
            allocator._save_or_report()
    parsed.allocations = taken
    parsed.untrusted.extend(a.key for a in refused)
    parsed.problems.extend(claim_problems)
    parsed.problems.extend(
        f"pod {a.pod_uid} container {a.container}: GPU(s) {list(a.minors)} not on this node"
        + (f" (the {loaded.origins[a.key]})" if a.key in loaded.origins else "")
        for a in refused
    )
    return parsed


def renumber(allocator: Allocator, alloc: ContainerAllocation, source: str) -> ContainerAllocation:
    """``alloc`` with each GPU's minor as the driver numbers that GPU now (:attr:`Allocator.renumbered`).

    A record names its GPUs by minor, as they were when it was answered. After a reboot that no longer
    found a GPU the driver numbers the GPUs after it one lower: the recorded minor is then another GPU's
    (or the lost GPU's, counted with a minor no GPU has), whose capacity the record would take while the
    kubelet's device IDs for it, and the limits of its answer, are of its own GPU. The record follows its
    GPU (written again as taken over); its start from the saved answer, whose device node reaches another
    GPU now, is refused (:mod:`gpumanager.deviceplugin.replaced`)."""
    moved = allocator.renumbered
    if not moved or not any(m in moved for m in alloc.minors):
        return alloc
    minors = tuple(moved.get(m, m) for m in alloc.minors)
    if alloc.key not in allocator._allocs:
        allocator.renumbered_from.setdefault(alloc.key, alloc.minors)
    log.warning(
        "%s: pod %s container %s: GPU minor(s) %s are %s now (the driver numbered the GPUs otherwise since it "
        "was answered); its allocation follows its GPU(s)",
        source,
        alloc.pod_uid,
        alloc.container,
        list(alloc.minors),
        list(minors),
    )
    return replace(alloc, minors=minors)


def restore_freed(allocator: Allocator, document: Mapping[str, Any]) -> None:
    """The allocations freed before their container started that the checkpoint remembers (a container
    the kubelet gave their IDs and our answer to may take one over at its start), but those some of whose
    IDs an allocation holds: given out again since."""
    found, problems = records.freed_from_json(document, key=journal.FREED_KEY, newest=_FREED_GUESSES_KEPT)
    for problem in problems:
        log.warning("checkpoint %s: %s; not remembered", allocator._checkpoint_path, problem)
    with allocator._lock:
        held = {i for a in allocator._allocs.values() for i in a.device_ids} if found else set()
        for wanted, same in found.items():
            if allocator.renumbered:
                same = [renumber(allocator, a, str(allocator._checkpoint_path)) for a in same]
            # Some of its IDs held: an Allocate gave them out again since (the kubelet had freed them).
            missing = sorted({m for a in same for m in a.minors} - allocator._by_minor.keys())
            if held.isdisjoint(wanted) and not missing:
                allocator._freed_guesses[wanted] = same
            else:
                log.info(
                    "checkpoint %s: %s %s: pod %s container %s: %s; not remembered",
                    allocator._checkpoint_path,
                    journal.FREED_KEY,
                    ids.describe(sorted(wanted)),
                    *same[0].key,
                    f"it names GPU(s) {missing}, which this node does not have"
                    if missing
                    else "an allocation holds some of its IDs (given out again since)",
                )
    if allocator._freed_guesses:
        log.info(
            "checkpoint %s remembers %d allocations freed before their containers started",
            allocator._checkpoint_path,
            len(allocator._freed_guesses),
        )


def set_aside_checkpoint(allocator: Allocator, why: str) -> None:
    """Move the snapshot and its journal aside: the caller rebuilds from the kubelet's records, and a
    later start must not replay this journal over the state written from then on. The segments go
    first: a start that dies in between finds the unusable snapshot again (never its journal alone,
    replayed over nothing as if it were the whole state)."""
    with allocator._lock:
        allocator._store.set_aside_segments(f"its snapshot is unusable ({why})")
    checkpoint.quarantine(allocator._checkpoint_path)
    allocator.claims_in_doubt = True


def adopt(
    allocator: Allocator,
    allocs: Sequence[ContainerAllocation],
    *,
    source: str,
    kubelet_holds: bool = False,
    answered: bool = True,
) -> int:
    """Take over allocations recorded elsewhere (our checkpoint, the kubelet's); returns how many.

    Containers we already hold are left as they are; entries naming a GPU this node does not
    have or an unsafe name are refused (and logged).

    ``kubelet_holds``: the kubelet's records say each container holds its device IDs now. An allocation
    made for an identical pod's container (the first in line when the kubelet gave its IDs to this one)
    that has not started, or one freed before its container started, with those very IDs and the same
    request, is what the kubelet gave this container our answer of: it is taken over, never kept
    beside (its GPUs charged twice, its pod holding IDs it never got). ``answered``: each record was
    read from the kubelet's copy of our answer, its GPUs and directory the answer's; otherwise
    (PodResources, which has only the IDs) they come from the allocation taken over.
    """
    taken, refused = adopt_records(allocator, allocs, source=source, kubelet_holds=kubelet_holds, answered=answered)
    for alloc in refused:
        log.error(
            "%s: cannot take pod %s container %s: GPU(s) %s not on this node",
            source,
            alloc.pod_uid,
            alloc.container,
            list(alloc.minors),
        )
    return len(taken)


def adopt_records(
    allocator: Allocator,
    allocs: Sequence[ContainerAllocation],
    *,
    source: str,
    kubelet_holds: bool = False,
    answered: bool = True,
) -> tuple[list[ContainerAllocation], list[ContainerAllocation]]:
    """Occupy the tree with ``allocs`` (from ``source``), taking over unstarted records the kubelet holds when
    ``kubelet_holds``; returns (taken, refused: on a GPU this node lacks). Takes the allocator's lock itself."""
    taken: list[ContainerAllocation] = []
    refused: list[ContainerAllocation] = []
    dropped: list[tuple[str, str]] = []  # unstarted allocations taken over
    with allocator._changing():
        for alloc in allocs:
            if answered:
                alloc = renumber(allocator, alloc, source)
            if kubelet_holds and alloc.key not in allocator._allocs:
                alloc = taking_over(allocator, alloc, source, answered=answered, dropped=dropped)
            try:
                safenames.pod_uid(alloc.pod_uid)
                safenames.container_name(alloc.container)
            except safenames.UnsafeNameError as exc:
                log.error("%s: refusing pod %s container %s: %s", source, alloc.pod_uid, alloc.container, exc)
                continue
            if not alloc.minors or any(m not in allocator._by_minor for m in alloc.minors):
                refused.append(alloc)
                continue
            if alloc.key in allocator._allocs:
                continue
            allocator._occupy(alloc)
            allocator._insert(alloc)
            taken.append(alloc)
            allocator._unmarked |= not (alloc.init or alloc.mirror)
            if allocator._freed_guesses and alloc.device_ids:
                # Its IDs given out again (the kubelet freed them): no container starts with all of a
                # freed allocation's that shares one, as an Allocate of them shows (its put forgets them
                # on replay too).
                given = frozenset(alloc.device_ids)
                for gone in [w for w in allocator._freed_guesses if not given.isdisjoint(w)]:
                    del allocator._freed_guesses[gone]
        gpu_charges.warn_overcommit(allocator, source)
        if taken or dropped:
            taken_keys = {a.key for a in taken}
            allocator._save_or_report([_del(k) for k in dropped if k not in taken_keys] + [_put(a) for a in taken])
    if taken or dropped:
        allocator._notify()
    return taken, refused


def taking_over(
    allocator: Allocator, alloc: ContainerAllocation, source: str, *, answered: bool, dropped: list[tuple[str, str]]
) -> ContainerAllocation:
    """``alloc``, which the kubelet's records say holds its IDs, as it takes over the allocation made for
    another pod's container with those IDs and request that never started, or one freed before its
    container started (lock held; see :meth:`adopt`). The allocation taken over leaves the state (its
    key added to ``dropped``) or the remembered freed ones."""
    if not alloc.device_ids:
        return alloc
    wanted = frozenset(alloc.device_ids)
    holder = allocator._by_ids.get(wanted)
    if holder is not None:
        if holder[0] == alloc.pod_uid:
            return alloc
        group = [
            allocator._allocs[(holder[0], c)]
            for c in sorted(allocator._by_pod.get(holder[0], ()))
            if frozenset(allocator._allocs[(holder[0], c)].device_ids) == wanted
        ]
        matched = _same_request(group, alloc)
        if matched is None or matched.started:
            return alloc
        alloc = with_own_memory(allocator, alloc)
        allocator._free(allocator._remove(matched.key) or matched)
        dropped.append(matched.key)
        what = "holds, not started"
    else:
        freed = allocator._freed_guesses.get(wanted)
        matched = _same_request(freed or [], alloc)
        if freed is None or matched is None or matched.pod_uid == alloc.pod_uid:
            return alloc
        alloc = with_own_memory(allocator, alloc)
        if not answered and allocator._answering.get(matched.answered):
            return alloc  # its directory is another container's answer now
        freed.remove(matched)
        if not freed:
            del allocator._freed_guesses[wanted]
        what = "held, freed before it started"
    if not answered:
        alloc = replace(alloc, minors=matched.minors, answered_as=matched.answered, layout=matched.layout)
    log.info(
        "%s: pod %s container %s holds %s, which pod %s container %s %s (the match of their Allocate among "
        "identical pods): it takes over that allocation (GPUs %s, the directory of pod %s container %s)",
        source,
        *alloc.key,
        ids.describe(alloc.device_ids),
        *matched.key,
        what,
        list(alloc.minors),
        *alloc.answered,
    )
    return alloc


def with_own_memory(allocator: Allocator, alloc: ContainerAllocation) -> ContainerAllocation:
    """``alloc`` with the memory its pod asks for, when the pod cache shows it asking for as many cores
    (lock held): the kubelet's copy of our answer holds the memory of the container it was made for,
    another pod's after a guess (the pod not yet shown: :func:`prestart.own_budget` at its start)."""
    request = _request_of(allocator._pods.get(alloc.pod_uid), alloc.container)
    if request is None or request.cores != alloc.cores:
        return alloc
    return replace(alloc, memory=request.memory_bytes)
