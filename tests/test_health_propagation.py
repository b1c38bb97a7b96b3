"""A GPU's health reaching the device lists, the ListAndWatch streams and the allocator; a lost GPU back."""

from __future__ import annotations

import pynvml

from gpumanager import names
from gpumanager.device import nvml
from gpumanager.device.health import HealthListener, HealthState
from gpumanager.device.propagation import HealthPropagation
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devicelists import DeviceLists
from gpumanager.deviceplugin.devices import DeviceLayout

GIB = 1 << 30


def gpu(index: int, minor: int, memory_gib: int = 16, uuid: str = "") -> GPUInfo:
    return GPUInfo(index, uuid or f"GPU-{index}", "Tesla T4", minor, memory_gib * GIB, f"0000:0{index}:00.0")


class Monitor:
    """The health monitor's side the propagation uses; ``change`` plays one change to every listener."""

    def __init__(self, states: dict[int, HealthState]) -> None:
        self.states = states
        self.listeners: list[HealthListener] = []

    def add_listener(self, listener: HealthListener) -> None:
        self.listeners.append(listener)

    def snapshot(self) -> dict[int, HealthState]:
        return dict(self.states)

    def change(self, index: int, healthy: bool) -> None:
        self.states[index] = HealthState(healthy, "" if healthy else "XID 79")
        for listener in self.listeners:
            listener(index, self.states[index])


class Recorder:
    """Records, in one list, what the allocator and the servicers are told."""

    def __init__(self, events: list[tuple[str, object]], name: str) -> None:
        self.events, self.name = events, name

    def notify(self) -> None:
        self.events.append((self.name, "notify"))

    def set_healthy(self, index: int, healthy: bool) -> None:
        self.events.append(("allocator", (index, healthy)))

    def replace_gpu(self, info: GPUInfo) -> None:
        self.events.append(("allocator", info))


def unhealthy_ids(lists: DeviceLists) -> list[str]:
    return [d.ID for d in lists.devices(names.VCORE_RESOURCE) if d.health != "Healthy"]


def setup(
    gpus: list[GPUInfo], lost: list[int], describe: dict[int, GPUInfo | None]
) -> tuple[Monitor, HealthPropagation, DeviceLists, list[tuple[str, object]], list[int]]:
    monitor = Monitor({g.index: HealthState(g.index not in lost) for g in gpus})
    asked: list[int] = []

    def nvml_describe(index: int) -> GPUInfo:
        asked.append(index)
        info = describe.get(index)
        if info is None:
            raise nvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return info

    propagation = HealthPropagation(monitor, gpus, lost, describe=nvml_describe)
    propagation.listen()
    lists = DeviceLists(DeviceLayout(gpus), gpus, unhealthy=lost)
    events: list[tuple[str, object]] = []
    propagation.attach_device_lists(lists, [Recorder(events, "core"), Recorder(events, "memory")])
    return monitor, propagation, lists, events, asked


def test_a_change_reaches_the_lists_and_both_streams_before_the_allocator() -> None:
    monitor, propagation, lists, events, asked = setup([gpu(0, 0), gpu(1, 1)], [], {})
    propagation.attach_allocator(Recorder(events, "allocator"))
    events.clear()

    monitor.change(1, False)
    assert events == [("core", "notify"), ("memory", "notify"), ("allocator", (1, False))]
    assert unhealthy_ids(lists) == list(DeviceLayout([gpu(0, 0), gpu(1, 1)]).ids_of_gpu(names.VCORE_RESOURCE, 1))
    events.clear()
    monitor.change(1, False)  # the lists do not change: no stream is woken
    assert events == [("allocator", (1, False))]
    assert asked == [], "a GPU not lost at start is never described again"


def test_a_gpu_lost_at_start_comes_back_as_nvml_describes_it() -> None:
    guessed = gpu(1, 2, memory_gib=32, uuid="GPU-lost-1")
    real = gpu(1, 5, memory_gib=16, uuid="GPU-real")
    gpus = [gpu(0, 0), guessed]
    monitor, propagation, lists, events, asked = setup(gpus, [1], {1: real})
    propagation.attach_allocator(Recorder(events, "allocator"))
    assert unhealthy_ids(lists)
    events.clear()

    monitor.change(1, True)
    assert asked == [1]
    assert gpus[1] == real, "the agent's list of GPUs holds the GPU as it is now"
    assert events == [("core", "notify"), ("memory", "notify"), ("allocator", real), ("allocator", (1, True))]
    assert unhealthy_ids(lists) == []

    monitor.change(1, False)
    monitor.change(1, True)
    assert asked == [1], "once back, the GPU is described only once"


def test_a_returned_gpu_that_cannot_be_described_is_asked_again_next_time() -> None:
    guessed = gpu(1, 1, uuid="GPU-lost-1")
    gpus = [gpu(0, 0), guessed]
    describe: dict[int, GPUInfo | None] = {1: None}
    monitor, propagation, _lists, events, asked = setup(gpus, [1], describe)
    propagation.attach_allocator(Recorder(events, "allocator"))
    events.clear()

    monitor.change(1, True)
    assert asked == [1] and gpus[1] == guessed
    assert ("allocator", (1, True)) in events and not any(isinstance(e, GPUInfo) for _, e in events)

    describe[1] = guessed  # answers now, exactly as it was guessed: nothing to replace
    monitor.change(1, False)
    monitor.change(1, True)
    assert asked == [1, 1] and gpus[1] == guessed
    assert not any(isinstance(e, GPUInfo) for _, e in events)


def test_changes_before_the_allocator_exists_reach_it_when_attached() -> None:
    monitor, propagation, _lists, events, _asked = setup([gpu(0, 0), gpu(1, 1)], [], {})
    monitor.change(0, False)
    assert events == [("core", "notify"), ("memory", "notify")]
    events.clear()

    propagation.attach_allocator(Recorder(events, "allocator"))
    assert events == [("allocator", (0, False)), ("allocator", (1, True))]


def test_changes_before_the_device_lists_exist_reach_them_when_attached() -> None:
    """A GPU that turns unhealthy while the agent starts (before the lists exist) is listed Unhealthy,
    and one lost at start that answers again by then is listed Healthy."""
    gpus = [gpu(0, 0), gpu(1, 1), gpu(2, 2)]
    monitor = Monitor({0: HealthState(True), 1: HealthState(True), 2: HealthState(False)})
    propagation = HealthPropagation(monitor, gpus, [2], describe=lambda i: gpus[i])
    propagation.listen()
    monitor.change(1, False)
    monitor.change(2, True)
    lists = DeviceLists(DeviceLayout(gpus), gpus, unhealthy=[2])
    events: list[tuple[str, object]] = []
    propagation.attach_device_lists(lists, [Recorder(events, "core")])
    assert unhealthy_ids(lists) == list(DeviceLayout(gpus).ids_of_gpu(names.VCORE_RESOURCE, 1))
    assert events == [("core", "notify")]
    monitor.change(1, True)
    assert unhealthy_ids(lists) == []
