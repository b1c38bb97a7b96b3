"""PreStartContainer: checking the kubelet's view of who holds some device IDs against the allocator's records, the
room a container takes at its start, and the swaps of two identical requests the kubelet admitted in the other
order. pre_start, prepare_start and mark_started take the allocator's lock themselves; the others are called with it
held."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from gpumanager import names
from gpumanager.allocation import freed_unstarted, gpu_charges, ids
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.model import (
    AllocationError,
    _beyond,
    _mirror_of,
    _put,
    _put_text,
    _request_of,
    _runs_first,
    _Swap,
)
from gpumanager.allocation.records import ContainerAllocation

if TYPE_CHECKING:
    from gpumanager.allocation.allocator import Allocator

log = logging.getLogger(__name__)


def pre_start(allocator: Allocator, device_ids: Sequence[str], owner: tuple[str, str] | None) -> ContainerAllocation:
    """Check a PreStartContainer against our records and mark the container started (:func:`prepare_start`,
    then :func:`mark_started`); return the container's allocation."""
    return mark_started(allocator, prepare_start(allocator, device_ids, owner))


def prepare_start(
    allocator: Allocator, device_ids: Sequence[str], owner: tuple[str, str] | None
) -> ContainerAllocation:
    """Check a PreStartContainer against our records; return the container's allocation, not yet marked
    started (:func:`mark_started`, once the container's files are written).

    ``owner`` is the (pod UID, container) the kubelet says holds ``device_ids`` (None when it
    could not be asked). When our record of those IDs belongs to another container with the
    same request, the two are swapped: the kubelet's view wins.

    Answered only once what it changed in the records (a swap, a take-over, the gathering of a pod's
    records, the IDs of a record kept without them) is durable: the kubelet tells who holds the IDs once
    per start, and a restart reading the records as they were before would charge the GPUs the
    container runs on to another. When the change cannot be written the start is refused (UNAVAILABLE:
    the kubelet tries it again); the change is kept in memory (the kubelet's view) and marked unwritten:
    the next try writes the whole state before it is answered, also when it finds nothing left to change.
    """
    changed = False
    mark = -1
    try:
        with allocator._changing():
            mark = _watch(allocator)
            generation = allocator._generation
            staged, failures = len(allocator._unsettled), allocator.checkpoint_write_failures
            try:
                alloc = _checked(allocator, device_ids, owner)
            finally:
                changed = allocator._generation != generation
            tickets, problem = _this_calls(allocator, staged, failures)
            if not problem and _relies_on_unwritten(allocator, alloc):
                # An earlier start's change, refused unwritten, and nothing to change now: written first.
                try:
                    allocator._stage(None)
                except OSError:
                    raise _unwritten_start(allocator, alloc, device_ids, allocator._checkpoint_error) from None
        _durable(allocator, alloc, device_ids, tickets, problem, mark, None)
        return alloc
    finally:
        _unwatch(allocator, mark)
        if changed:
            allocator._notify()


def mark_started(allocator: Allocator, alloc: ContainerAllocation) -> ContainerAllocation:
    """Mark ``alloc`` (from :func:`prepare_start`) started, durably before it is answered; return the record.

    Called once the start's other checks passed and the container's files are written: a start refused
    before leaves the record not started (a later Allocate of its IDs is then a repeat, not IDs given on).
    Refused (UNAVAILABLE, the kubelet tries the start again) when the record changed meanwhile, when its
    GPUs have no room for it now (:func:`why_crowded`), or when the mark cannot be written (the record
    left not started, the change marked unwritten as in :func:`prepare_start`)."""
    if alloc.started:
        return alloc
    key = alloc.key
    changed = False
    mark = -1
    try:
        with allocator._changing():
            current = allocator._allocs.get(key)
            if current is not alloc:
                if current is not None and current.started and current.device_ids == alloc.device_ids:
                    return current  # another try of the same start marked it
                raise _changed_meanwhile(alloc)
            if allocator._overcommitted.intersection(alloc.minors):
                crowded = why_crowded(allocator, alloc)  # others may have started there since it was checked
                if crowded:
                    raise AllocationError(crowded, "unavailable")
            mark = _watch(allocator)
            staged, failures = len(allocator._unsettled), allocator.checkpoint_write_failures
            started = replace(alloc, started=True)
            allocator._remove(key)
            allocator._insert(started)
            changed = True
            allocator._save_or_report([_put(started)], _put_text(started))
            tickets, problem = _this_calls(allocator, staged, failures)
        _durable(allocator, started, started.device_ids, tickets, problem, mark, alloc)
        return started
    finally:
        _unwatch(allocator, mark)
        if changed:
            allocator._notify()


