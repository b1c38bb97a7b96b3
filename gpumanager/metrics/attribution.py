"""Which container each GPU process belongs to, from the containers' cgroups, read as little as possible.

Reading a container's cgroup costs a directory walk and a file read (tens of microseconds
each; with hundreds of containers, reading all of them is tens of milliseconds of a
scrape). A reading is kept and a cgroup is read again only where a placement could be
wrong:

- a container that is new, or runs under another container ID (restarted), is read;
- a PID that appears on a GPU (it was not there at the last sample) is confirmed by
  reading the container it was last placed in; a PID that no reading places is looked for
  in the containers holding that GPU (a process only sees its container's GPUs), not in
  every container;
- while a PID stays on a GPU, its placement (or the finding that no container of the GPU
  has it) is trusted for at most ``rescan_period``, which bounds how long a PID reused by
  another process could be misattributed. A container's first reading is trusted for a
  share of it between a half and the whole (fixed per container), so that containers first
  read together (all of them, when the agent starts) fall due over several scrapes rather
  than all in one; every later reading for the whole period.

A container without a process on a GPU is not read again: its PIDs do not matter until one
of them appears on a GPU, and then that one is confirmed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gpumanager.vmanager import cgroups

Key = tuple[str, str]  # (pod UID, container)
Container = tuple[str, str | None]  # (container ID, QoS class)


@dataclass(frozen=True)
class _Reading:
    container: Container
    pids: frozenset[int]
    at: float  # when it was read
    until: float  # trusted until then


def _share(text: str) -> float:
    """A fraction in [0.5, 1) fixed for ``text``: how much of the rescan period a reading is trusted."""
    return 0.5 + (zlib.crc32(text.encode()) % 1024) / 2048


class ProcessOwners:
    """The container of each GPU process, brought up to date by :meth:`update` once per sample."""

    def __init__(
        self,
        locator: cgroups.CgroupLocator,
        *,
        rescan_period: float,
        clock: Callable[[], float],
        read: Callable[[Key, Container], list[int]] | None = None,
    ) -> None:
        """``read``: a container's PIDs (its cgroup's; the locator's reading of the container ID by default)."""
        self._locator = locator
        self._read_pids = read or (lambda key, c: locator.pids(key[0], c[0], c[1]))
        self._period = rescan_period
        self._clock = clock
        self._readings: dict[Key, _Reading] = {}
        self._owner: dict[int, Key] = {}  # pid -> container, from the readings
        self._visible: dict[int, frozenset[int]] = {}  # GPU index -> its PIDs at the last update
        self._strangers: dict[int, dict[int, float]] = {}  # GPU index -> PIDs no container of it has, until when
        self._containers: Mapping[Key, Container] = {}  # those of the last update
        self._settled_until = 0.0  # nothing to read before then while containers and PIDs stay the same
        #: Updates that read some container's cgroup, and cgroups read in all (for tests and benchmarks).
        self.scans = 0
        self.reads = 0

    def owner(self, pid: int) -> Key | None:
        """The container ``pid`` was placed in, or None."""
        return self._owner.get(pid)

    def update(
        self,
        containers: Mapping[Key, Container],
        holders: Mapping[int, Iterable[Key]],
        visible: Mapping[int, Iterable[int]],
    ) -> None:
        """Bring the placements up to date: ``containers`` are the running containers, ``holders`` the
        containers holding each GPU, ``visible`` the PIDs NVML shows on each GPU now."""
        now = self._clock()
        shown = {index: frozenset(pids) for index, pids in visible.items()}
        if containers is self._containers and shown == self._visible and now < self._settled_until:
            return
        self._containers = containers
        done: set[Key] = set()  # read in this update
        gone = [key for key in self._readings if key not in containers]
        for key in gone:
            del self._readings[key]
        if gone:
            self._place()
        wanted = {key for key, c in containers.items() if (r := self._readings.get(key)) is None or r.container != c}
        for index, pids in shown.items():
            before = self._visible.get(index, frozenset())
            for pid in pids:
                owner = self._owner.get(pid)
                if owner is None or owner in wanted:
                    continue
                reading = self._readings.get(owner)
                if reading is None or pid not in before or now >= reading.until:
                    wanted.add(owner)  # a placement to confirm
        self._read(wanted, containers, now, done)
        # PIDs no reading places: look in the containers holding their GPU, unless known to be in none.
        for index, pids in shown.items():
            before = self._visible.get(index, frozenset())
            strangers = self._strangers.get(index, {})
            for pid in pids:
                if pid in self._owner:
                    continue
                until = strangers.get(pid)
                if until is None or pid not in before or now >= until:
                    self._read({k for k in holders.get(index, ()) if k in containers}, containers, now, done)
                    break
        for index, pids in shown.items():
            before = self._visible.get(index, frozenset())
            old = self._strangers.get(index, {})
            searched = all(k in done for k in holders.get(index, ()) if k in containers)  # all of them read now
            self._strangers[index] = {
                pid: now + self._period if searched or pid not in before or pid not in old else old[pid]
                for pid in pids
                if pid not in self._owner
            }
        for index in [i for i in self._strangers if i not in shown]:
            del self._strangers[index]
        self._visible = shown
        self._settled_until = min(
            [self._readings[self._owner[pid]].until for pids in shown.values() for pid in pids if pid in self._owner]
            + [until for strangers in self._strangers.values() for until in strangers.values()],
            default=float("inf"),
        )
        if done:
            self.scans += 1

    def _read(self, keys: set[Key], containers: Mapping[Key, Container], now: float, done: set[Key]) -> None:
        """Read the cgroups of ``keys`` not read in this update yet, and place the PIDs again."""
        todo = keys - done
        if not todo:
            return
        for key in todo:
            container = containers[key]
            pids = self._read_pids(key, container)
            first = key not in self._readings
            until = now + self._period * (_share("/".join(key)) if first else 1.0)
            self._readings[key] = _Reading(container, frozenset(pids), now, until)
            self.reads += 1
        done |= todo
        self._place()

    def _place(self) -> None:
        """Each PID's container from the readings (the newest reading wins a PID two of them have)."""
        owner: dict[int, Key] = {}
        for key, reading in sorted(self._readings.items(), key=lambda item: item[1].at):
            for pid in reading.pids:
                owner[pid] = key
        self._owner = owner
