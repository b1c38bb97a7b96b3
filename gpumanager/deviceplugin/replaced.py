"""Containers started again from an answer that named a GPU since replaced (while the agent was down).

The kubelet saves each Allocate answer (``NVIDIA_VISIBLE_DEVICES`` with the GPU's UUID, the device node
``/dev/nvidia<minor>``, the ``/etc/vcuda`` mount) and starts the container from it again at every restart,
a node's reboot included, without asking for another; only PreStartContainer is called. When the GPU
behind a device node the answer named is another one now, the container can only reach what that node
is today:

- the GPU now at the same place (the replacement, numbered with the same minor): it runs there, with
  the budget of its vcuda.config, when that fits the new GPU beside the containers started there since
  (so a smaller GPU is never over-committed); otherwise its start waits (UNAVAILABLE: the kubelet tries
  again, and room frees as pods there end), at most the wait limit (--replaced-gpu-wait) from its first
  refused start, after which it is refused for good, as it is at once when its share alone cannot fit;
- another GPU (the driver numbered the GPUs otherwise) or no GPU at all: refused for good, naming the
  pod, the container, the old and the new GPU and the device nodes; the pod is to be placed again.

Only allocations held when the agent started are looked at: an answer given since names the GPUs as
they are. A container whose record was dropped at the start (it named a device node this node no longer
has) and rebuilt since from PodResources with the same device IDs still starts from its saved answer, and
is refused the same. Nothing is looked at on a node whose GPUs kept their device nodes (the common case).

The saved inventory names the new GPUs from the first start that saw them, so what that start found is
kept beside the checkpoint (:data:`FILE`: the GPUs as they were, the containers answered with them,
which of those started again since, and when the starts waiting for room were first refused) until none
of those containers is held: an agent restarted again before they all started goes on checking them, the
ones already running on the replacement counted there, and a wait for room goes on from its first refusal.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from gpumanager import flagspec, names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device import inventory
from gpumanager.device.types import GPUInfo
from gpumanager.fileio import atomic_write, read_regular

log = logging.getLogger(__name__)

#: Beside the checkpoint: what a start found changed, until its containers are all gone.
FILE = "gpumanager_replaced_gpus"
_LIMIT = 16 << 20

_MIB = 1 << 20

#: How long a start may wait for room on a replacement, from its first refused start (--replaced-gpu-wait),
#: before it is refused for good: the kubelet tries a start that failed again with a backoff growing to
#: 5 minutes, so a pod whose room never frees would otherwise stay in ContainerCreating for ever.
WAIT_SECONDS = 300.0


class ReplacedRefusal(Exception):
    """A start refused; ``lasting`` when no wait can mend it (the pod is to be placed again)."""

    def __init__(self, message: str, *, lasting: bool) -> None:
        super().__init__(message)
        self.lasting = lasting


@dataclass(frozen=True)
class _Crowding:
    """A start without room on a replacement: ``gpu`` (the new GPU at ``place``), what the container needs
    there and what is free beside ``others`` (the pods counted there), and what the two would make."""

    place: int
    was_uuid: str
    gpu: GPUInfo
    need_cores: int
    need_memory: int
    free_cores: int
    free_memory: int
    total_cores: int
    total_memory: int
    others: str


@dataclass(frozen=True)
class _Change:
    """A device node whose GPU is another one than the saved inventory says: ``was`` the GPU it was,
    ``now`` the GPU it reaches today (None: no GPU), ``at_place`` the GPU now at ``was``'s place."""

    was: GPUInfo
    now: GPUInfo | None
    at_place: GPUInfo | None


def _who(alloc: ContainerAllocation) -> str:
    pod = f"{alloc.namespace}/{alloc.pod_name}" if alloc.pod_name else alloc.pod_uid
    return f"pod {pod} container {alloc.container}"


def _pod(alloc: ContainerAllocation) -> str:
    return f"{alloc.namespace}/{alloc.pod_name}" if alloc.pod_name else alloc.pod_uid