def _changed_meanwhile(alloc: ContainerAllocation) -> AllocationError:
    who = f"{alloc.namespace}/{alloc.pod_name} ({alloc.pod_uid})" if alloc.pod_name else alloc.pod_uid
    return AllocationError(
        f"PreStartContainer for pod {who} container {alloc.container} ({ids.describe(alloc.device_ids)}): its "
        "allocation changed (or was released) while its files were written, so the container does not start "
        "yet; the kubelet's next try of the start looks again",
        "unavailable",
    )


def _watch(allocator: Allocator) -> int:
    """Start noting the records changed from now on (lock held); returns where this call's notes begin."""
    allocator._watchers += 1
    return len(allocator._touched)


def _unwatch(allocator: Allocator, mark: int) -> None:
    """Stop the notes begun at ``mark`` (-1: none were); dropped once no call reads them."""
    if mark < 0:
        return
    with allocator._lock:
        allocator._watchers -= 1
        if not allocator._watchers:
            allocator._touched.clear()


def _changed_since(allocator: Allocator, mark: int) -> set[tuple[str, str]]:
    """The keys whose record is another than at ``mark`` (lock held): records are replaced, never changed
    in place, so a key put back to the record it held is not counted."""
    first: dict[tuple[str, str], ContainerAllocation | None] = {}
    for key, old in allocator._touched[mark:]:
        first.setdefault(key, old)
    now = allocator._allocs
    return {key for key, old in first.items() if old is not now.get(key)}


def _this_calls(allocator: Allocator, staged: int, failures: int) -> tuple[list[int], str]:
    """This call's journal records, taken to be made durable with the lock released (their failure
    answered, not only logged), and why staging them failed ('' when it did not) (lock held)."""
    tickets = allocator._unsettled[staged:]
    del allocator._unsettled[staged:]
    problem = allocator._checkpoint_error if allocator.checkpoint_write_failures != failures else ""
    return tickets, problem


def _durable(
    allocator: Allocator,
    alloc: ContainerAllocation,
    device_ids: Sequence[str],
    tickets: Sequence[int],
    problem: str,
    mark: int,
    unstarted: ContainerAllocation | None,
) -> None:
    """Return once ``tickets`` are durable (lock released); else refuse the start, the records changed
    since ``mark`` marked unwritten and ``alloc`` put back to ``unstarted`` (not None: the mark that it
    started is undone)."""
    written = not problem
    for ticket in tickets:
        try:
            allocator._sync(ticket)
        except OSError:
            written = False
    if written:
        return
    with allocator._lock:
        problem = allocator._checkpoint_error  # '' when the whole state was written since: it holds the change
        if not problem:
            return
        if unstarted is not None and allocator._allocs.get(alloc.key) is alloc:
            allocator._remove(alloc.key)  # the container does not start: not marked started
            allocator._insert(unstarted)
        # The records changed since (others' changes too, while the lock was released: marked all the
        # same, until the whole state is written).
        allocator._unwritten_starts.update(_changed_since(allocator, mark))
        allocator._unwritten_starts.add(alloc.key)
        raise _unwritten_start(allocator, alloc, device_ids, problem)


def _relies_on_unwritten(allocator: Allocator, alloc: ContainerAllocation) -> bool:
    """Whether ``alloc``, or a record holding the same IDs, was changed by a start refused because the
    change could not be written, not written since (lock held)."""
    if not allocator._unwritten_starts:
        return False
    if alloc.key in allocator._unwritten_starts:
        return True
    wanted = frozenset(alloc.device_ids)
    return any(
        (held := allocator._allocs.get(key)) is not None and frozenset(held.device_ids) == wanted
        for key in allocator._unwritten_starts
    )


def _unwritten_start(
    allocator: Allocator, alloc: ContainerAllocation, device_ids: Sequence[str], problem: str
) -> AllocationError:
    """The refusal of a start whose records could not be written (not "PreStartContainer check failed",
    which the kubelet takes as the pod's failure for good)."""
    who = f"{alloc.namespace}/{alloc.pod_name} ({alloc.pod_uid})" if alloc.pod_name else alloc.pod_uid
    return AllocationError(
        f"PreStartContainer for pod {who} container {alloc.container} ({ids.describe(device_ids)}): {problem}; "
        f"its allocation (GPUs {', '.join(str(m) for m in alloc.minors) or 'none'}) is not recorded durably, "
        "so the container does not start yet; the kubelet's next try of the start writes it",
        "unavailable",
    )


