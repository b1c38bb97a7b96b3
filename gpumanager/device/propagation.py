"""Where a GPU's health goes: the kubelet's device lists, the allocator, and a lost GPU coming back.

The health monitor tells of every change; this passes it on in the order the kubelet needs:
first the device lists (and every ListAndWatch stream is woken), then the allocator, whose
lock an Allocate may hold. A GPU that was lost at start and answers again is described by
NVML anew (its minor, UUID and memory were a guess until then) before the allocator takes it
back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, MutableSequence, Sequence
from typing import TYPE_CHECKING, Protocol

from gpumanager.device import nvml
from gpumanager.device.health import HealthListener, HealthState
from gpumanager.device.types import GPUInfo

if TYPE_CHECKING:
    from gpumanager.deviceplugin.devicelists import DeviceLists

log = logging.getLogger(__name__)


class HealthSource(Protocol):
    """What the propagation reads from the health monitor."""

    def add_listener(self, listener: HealthListener) -> None:
        """Call ``listener(index, state)`` on every change."""

    def snapshot(self) -> dict[int, HealthState]:
        """Every GPU's health now."""


class Notified(Protocol):
    """A ListAndWatch servicer: woken when its device list changed."""

    def notify(self) -> None:
        """Send the current list to the kubelet's stream."""


class HealthAware(Protocol):
    """What the propagation tells the allocation state."""

    def set_healthy(self, index: int, healthy: bool) -> None:
        """Take a GPU out of placement (or bring it back)."""

    def replace_gpu(self, info: GPUInfo) -> None:
        """Use a GPU as NVML describes it now."""


class HealthPropagation:
    """Passes the monitor's health changes to the device lists and to the allocator.

    ``gpus`` is the agent's list, updated in place when a lost GPU comes back described
    differently; ``lost`` are the GPUs lost at start. The device lists and the allocator are
    attached when they exist (the allocator after registration); until then their part of a
    change is skipped, and each is brought up to date from the monitor when attached.
    """

    def __init__(
        self,
        monitor: HealthSource,
        gpus: MutableSequence[GPUInfo],
        lost: Iterable[int],
        *,
        describe: Callable[[int], GPUInfo] = nvml.describe,
    ) -> None:
        self._monitor = monitor
        self._gpus = gpus
        self._lost = list(lost)
        self._describe = describe
        self._lists: DeviceLists | None = None
        self._servicers: Sequence[Notified] = ()
        self._allocator: HealthAware | None = None
        self._lock = threading.Lock()  # orders the allocator's health updates (and its attachment)
        self._lists_lock = threading.Lock()  # the same for the device lists (never waits for the allocator)

    def listen(self) -> None:
        """Hear the monitor's changes: the kubelet's lists first, then the allocator."""
        self._monitor.add_listener(self._to_device_lists)
        self._monitor.add_listener(self._to_allocator)

    def attach_device_lists(self, lists: DeviceLists, servicers: Sequence[Notified]) -> None:
        """From now on changes reach ``lists``; ``servicers`` (read at each change) are woken when it changed.

        Changes the monitor saw before (it watches from the start, the lists come later) are applied
        now from its snapshot, so a GPU that turned unhealthy meanwhile is not listed Healthy.
        """
        with self._lists_lock:
            self._servicers = servicers
            self._lists = lists
            changed = False
            for index, state in self._monitor.snapshot().items():
                changed = lists.set_healthy(index, state.healthy) or changed
            if changed:
                for servicer in servicers:
                    servicer.notify()

    def attach_allocator(self, allocator: HealthAware) -> None:
        """From now on changes reach ``allocator``; those before are applied now from the monitor's snapshot."""
        with self._lock:
            self._allocator = allocator
            for index, state in self._monitor.snapshot().items():
                allocator.set_healthy(index, state.healthy)

    def _to_device_lists(self, index: int, state: HealthState) -> None:
        """The kubelet's lists; each ListAndWatch stream is woken when they changed."""
        with self._lists_lock:
            if self._lists is not None and self._lists.set_healthy(index, state.healthy):
                for servicer in self._servicers:
                    servicer.notify()

    def _to_allocator(self, index: int, state: HealthState) -> None:
        """The allocator, once attached; a lost GPU that answers again is described first."""
        with self._lock:
            if self._allocator is not None:
                if state.healthy and index in self._lost:
                    self._describe_returned(self._allocator, index)
                self._allocator.set_healthy(index, state.healthy)

    def _describe_returned(self, allocator: HealthAware, index: int) -> None:
        """A GPU lost at start answers: until now it was described from the saved inventory or like its
        peers; from now on as it is (its minor, UUID and memory may differ from the guess)."""
        try:
            info = self._describe(index)
        except nvml.NVMLError as exc:
            log.warning(
                "GPU %d (%s) answers again but cannot be described (%s); it is served as counted at start",
                index,
                self._gpus[index].uuid,
                exc,
            )
            return
        self._lost = [i for i in self._lost if i != index]
        if info == self._gpus[index]:
            return
        log.warning("GPU %d is back: %s (it was counted as %s while lost)", index, info, self._gpus[index])
        self._gpus[index] = info
        allocator.replace_gpu(info)