class ReplacedGPUs:
    """What a start of a container allocated before a GPU's replacement may reach (see the module)."""

    def __init__(
        self,
        was: Mapping[int, GPUInfo],
        gpus: Sequence[GPUInfo],
        lost: Iterable[int],
        allocations: Callable[[], Sequence[ContainerAllocation]],
        pod_name: Callable[[str], tuple[str, str] | None] = lambda uid: None,
        state_path: Path | None = None,
        renumbered: Mapping[tuple[str, str], tuple[int, ...]] | None = None,
        *,
        wait_limit: float = WAIT_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``was``: the saved inventory (place -> GPU); ``gpus`` and ``lost``: the GPUs now (lost ones are
        described as saved, so their device nodes are not counted as reaching them); ``allocations``: every
        allocation held now (for the room on a replacement); ``pod_name``: a pod's (namespace, name) by
        its UID, when known (a saved answer names only the UID); ``state_path``: :data:`FILE` (what an
        earlier start found), or None to keep nothing; ``renumbered``: the minors the records moved to their
        GPUs' minors of now named (those of their saved answers; see :func:`renumbered`), by (pod UID,
        container); ``wait_limit``: seconds a start may wait for room on a replacement, from its first refused
        start, before it is refused for good (:data:`WAIT_SECONDS`); ``clock``: the time they are counted in (the
        wall clock: the first refusal's time is kept in ``state_path`` for the next start)."""
        self._path = state_path
        self._wait_limit = wait_limit
        self._clock = clock
        # Starts refused for want of room on a replacement: when the first one was, by (pod UID, container);
        # kept in the file, so that an agent restart does not start the wait again.
        pending, self._pending_keys, started, self._answered_then, self._waiting = _load(state_path)
        self._then = dict(renumbered or {})
        lost_places = self._lost = set(lost)
        now_by_minor = {g.minor: g for g in gpus if g.index not in lost_places}
        by_place = {g.index: g for g in gpus if g.index not in lost_places}

        def change(old: GPUInfo) -> _Change | None:
            now = now_by_minor.get(old.minor)
            if now is not None and now.uuid == old.uuid:
                return None
            if now is None and old.index in lost_places:
                return None  # a GPU lost at start: reported as such, its device IDs Unhealthy
            return _Change(old, now, by_place.get(old.index))

        # Device nodes found changed at this start, by the minor the saved inventory gave them (any holder of
        # them was answered before).
        self._changes: dict[int, _Change] = {
            old.minor: found for old in was.values() if (found := change(old)) is not None
        }
        # What the device nodes an earlier start found changed reach now (None: their GPU again, or a lost
        # GPU), for the containers it named alone (answered with the minors of then: a GPU no longer found
        # may have been found again since, the driver numbering the GPUs as before).
        self._pending_changes: dict[int, _Change | None] = {old.minor: change(old) for old in pending.values()}
        self._allocations = allocations
        self._pod_name = pod_name
        self._lock = threading.Lock()
        # Allocations held at start that name a changed device node, by (pod UID, container), with the
        # minors of their saved answer; and the minors their record held at start (those of now).
        self._affected: dict[tuple[str, str], ContainerAllocation] = {}
        self._held_minors: dict[tuple[str, str], tuple[int, ...]] = {}
        # Answers the kubelet saved that name a changed device node but that no allocation holds.
        self._unheld: dict[tuple[str, str], ContainerAllocation] = {}
        self._started: set[tuple[str, str]] = set(started)  # of those, started again on their replacement
        # Of those, starts let through by check and not yet noted or dropped (by key: how many in flight),
        # counted on their replacement meanwhile, so that two starts at once cannot both take its last room.
        self._starting: dict[tuple[str, str], int] = {}
        self._logged: set[tuple[tuple[str, str], str]] = set()

    @property
    def active(self) -> bool:
        """Whether some device node reaches another GPU than before the agent's start."""
        return bool(self._changes) or any(c is not None for c in self._pending_changes.values())

    def _changes_of(self, alloc: ContainerAllocation) -> list[_Change]:
        """The changes of the device nodes ``alloc`` (a saved answer's minors) names: for a container an
        earlier start named, what that start found where it found it; else what this start found."""
        out = []
        for m in alloc.minors:
            if alloc.key in self._pending_keys and m in self._pending_changes:
                found = self._pending_changes[m]
            else:
                found = self._changes.get(m)
            if found is not None:
                out.append(found)
        return out

    def note_held(self, allocations: Iterable[ContainerAllocation]) -> frozenset[tuple[str, str]]:
        """Remember the allocations held at start that name a changed device node, each logged with what
        its next start will do; return their (pod UID, container) keys."""
        if not self.active:
            with self._lock:
                self._save()  # nothing left of an earlier start's findings
            return frozenset()
        for held in allocations:
            alloc = self._as_answered(held)
            changes = self._changes_of(alloc)
            if not changes:
                continue
            self._affected[alloc.key] = alloc
            self._held_minors[alloc.key] = held.minors
            problem = self._lasting_problem(alloc, changes)
            if problem:
                log.error("%s", problem)
            else:
                log.warning("%s", self._runs_there(alloc, changes, "at its next start it runs on the new GPU"))
        self._started &= self._affected.keys()
        self._waiting = {k: t for k, t in self._waiting.items() if k in self._affected}
        with self._lock:
            self._save()
        return frozenset(self._affected)

    def note_answered(self, answers: Iterable[ContainerAllocation]) -> int:
        """Remember the kubelet's saved answers (its checkpoint, read at start) that name a changed device
        node and that no allocation holds (their record named a device node this node no longer has), so
        that their containers' starts are refused with the reason; each logged. Return how many."""
        count = 0
        for answer in answers:
            changes = [] if answer.key in self._affected else self._changes_of(answer)
            if not changes:
                continue  # held, or naming no device node changed for it
            problem = self._lasting_problem(answer, changes)
            if problem:
                self._unheld[answer.key] = answer
                log.error("%s", problem)
                count += 1
        return count

    def check(self, alloc: ContainerAllocation) -> bool:
        """Raise :class:`ReplacedRefusal` when ``alloc``'s container, starting from its saved answer, would
        reach another GPU than the one at its place, or one without room for it. Return whether it starts
        on a replacement: its room there is then reserved (counted for the other starts) until the start is
        noted (:meth:`note_started`, once it succeeded) or dropped (:meth:`forget`, when it failed after)."""
        if not self.active:
            return False
        held = self._affected.get(alloc.key)
        if held is None:
            saved = self._unheld.get(alloc.key)
            if saved is not None and set(saved.device_ids) == set(alloc.device_ids):
                # Its record was dropped at the start and rebuilt since from PodResources (the same device
                # IDs, placed on the GPU now at their place): the kubelet still starts it from the saved
                # answer, whose device node reaches no GPU or another one.
                problem = self.explain_missing(*alloc.key)
                if problem:
                    self._log_once(alloc, "lasting", logging.ERROR, problem)
                    raise ReplacedRefusal(problem, lasting=True)
            return False
        if self._held_minors.get(alloc.key) != alloc.minors:
            return False  # answered since the start: it names the GPUs as they are
        changes = self._changes_of(held)
        problem = self._lasting_problem(alloc, changes)
        if problem:
            self._log_once(alloc, "lasting", logging.ERROR, problem)
            raise ReplacedRefusal(problem, lasting=True)
        crowded: _Crowding | None = None
        waited = 0.0
        with self._lock:  # the look at the room and its reservation, one start at a time
            for change in changes:
                crowded = self._crowded(alloc, change)
                if crowded is not None:
                    now = self._clock()
                    first = self._waiting.get(alloc.key)
                    if first is None:
                        first = self._waiting[alloc.key] = now
                        self._save()  # the wait goes on from here after an agent restart
                    waited = max(0.0, now - first)
                    break
            else:
                if self._waiting.pop(alloc.key, None) is not None:
                    self._save()
                self._starting[alloc.key] = self._starting.get(alloc.key, 0) + 1
        if crowded is None:
            return True
        if waited >= self._wait_limit:
            problem = self._waited_too_long(alloc, crowded, waited)
            self._log_once(alloc, "waited", logging.ERROR, problem)
            raise ReplacedRefusal(problem, lasting=True)
        message = self._crowded_message(alloc, crowded)
        self._log_once(alloc, "crowded", logging.WARNING, message)
        raise ReplacedRefusal(message, lasting=False)

    def note_started(self, alloc: ContainerAllocation) -> None:
        """``alloc``'s start, let through by :meth:`check`, succeeded: it counts on the replacement from now
        on, kept for the agent's next start."""
        with self._lock:
            if not self._unreserve(alloc.key):
                return
            if alloc.key not in self._started:
                self._started.add(alloc.key)
                self._save()
        held = self._affected.get(alloc.key, alloc)
        changes = self._changes_of(held)
        self._log_once(alloc, "started", logging.WARNING, self._runs_there(alloc, changes, "starts again"))

    def forget(self, alloc: ContainerAllocation) -> None:
        """``alloc``'s start, let through by :meth:`check`, failed after (its files, its record's mark):
        the room reserved for it on the replacement is free again."""
        with self._lock:
            self._unreserve(alloc.key)

    def _unreserve(self, key: tuple[str, str]) -> bool:
        """Drop one reservation of ``key`` (lock held); whether there was one."""
        count = self._starting.get(key, 0)
        if count <= 0:
            return False
        if count == 1:
            del self._starting[key]
        else:
            self._starting[key] = count - 1
        return True

    def explain_missing(self, pod_uid: str, container: str) -> str:
        """Why the container of a start with no allocation cannot start, when its allocation at the
        agent's start named a device node that no longer reaches its GPU ('' otherwise)."""
        held = self._affected.get((pod_uid, container)) or self._unheld.get((pod_uid, container))
        if held is None:
            return ""
        if not held.pod_name:
            named = self._pod_name(pod_uid)
            if named is not None:
                held = replace(held, namespace=named[0], pod_name=named[1])
        changes = self._changes_of(held)
        return self._lasting_problem(held, changes) or ""

    def _save(self) -> None:
        """Keep what this start found for the next one (lock held); errors logged (it only helps a later
        start), the file removed once no container answered before the change is held."""
        if self._path is None:
            return
        try:
            if not self._affected:
                self._path.unlink(missing_ok=True)
                return
            was = {c.was.minor: c.was for a in self._affected.values() for c in self._changes_of(a)}
            doc = {
                "gpus": [asdict(g) for _, g in sorted(was.items())],
                "containers": sorted([list(k) for k in self._affected]),
                "started": sorted([list(k) for k in self._started]),
                # The device nodes each one's saved answer names (its record follows its GPU's minor).
                "answered": sorted([[*k, list(a.minors)] for k, a in self._affected.items()]),
                # When each start still waiting for room on a replacement was first refused (wall clock, s).
                "waiting": sorted([[*k, t] for k, t in self._waiting.items() if k in self._affected]),
            }
            atomic_write(self._path, json.dumps(doc, sort_keys=True).encode(), durable=True)
        except OSError as exc:
            log.warning("cannot write %s: %s", self._path, exc)

    # -- what each case says -----------------------------------------------------------------------

    def _lasting_problem(self, alloc: ContainerAllocation, changes: Sequence[_Change]) -> str:
        """Why no wait lets the container start, or ''."""
        for change in changes:
            was, now, there = change.was, change.now, change.at_place
            head = f"{_who(alloc)} was answered with GPU {was.index} ({was.uuid}, {was.device_path}), " + (
                "which the driver numbered otherwise since (a GPU no longer found at boot, or found again, "
                "moves the GPUs after it)"
                if (there is not None and there.uuid == was.uuid) or was.index in self._lost
                else "replaced while the agent was down"
            )
            if there is not None and there.uuid == was.uuid:
                place = f"GPU {was.index} is at {there.device_path} now"
            elif there is not None:
                place = f"GPU {was.index} is {there.uuid} at {there.device_path} now"
            elif was.index in self._lost:
                place = f"GPU {was.index} is no longer counted by NVML (lost)"
            else:
                place = f"NVML counts no GPU at GPU {was.index}'s place now"
            tail = (
                "; the kubelet starts the container again from its saved answer (NVIDIA_VISIBLE_DEVICES="
                f"{was.uuid}, {was.device_path}) and never asks for another: delete the pod to place it again"
            )
            if now is None:
                return f"{head}: {place}, and {was.device_path} is no GPU{tail}"
            if there is None or now.index != was.index:
                return (
                    f"{head}: {place}, and {was.device_path} is GPU {now.index} ({now.uuid}), which the "
                    f"container's allocation is not counted on{tail}"
                )
            if alloc.shared and alloc.memory > now.memory_total:
                return (
                    f"{head}: GPU {was.index} is {now.uuid} at {now.device_path} now, with "
                    f"{now.memory_total // _MIB} MiB, less than the container's {alloc.memory // _MIB} MiB{tail}"
                )
        return ""

    def _runs_there(self, alloc: ContainerAllocation, changes: Sequence[_Change], what: str) -> str:
        parts = []
        for change in changes:
            assert change.now is not None
            parts.append(
                f"GPU {change.was.index} was {change.was.uuid} and is {change.now.uuid} now (replaced while the "
                f"agent was down), at {change.now.device_path} as before"
            )
        budget = "a whole GPU" if not alloc.shared else f"{alloc.cores} cores and {alloc.memory // _MIB} MiB"
        return (
            f"{_who(alloc)} {what}: {'; '.join(parts)}; its saved answer's device node reaches the new GPU, "
            f"its vcuda.config keeps its budget ({budget}); its NVIDIA_VISIBLE_DEVICES still names the old "
            "UUID, which only the NVIDIA container runtime reads (delete the pod if that refuses it)"
        )

    def _crowded(self, alloc: ContainerAllocation, change: _Change) -> _Crowding | None:
        """Why ``alloc`` cannot start on ``change``'s replacement yet, or None (lock held): with the containers
        counted there (started again since the agent's start or starting now, or answered since), it would
        hold more than the new GPU has."""
        gpu = change.now
        assert gpu is not None
        by_pod: dict[str, list[ContainerAllocation]] = {}
        for other in self._allocations():
            if change.was.minor not in other.minors or other.key == alloc.key:
                continue
            if other.key in self._affected and other.key not in self._started and other.key not in self._starting:
                continue  # not started again since the replacement (nor starting): it runs nowhere
            by_pod.setdefault(other.pod_uid, []).append(other)
        used = [_pod_charge(held, gpu) for held in by_pod.values()]  # without this container
        by_pod.setdefault(alloc.pod_uid, []).append(alloc)
        cores = memory = 0
        for held in by_pod.values():
            pod_cores, pod_memory = _pod_charge(held, gpu)
            cores += pod_cores
            memory += pod_memory
        if cores <= names.HUNDRED_CORES and memory <= gpu.memory_total:
            return None
        others = sorted({_pod(a) for uid, held in by_pod.items() if uid != alloc.pod_uid for a in held})
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        need_cores, need_memory = _pod_charge([alloc], gpu)
        return _Crowding(
            place=change.was.index,
            was_uuid=change.was.uuid,
            gpu=gpu,
            need_cores=need_cores,
            need_memory=need_memory,
            free_cores=max(0, names.HUNDRED_CORES - sum(c for c, _ in used)),
            free_memory=max(0, gpu.memory_total - sum(m for _, m in used)),
            total_cores=cores,
            total_memory=memory,
            others=shown or "no pod",
        )

    def _crowded_message(self, alloc: ContainerAllocation, crowded: _Crowding) -> str:
        gpu = crowded.gpu
        return (
            f"{_who(alloc)} cannot start yet: GPU {crowded.place} was {crowded.was_uuid} and is {gpu.uuid} now "
            f"(replaced while the agent was down), with {gpu.memory_total // _MIB} MiB; with the containers of "
            f"{crowded.others} started there, its {alloc.cores} cores and {alloc.memory // _MIB} MiB would make "
            f"{crowded.total_cores} cores and {crowded.total_memory // _MIB} MiB; the kubelet's next try of the "
            f"start succeeds once room frees there, within {flagspec.format_duration(self._wait_limit)} of its "
            "first refused start (--replaced-gpu-wait; or delete the pod to place it again)"
        )

    def _waited_too_long(self, alloc: ContainerAllocation, crowded: _Crowding, waited: float) -> str:
        gpu = crowded.gpu
        return (
            f"{_who(alloc)} waited {_waited(waited)} for room on GPU {crowded.place} ({gpu.uuid}, "
            f"{gpu.memory_total // _MIB} MiB, at {gpu.device_path}; it was {crowded.was_uuid}, replaced while the "
            f"agent was down), longer than --replaced-gpu-wait={flagspec.format_duration(self._wait_limit)}: it "
            f"needs {crowded.need_cores} cores and {crowded.need_memory // _MIB} MiB there, and with the "
            f"containers of {crowded.others} started there {crowded.free_cores} cores and "
            f"{crowded.free_memory // _MIB} MiB free; not waiting longer: delete the pod to place it again"
        )

    def _as_answered(self, alloc: ContainerAllocation) -> ContainerAllocation:
        """``alloc`` (a record held at start) with the minors of its saved answer: those an earlier start
        kept (:data:`FILE`), else those its record named before it was moved to its GPUs' minors of now."""
        minors = self._answered_then.get(alloc.key) or self._then.get(alloc.key) or alloc.minors
        return alloc if minors == alloc.minors else replace(alloc, minors=minors)

    def _log_once(self, alloc: ContainerAllocation, what: str, level: int, message: str) -> None:
        key = (alloc.key, what)
        with self._lock:
            if key in self._logged:
                return
            self._logged.add(key)
        log.log(level, "%s", message)


def _waited(seconds: float) -> str:
    """``seconds`` as Go spells a duration, to the second (5m0s, 1m10s, 31s; 0s under a second)."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _pod_charge(held: Sequence[ContainerAllocation], gpu: GPUInfo) -> tuple[int, int]:
    """(cores, memory) one pod's containers hold on ``gpu``: its init containers run one at a time before
    the others, so the pod holds the most of any init container and of its other containers together."""

    def charge(a: ContainerAllocation) -> tuple[int, int]:
        if not a.shared:
            return names.HUNDRED_CORES, gpu.memory_total
        return a.cores, a.memory

    apps = [charge(a) for a in held if not a.init]
    inits = [charge(a) for a in held if a.init]
    app_cores, app_memory = sum(c for c, _ in apps), sum(m for _, m in apps)
    return (
        max([app_cores, *(c for c, _ in inits)]),
        max([app_memory, *(m for _, m in inits)]),
    )


def _load(
    path: Path | None,
) -> tuple[
    dict[int, GPUInfo],
    set[tuple[str, str]],
    set[tuple[str, str]],
    dict[tuple[str, str], tuple[int, ...]],
    dict[tuple[str, str], float],
]:
    """What an earlier start found (:data:`FILE`): its old GPUs by minor, the containers answered with
    them, those started again since, the minors of their saved answers (when kept) and when the starts
    waiting for room were first refused (when kept); empty when missing or unreadable (logged, naming the
    file). A damaged ``waiting`` field alone is dropped (logged): those waits start again."""
    if path is None:
        return {}, set(), set(), {}, {}
    try:
        data = json.loads(read_regular(path, _LIMIT))
        gpus = {g.minor: g for g in map(inventory.gpu_entry, data["gpus"])}

        def keys(name: str) -> set[tuple[str, str]]:
            out = set()
            for item in data[name]:
                if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                    raise ValueError(f"{name} entry {item!r:.80} is not a [pod UID, container] pair")
                out.add((item[0], item[1]))
            return out

        answered: dict[tuple[str, str], tuple[int, ...]] = {}
        for item in data.get("answered", []):
            if not (
                isinstance(item, list)
                and len(item) == 3
                and all(isinstance(x, str) for x in item[:2])
                and isinstance(item[2], list)
                and all(type(m) is int and m >= 0 for m in item[2])
            ):
                raise ValueError(f"answered entry {item!r:.80} is not a [pod UID, container, [minors]] triple")
            answered[(item[0], item[1])] = tuple(item[2])
        return gpus, keys("containers"), keys("started"), answered, _load_waiting(path, data.get("waiting", []))
    except FileNotFoundError:
        return {}, set(), set(), {}, {}
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}, set(), set(), {}, {}


def _load_waiting(path: Path, items: object) -> dict[tuple[str, str], float]:
    """The ``waiting`` field of :data:`FILE`: (pod UID, container) -> its first refusal's time; empty
    (logged, naming the file and the entry) when it is damaged."""
    waiting: dict[tuple[str, str], float] = {}
    if not isinstance(items, list):
        log.warning("ignoring the waiting field of %s: %r is not a list; those waits start again", path, items)
        return {}
    for item in items:
        if not (
            isinstance(item, list)
            and len(item) == 3
            and all(isinstance(x, str) for x in item[:2])
            and type(item[2]) in (int, float)
            and math.isfinite(item[2])
        ):
            log.warning(
                "ignoring the waiting field of %s: entry %.80r is not a [pod UID, container, time] triple; those "
                "waits start again",
                path,
                item,
            )
            return {}
        waiting[(item[0], item[1])] = float(item[2])
    return waiting


def renumbered(was: Mapping[int, GPUInfo], gpus: Sequence[GPUInfo]) -> dict[int, int]:
    """The minor of each GPU of ``was`` (the saved inventory, by place) -> its minor now, where they differ:
    the driver numbered the GPUs otherwise (one no longer found moves those after it one lower; a lost GPU
    is counted with a minor no GPU has). Only a GPU that is the same one (by UUID; a lost one is described
    as saved): a record answered with its old minor is its own, as the kubelet's device IDs (which name the
    GPU's place) say. A GPU replaced since is left to the start check (see the module)."""
    now = {g.index: g for g in gpus}
    return {
        old.minor: gpu.minor
        for place, old in was.items()
        if (gpu := now.get(place)) is not None and gpu.uuid == old.uuid and gpu.minor != old.minor
    }