def _checked(allocator: Allocator, device_ids: Sequence[str], owner: tuple[str, str] | None) -> ContainerAllocation:
    """The work of :func:`prepare_start` (lock held): the container's allocation, not marked started."""
    wanted = frozenset(device_ids)
    key = allocator._by_ids.get(wanted)
    if owner is not None and key is not None and key != owner and same_name(allocator, key, owner):
        # The kubelet names pods, not UIDs: a pod recreated under the same name, the cache
        # still showing the old one. Our record of these IDs is the pod that got them.
        owner = key
    elif owner is not None and key is not None and key[1] == owner[1] and allocator._allocs[key].mirror == owner[0]:
        # The kubelet's checkpoint names a static pod by its own UID (the config hash), which
        # its mirror pod, the one we allocated to, carries as kubernetes.io/config.mirror.
        owner = key
    if owner is not None:
        if key is None and owner in allocator._allocs and not allocator._allocs[owner].device_ids:
            key = owner  # recorded without IDs (e.g. by an older gpu-manager)
        elif owner in allocator._allocs and frozenset(allocator._allocs[owner].device_ids) == wanted:
            key = owner  # containers of one pod holding the same IDs: the kubelet's pick
        elif key is not None and key[0] == owner[0] and freed_unstarted.freed_for(allocator, wanted, owner):
            # Another container of ``owner``'s pod holds the IDs (handed on), and the record
            # answered to ``owner`` was freed with the pod it was matched to: ``owner`` mounts
            # that answer's directory, not the other container's.
            key = owner
        elif key is not None and key != owner:
            swaps = planned_swaps(allocator, freed_unstarted.taken_over(allocator, key, owner, wanted))
            weigh(allocator, swaps)
            for swap in swaps:
                allocator._reassign(swap)
            # A record given to the other container is one the kubelet did not give ``owner``:
            # whose IDs they are is still a guess (unless a later swap of these took it on).
            given: set[tuple[str, str]] = set()
            for swap in swaps:
                given.discard(swap.taken.key)
                given.discard(swap.mine.key)
                if swap.given is not None:
                    given.add(swap.given.key)
            allocator._guessed.update(given)
            key = owner
    if key is None and owner is not None and freed_unstarted.take_freed_guess(allocator, wanted, owner):
        key = owner
    if key is None:
        whose = f"pod {owner[0]} container {owner[1]}" if owner else "a container the kubelet's records do not name"
        raise AllocationError(
            f"{names.PRESTART_FAILED}: no allocation for {ids.describe(device_ids)} "
            f"(tencent.com/vcuda-core) of {whose}",
            "not_found",
        )
    alloc = allocator._allocs[key]
    if alloc.cores != len(wanted):
        raise AllocationError(
            f"{names.PRESTART_FAILED}: pod {alloc.pod_uid} container {alloc.container} was allocated "
            f"{alloc.cores} cores but starts with {ids.describe(device_ids)} ({len(wanted)} "
            "tencent.com/vcuda-core)",
            "mismatch",
        )
    if not alloc.started and alloc.answered[0] != alloc.pod_uid:
        alloc = own_budget(allocator, alloc)
    if not alloc.started and allocator._overcommitted.intersection(alloc.minors):
        crowded = why_crowded(allocator, alloc)
        if crowded:
            raise AllocationError(crowded, "unavailable")
    if not alloc.device_ids:  # recorded without IDs (e.g. by an older gpu-manager): the kubelet's
        allocator._remove(key)
        alloc = replace(alloc, device_ids=ids.in_order(wanted))
        allocator._insert(alloc)
        allocator._save_or_report([_put(alloc)], _put_text(alloc))
    return alloc


def why_crowded(allocator: Allocator, alloc: ContainerAllocation) -> str:
    """Why ``alloc``'s container cannot start, or '' (lock held): on one of its GPUs, it and the
    containers started there (and the claims prepared there) hold more than the GPU has.

    That happens only after a guess among identical pods (the kubelet's Allocate names no pod, and
    it admits them in its own order): an allocation freed with the pod it was guessed for, its room
    then given to another container, taken over by the pod the kubelet gave its IDs to; or two
    allocations of one GPU each counted as another's; or, of two pods asking for as many cores and
    another memory size, the one whose start swapped the two (:meth:`_reassign`) left the other's
    budget on GPUs without room for it. Its answer named those GPUs, so the container can run on no
    other: its start waits (the kubelet tries it again) until room frees there."""
    for minor in alloc.minors:
        gpu = allocator._by_minor.get(minor)
        if gpu is None:
            continue
        charges = list(gpu_charges.pod_charges(allocator, alloc.pod_uid, minor, extra=alloc, started_only=True))
        running: list[str] = []
        for uid in sorted({a.pod_uid for a in allocator._allocs.values() if a.started and minor in a.minors}):
            held = gpu_charges.pod_charges(allocator, uid, minor, started_only=True) if uid != alloc.pod_uid else []
            if held:
                charges.extend(held)
                one = allocator._allocs[(uid, next(iter(allocator._by_pod[uid])))]
                running.append(f"{one.namespace}/{one.pod_name}" if one.pod_name else uid)
        for claim in allocator._claims.values():
            for dev in claim.devices:
                if dev.consumes and dev.minor == minor:
                    charges.append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
                    running.append(f"claim {claim.uid}")
        wholes = sum(1 for c, _ in charges if c >= names.HUNDRED_CORES)
        cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
        memory = sum(m for c, m in charges if c < names.HUNDRED_CORES) + wholes * gpu.memory_total
        if cores <= names.HUNDRED_CORES and memory <= gpu.memory_total:
            continue
        shown = ", ".join(running[:4]) + (f" and {len(running) - 4} more" if len(running) > 4 else "")
        who = f"{alloc.namespace}/{alloc.pod_name} ({alloc.pod_uid})" if alloc.pod_name else alloc.pod_uid
        asks = "a whole GPU" if alloc.cores >= names.HUNDRED_CORES else f"{alloc.cores} cores, {alloc.memory >> 20} MiB"
        return (
            f"pod {who} container {alloc.container} cannot start yet: its answer named GPU {gpu.index} "
            f"({gpu.uuid}), where the containers of {shown or 'no pod'} have started; with its {asks} they "
            f"would hold {cores} cores and {memory >> 20} MiB of the GPU's {names.HUNDRED_CORES} cores and "
            f"{gpu.memory_total >> 20} MiB (its IDs were matched to another pod asking for as many cores, "
            "which the kubelet admitted after it; the room there went to others); the kubelet's next try of the "
            "start succeeds once room frees there"
        )
    return ""


def own_budget(allocator: Allocator, alloc: ContainerAllocation) -> ContainerAllocation:
    """``alloc``, unstarted, answered for another pod's container (a guess, taken over), with the memory
    budget its own pod asks for when that is another for as many cores (lock held): after a restart its
    record came from the kubelet's copy of our answer, which holds the memory of the container the
    answer was made for. Refused (UNAVAILABLE, nothing changed) when its GPUs have no room for more."""
    request = _request_of(allocator._pods.get(alloc.pod_uid), alloc.container)
    if request is None or request.cores != alloc.cores or request.memory_bytes == alloc.memory:
        return alloc
    made = replace(alloc, memory=request.memory_bytes)
    if made.memory > alloc.memory:
        answered = replace(alloc, pod_uid=alloc.answered[0], container=alloc.answered[1], namespace="", pod_name="")
        short = short_of_room(allocator, made, answered, {alloc.key: made})
        if short:
            raise AllocationError(short, "unavailable")
    ids_ = frozenset(alloc.device_ids)
    asked = allocator._asked_at.get(ids_)
    guessed = alloc.key in allocator._guessed
    allocator._free(allocator._remove(alloc.key) or alloc)
    allocator._place(made)
    if asked is not None:
        allocator._asked_at[ids_] = asked
    if guessed:
        allocator._guessed.add(made.key)
    if allocator._overcommitted.intersection(made.minors):
        gpu_charges.recharge(allocator, made.minors)
    log.info(
        "pod %s container %s starts with the answer made for pod %s container %s: its own memory budget, "
        "%d MiB instead of %d MiB",
        *made.key,
        *alloc.answered,
        made.memory >> 20,
        alloc.memory >> 20,
    )
    return made


def short_of_room(
    allocator: Allocator,
    taken: ContainerAllocation,
    was: ContainerAllocation,
    replaced: Mapping[tuple[str, str], ContainerAllocation | None],
) -> str:
    """Why ``taken``, with a larger memory budget than ``was``, the allocation of the same IDs it takes
    over, would leave one of its GPUs charged beyond what it has once the records of ``replaced``'s keys
    are its values (None: none), counting every other allocation (started or not) and prepared claim
    there; '' when it fits (lock held)."""
    for minor in sorted(set(taken.minors)):
        charges = charges_replacing(allocator, minor, replaced)
        gpu = allocator._by_minor.get(minor)
        if gpu is None or not _beyond(charges, gpu.memory_total):
            continue
        wholes = sum(1 for c, _ in charges if c >= names.HUNDRED_CORES)
        cores = sum(min(c, names.HUNDRED_CORES) for c, _ in charges)
        memory = sum(m for c, m in charges if c < names.HUNDRED_CORES) + wholes * gpu.memory_total
        left = max(0, gpu.memory_total - (memory - taken.memory))
        who = f"{taken.namespace}/{taken.pod_name} ({taken.pod_uid})" if taken.pod_name else taken.pod_uid
        other = f"{was.namespace}/{was.pod_name} ({was.pod_uid})" if was.pod_name else was.pod_uid
        return (
            f"pod {who} container {taken.container} cannot start yet: the kubelet gave it "
            f"{ids.describe(taken.device_ids)} ({names.VCORE_RESOURCE}), matched to pod {other} container "
            f"{was.container}, which asks for as many cores and {was.memory >> 20} MiB; their answer named GPU "
            f"{gpu.index} ({gpu.uuid}), where its {taken.memory >> 20} MiB do not fit: {left >> 20} MiB are left "
            f"beside the other allocations there (with it they would hold {cores} cores and {memory >> 20} MiB "
            f"of the GPU's {names.HUNDRED_CORES} cores and {gpu.memory_total >> 20} MiB); the kubelet's next "
            "try of the start succeeds once room frees there (deleting the pod has it placed again)"
        )
    return ""


def charges_replacing(
    allocator: Allocator, minor: int, replaced: Mapping[tuple[str, str], ContainerAllocation | None]
) -> list[tuple[int, int]]:
    """The charges GPU ``minor`` would hold (:func:`gpu_charges.charges_of`) were the records of ``replaced``'s keys
    its values (None: none) (lock held)."""
    uids = {a.pod_uid for a in allocator._allocs.values() if minor in a.minors} | {k[0] for k in replaced}
    out: list[tuple[int, int]] = []
    for uid in sorted(uids):
        members = [allocator._allocs[(uid, c)] for c in allocator._by_pod.get(uid, ()) if (uid, c) not in replaced]
        members += [a for k, a in replaced.items() if a is not None and k[0] == uid]
        out.extend(gpu_charges.pod_charges(allocator, uid, minor, of=members))
    for claim in allocator._claims.values():
        for dev in claim.devices:
            if dev.consumes and dev.minor == minor:
                out.append((names.HUNDRED_CORES if dev.whole else dev.cores, dev.memory))
    return out


def same_name(allocator: Allocator, key: tuple[str, str], owner: tuple[str, str]) -> bool:
    """Whether ``owner`` is the same container name of a pod of the same namespace and name as our
    record ``key``, under another UID (lock held)."""
    mine = allocator._allocs.get(key)
    pod = allocator._pods.get(owner[0])
    if mine is None or pod is None or key[1] != owner[1] or key[0] == owner[0]:
        return False
    return (mine.namespace, mine.pod_name) == podinfo.namespace_name(pod)


def planned_swaps(allocator: Allocator, pairs: Sequence[tuple[tuple[str, str], tuple[str, str]]]) -> list[_Swap]:
    """The swaps (:func:`swap_of`) that move the record of each pair's first key to its second, made one
    after the other (lock held; nothing changes): a record moved by an earlier swap is taken from where
    that swap left it, and a key an earlier swap emptied or filled holds what that swap left there.
    Pairs whose keys are all apart make the swaps each would alone."""
    state: dict[tuple[str, str], ContainerAllocation | None] = {}
    where = {key: key for key, _ in pairs}  # where each pair's record lies after the swaps so far
    swaps: list[_Swap] = []
    for key, target in pairs:
        now = where[key]
        if now == target:
            continue
        swap = swap_of(allocator, now, target, state)
        state[now], state[target] = swap.given, swap.taken
        for other, at in where.items():
            if at == target:
                where[other] = now  # the record that was there went where this one was
        where[key] = target
        swaps.append(swap)
    return swaps


def swap_of(
    allocator: Allocator,
    key: tuple[str, str],
    owner: tuple[str, str],
    state: Mapping[tuple[str, str], ContainerAllocation | None] | None = None,
) -> _Swap:
    """The records a swap of our record ``key`` with the kubelet's holder ``owner`` of its IDs makes
    (lock held; nothing changes), the records of ``state``'s keys being its values (None: none) after
    earlier swaps; AllocationError when the kubelet's view cannot be taken."""
    planned = state or {}
    mine = planned[key] if key in planned else allocator._allocs[key]
    theirs = planned[owner] if owner in planned else allocator._allocs.get(owner)
    assert mine is not None, key  # only a key holding a record is swapped
    if theirs is not None and theirs.started and theirs.device_ids and theirs.device_ids != mine.device_ids:
        raise AllocationError(
            f"{names.PRESTART_FAILED}: the kubelet's records name pod {owner[0]} container {owner[1]} as holding "
            f"{ids.describe(mine.device_ids)}, allocated to pod {key[0]} container {key[1]}, but that container "
            f"has started with {ids.describe(theirs.device_ids)}",
            "mismatch",
        )
    pod = allocator._pods.get(owner[0])
    request = _request_of(pod, owner[1])  # read once: the check and the record below
    if theirs is None:
        if pod is None:
            raise AllocationError(
                f"{names.PRESTART_FAILED}: {ids.describe(mine.device_ids)} allocated to pod {key[0]} container "
                f"{key[1]} are used by pod {owner[0]} container {owner[1]}, which this node's pod cache does not "
                "know",
                "mismatch",
            )
        if request is None or request.cores != mine.cores:
            raise AllocationError(
                f"{names.PRESTART_FAILED}: {ids.describe(mine.device_ids)} allocated to pod {key[0]} container "
                f"{key[1]} are used by pod {owner[0]} container {owner[1]}, whose request differs",
                "mismatch",
            )
        budget = request.memory_bytes
    elif theirs.cores != mine.cores:
        raise AllocationError(
            f"{names.PRESTART_FAILED}: pod {owner[0]} container {owner[1]} starts with "
            f"{ids.describe(mine.device_ids)} allocated to pod {key[0]} container {key[1]}, and their requests "
            "differ",
            "mismatch",
        )
    else:
        budget = theirs.memory
    # The same cores, perhaps another memory size: the vcuda-core Allocate carries only core IDs, so a
    # pod admitted before another of its size in cores is matched to the one first in line. Each takes
    # the other's allocation (its GPUs, its answer's directory) with its own memory budget.
    meta = (pod or {}).get("metadata") or {}
    taken = replace(
        mine,
        pod_uid=owner[0],
        container=owner[1],
        namespace=str(meta.get("namespace", "")),
        pod_name=str(meta.get("name", "")),
        container_index=request.index if request else -1,
        answered_as=mine.answered,
        init=pod is not None and request is not None and _runs_first(pod, request),
        mirror=_mirror_of(pod) if pod is not None else "",
        memory=budget,
    )
    given = None
    if theirs is not None:
        # Its start waits, when its budget does not fit there, for room among the containers started on
        # those GPUs (:func:`why_crowded`): its answer named them, the kubelet gave it those IDs.
        given = replace(
            theirs,
            pod_uid=key[0],
            container=key[1],
            namespace=mine.namespace,
            pod_name=mine.pod_name,
            container_index=mine.container_index,
            answered_as=theirs.answered,
            init=mine.init,
            mirror=mine.mirror,
            memory=mine.memory,
        )
    return _Swap(mine, theirs, taken, given)


def weigh(allocator: Allocator, swaps: Sequence[_Swap]) -> None:
    """Refuse (UNAVAILABLE; nothing changes, the kubelet's next try of the start looks again) swaps
    that would leave a container taking over an allocation with a larger memory budget on GPUs without
    room for it, all of them made (lock held)."""
    replaced: dict[tuple[str, str], ContainerAllocation | None] = {}
    for swap in swaps:
        replaced[swap.mine.key] = swap.given
        replaced[swap.taken.key] = swap.taken
    for swap in swaps:
        if swap.taken.memory > swap.mine.memory:
            short = short_of_room(allocator, swap.taken, swap.mine, replaced)
            if short:
                raise AllocationError(short, "unavailable")
