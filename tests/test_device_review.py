"""GPU health under hostile NVML answers: lost GPUs in the event wait, events from devices the agent
cannot match by handle, XID storms, log lines that name the GPU, and the device lists' health."""

from __future__ import annotations

import ctypes
import itertools
import json
import logging
import threading
import time
from collections import deque
from typing import Any

import pynvml
import pytest

from gpumanager import names
from gpumanager.device import health as health_mod
from gpumanager.device.health import HealthMonitor, HealthState
from gpumanager.device.types import GPUInfo

GIB = 1 << 30


def _gpus(count: int) -> list[GPUInfo]:
    return [
        GPUInfo(
            index=i,
            uuid=f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd",
            name="Tesla T4",
            minor=i,
            memory_total=16 * GIB,
            pci_bus_id=f"00000000:{0x18 + i:02x}:00.0",
            numa_node=0,
        )
        for i in range(count)
    ]


def _pointer(address: int) -> Any:
    return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)


class FakeNVML:
    """NVML as the health monitor sees it, with every answer under the test's control."""

    def __init__(self, gpus: list[GPUInfo]) -> None:
        self.gpus = gpus
        self.handles = [_pointer(0x10000 + 0x100 * g.index) for g in gpus]
        self.lost: set[int] = set()
        self.no_handle: dict[int, int] = {}  # GPU -> NVML error code of nvmlDeviceGetHandleByIndex
        self.register_error: dict[int, int] = {}
        self.queue: deque[tuple[str, Any, int]] = deque()  # ("event", handle, xid) / ("error", None, code)
        self.empty_wait_error = pynvml.NVML_ERROR_TIMEOUT
        self.memory_calls: dict[int, int] = {g.index: 0 for g in gpus}
        self.wait_calls = 0
        self.block_on_timeout = 0.0
        self.mig: dict[int, int] = {}  # GPU -> current MIG mode; GPUs not here answer NOT_SUPPORTED
        self.remapped: dict[int, tuple[int, int, int, int]] = {}  # GPU -> (corr, unc, pending, failure)
        self.pages_pending: dict[int, int] = {}
        self.lock = threading.Lock()

    def index_of(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        for i, h in enumerate(self.handles):
            if ctypes.cast(h, ctypes.c_void_p).value == address:
                return i
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        m = monkeypatch
        m.setattr(pynvml, "nvmlDeviceGetHandleByIndex", self.get_handle)
        m.setattr(pynvml, "nvmlEventSetCreate", lambda: object())
        m.setattr(pynvml, "nvmlEventSetFree", lambda s: None)
        m.setattr(pynvml, "nvmlDeviceRegisterEvents", self.register)
        m.setattr(pynvml, "nvmlEventSetWait_v2", self.wait)
        m.setattr(pynvml, "nvmlDeviceGetMemoryInfo", self.memory)
        m.setattr(pynvml, "nvmlDeviceGetUUID", self.uuid)
        m.setattr(pynvml, "nvmlDeviceGetIndex", self.index)
        m.setattr(pynvml, "nvmlDeviceGetMigMode", self.mig_mode)
        m.setattr(pynvml, "nvmlDeviceGetRemappedRows", self.remapped_rows)
        m.setattr(pynvml, "nvmlDeviceGetRetiredPagesPendingStatus", self.retired_pending)

    def remapped_rows(self, handle: Any) -> tuple[int, int, int, int]:
        index = self.index_of(handle)
        if index not in self.remapped:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.remapped[index]

    def retired_pending(self, handle: Any) -> int:
        index = self.index_of(handle)
        if index not in self.pages_pending:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self.pages_pending[index]

    def mig_mode(self, handle: Any) -> list[int]:
        index = self.index_of(handle)
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if index not in self.mig:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [self.mig[index], self.mig[index]]

    def get_handle(self, index: int) -> Any:
        if index in self.no_handle:
            raise pynvml.NVMLError(self.no_handle[index])
        return self.handles[index]

    def register(self, handle: Any, mask: int, event_set: Any) -> None:
        index = self.index_of(handle)
        if index in self.register_error:
            raise pynvml.NVMLError(self.register_error[index])
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def wait(self, event_set: Any, timeout_ms: int) -> Any:
        with self.lock:
            self.wait_calls += 1
            item = self.queue.popleft() if self.queue else None
        if item is None:
            if self.block_on_timeout:
                threading.Event().wait(self.block_on_timeout)
            raise pynvml.NVMLError(self.empty_wait_error)
        kind, handle, value = item
        if kind == "error":
            raise pynvml.NVMLError(value)
        data = pynvml.c_nvmlEventData_t()
        data.device = handle
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = value
        data.gpuInstanceId = 0xFFFFFFFF
        data.computeInstanceId = 0xFFFFFFFF
        return data

    def memory(self, handle: Any) -> Any:
        index = self.index_of(handle)
        with self.lock:
            self.memory_calls[index] += 1
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return object()

    def uuid(self, handle: Any) -> str:
        index = self.index_of(handle)
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.gpus[index].uuid

    def index(self, handle: Any) -> int:
        index = self.index_of(handle)
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return index

    def xid(self, gpu: int, xid: int) -> None:
        with self.lock:
            self.queue.append(("event", self.handles[gpu], xid))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML(_gpus(4))
    fake.install(monkeypatch)
    return fake


def _monitor(nvml: FakeNVML, clock: Clock, **kwargs: Any) -> HealthMonitor:
    kwargs.setdefault("ignored_xids", names.DEFAULT_IGNORED_XIDS)
    kwargs.setdefault("quiet_period", 300.0)
    kwargs.setdefault("probe_period", 0.2)
    return HealthMonitor(nvml.gpus, clock=clock, **kwargs)


def _prepare(monitor: HealthMonitor) -> None:
    """What start() does before its thread runs: every GPU's handle, then the event set."""
    for g in monitor._gpus:
        monitor._take_handle(g.index)
    monitor._ensure_events()


def _steps(monitor: HealthMonitor, count: int) -> None:
    next_probe = 0.0
    for _ in range(count):
        monitor._ensure_events()  # as the thread does before each step
        next_probe = monitor._step(next_probe)


# -- a lost GPU in the event wait ----------------------------------------------------------------


def test_lost_gpu_answered_by_the_event_wait_is_probed_once_not_at_every_wait(nvml: FakeNVML) -> None:
    """While a registered GPU is lost, NVML's event wait answers GPU_IS_LOST at once, every time. The GPU
    is found by one probe right away; the others are then probed every --health-probe-period, not at
    every wait (which made NVML queries of every GPU about twenty times a second for as long as the GPU
    stayed lost)."""
    clock = Clock()  # the clock does not move: no probe period ever passes
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    nvml.lost.add(2)
    nvml.empty_wait_error = pynvml.NVML_ERROR_GPU_IS_LOST
    _steps(monitor, 6)
    assert not monitor.state(2).healthy
    assert monitor.state(2).reason == "lost"
    # the first step's probe, and one at once when the wait first answered GPU_IS_LOST
    assert nvml.memory_calls[0] <= 2, nvml.memory_calls
    assert monitor.state(0).healthy


def test_second_gpu_lost_while_the_first_is_still_lost_is_found_by_the_periodic_probe(nvml: FakeNVML) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock, probe_period=1.0)
    _prepare(monitor)
    nvml.lost.add(1)
    nvml.empty_wait_error = pynvml.NVML_ERROR_GPU_IS_LOST
    next_probe = 0.0
    for _ in range(2):
        next_probe = monitor._step(next_probe)
    assert not monitor.state(1).healthy
    nvml.lost.add(3)
    clock.now += 1.5
    monitor._step(next_probe)
    assert not monitor.state(3).healthy


# -- events the monitor cannot match to a handle ------------------------------------------------


def test_event_from_a_handle_not_seen_before_takes_out_only_its_gpu(nvml: FakeNVML) -> None:
    """An event's device handle that is not the pointer the monitor holds (another handle of the same
    GPU) is identified through NVML (UUID, index): only that GPU goes, not the whole node."""
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    other = _pointer(0x90000)
    original = nvml.index_of

    def index_of(handle: Any) -> int:
        if ctypes.cast(handle, ctypes.c_void_p).value == 0x90000:
            return 1
        return original(handle)

    nvml.index_of = index_of  # type: ignore[method-assign]
    nvml.queue.append(("event", other, 79))
    _steps(monitor, 1)
    states = monitor.snapshot()
    assert not states[1].healthy
    assert states[1].reason == "XID 79"
    assert [i for i, s in states.items() if not s.healthy] == [1]


def test_event_from_a_device_nvml_cannot_name_takes_out_every_gpu_and_says_why(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    """A critical XID whose device cannot be identified at all is not dropped: every GPU goes (as NVIDIA's
    plugin does), and the log says the XID and that its GPU is unknown."""
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    nvml.queue.append(("event", _pointer(0x90000), 79))
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        _steps(monitor, 1)
    assert all(not s.healthy for s in monitor.snapshot().values())
    assert any("79" in r.getMessage() and "unknown" in r.getMessage().lower() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


# -- log lines name the GPU by index and UUID -----------------------------------------------------


def test_gpu_without_a_handle_is_logged_with_its_uuid_and_the_error(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    nvml.no_handle[3] = pynvml.NVML_ERROR_UNKNOWN
    monitor = _monitor(nvml, clock)
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        _prepare(monitor)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("GPU 3" in line and nvml.gpus[3].uuid in line and "Unknown Error" in line for line in lines), lines


def test_ignored_xid_log_names_the_gpu_uuid(nvml: FakeNVML, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    nvml.xid(2, 13)
    with caplog.at_level(logging.INFO, logger=health_mod.__name__):
        _steps(monitor, 1)
    lines = [r.getMessage() for r in caplog.records if "XID 13" in r.getMessage()]
    assert lines and all("GPU 2" in line and nvml.gpus[2].uuid in line for line in lines), lines
    assert monitor.state(2).healthy


def test_failed_event_registration_is_logged_with_the_gpu_uuid(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    nvml.register_error[1] = pynvml.NVML_ERROR_UNKNOWN
    nvml.register_error[2] = pynvml.NVML_ERROR_NOT_SUPPORTED
    monitor = _monitor(nvml, clock)
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        _prepare(monitor)
    lines = [r.getMessage() for r in caplog.records]
    assert any(nvml.gpus[1].uuid in line and "Unknown Error" in line for line in lines), lines
    assert any(nvml.gpus[2].uuid in line and "Not Supported" in line for line in lines), lines
    # registration failed on two GPUs only: the others' XIDs are watched and acted on
    nvml.xid(3, 79)
    _steps(monitor, 1)
    assert not monitor.state(3).healthy
    assert monitor.state(0).healthy


# -- XID policy and storms ------------------------------------------------------------------------


@pytest.mark.parametrize("xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_never_take_a_gpu_out(nvml: FakeNVML, xid: int) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    for _ in range(50):
        nvml.xid(0, xid)
    _steps(monitor, 51)
    assert all(s.healthy for s in monitor.snapshot().values())
    assert monitor.ignored_xid_events == 50


@pytest.mark.parametrize("xid", [48, 63, 74, 79, 92, 94, 95, 119])
def test_critical_xids_take_only_their_gpu_out(nvml: FakeNVML, xid: int) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    nvml.xid(2, xid)
    _steps(monitor, 1)
    assert [i for i, s in monitor.snapshot().items() if not s.healthy] == [2]
    assert monitor.state(2).reason == f"XID {xid}"


def test_xid_storm_logs_a_bounded_number_of_lines_and_notifies_once(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock)
    changes: list[tuple[int, HealthState]] = []
    monitor.add_listener(lambda i, s: changes.append((i, s)))
    _prepare(monitor)
    for n in range(3000):
        nvml.xid(0, 13)
        nvml.xid(1, 79)
        nvml.xid(2, 31 if n % 2 else 43)
    with caplog.at_level(logging.DEBUG, logger=health_mod.__name__):
        _steps(monitor, 9001)
    assert len(caplog.records) < 20, [r.getMessage() for r in caplog.records][:30]
    assert [i for i, s in changes] == [1]
    assert monitor.xid_events == 9000


def test_gpu_comes_back_after_the_quiet_period_and_not_before(nvml: FakeNVML) -> None:
    clock = Clock()
    monitor = _monitor(nvml, clock, quiet_period=300.0, probe_period=1.0)
    changes: list[tuple[int, bool]] = []
    monitor.add_listener(lambda i, s: changes.append((i, s.healthy)))
    _prepare(monitor)
    nvml.xid(1, 79)
    next_probe = monitor._step(0.0)
    clock.now += 200
    nvml.xid(1, 48)  # a second error restarts the quiet period
    next_probe = monitor._step(next_probe)
    clock.now += 150
    next_probe = monitor._step(next_probe)
    assert not monitor.state(1).healthy
    clock.now += 151
    monitor._step(next_probe)
    assert monitor.state(1).healthy
    assert changes == [(1, False), (1, True)]


def test_gpu_in_mig_mode_is_out_of_service_until_mig_is_disabled(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU in MIG mode runs CUDA only in its MIG instances: a share of the whole GPU cannot be used or
    enforced there. It is served Unhealthy (the log names it and says why) and comes back once MIG mode
    is off for the quiet period."""
    clock = Clock()
    nvml.mig = {1: pynvml.NVML_DEVICE_MIG_DISABLE, 2: pynvml.NVML_DEVICE_MIG_ENABLE}
    monitor = _monitor(nvml, clock, quiet_period=60.0, probe_period=1.0)
    _prepare(monitor)
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        next_probe = monitor._step(0.0)
    assert [i for i, s in monitor.snapshot().items() if not s.healthy] == [2]
    assert "MIG" in monitor.state(2).reason
    assert any("GPU 2" in r.getMessage() and "MIG" in r.getMessage() for r in caplog.records)
    assert monitor.nvml_problem() == ""
    nvml.mig[2] = pynvml.NVML_DEVICE_MIG_DISABLE
    clock.now += 30
    next_probe = monitor._step(next_probe)
    assert not monitor.state(2).healthy
    clock.now += 31
    monitor._step(next_probe)
    assert monitor.state(2).healthy


def test_gpu_lost_at_start_that_comes_back_is_named_by_its_real_uuid(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU lost at start and never seen whole is counted under a made-up UUID; once it answers, the log
    lines about it name the UUID NVML gives."""
    import dataclasses

    clock = Clock()
    counted = list(nvml.gpus)
    counted[2] = dataclasses.replace(counted[2], uuid="GPU-lost-2")
    nvml.lost.add(2)
    monitor = HealthMonitor(counted, ignored_xids=(), quiet_period=10.0, probe_period=1.0, lost=[2], clock=clock)
    _prepare(monitor)
    next_probe = monitor._step(0.0)
    nvml.lost.clear()
    clock.now += 11
    next_probe = monitor._step(next_probe)
    assert monitor.state(2).healthy
    nvml.xid(2, 79)
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        monitor._step(next_probe)
    lines = [r.getMessage() for r in caplog.records if "XID 79" in r.getMessage()]
    assert lines and nvml.gpus[2].uuid in lines[0], lines


def test_a_new_cause_on_an_unhealthy_gpu_is_logged_once(nvml: FakeNVML, caplog: pytest.LogCaptureFixture) -> None:
    """A GPU already out for one error that meets another (XID 48, then XID 79: fallen off the bus) says so
    once per cause; a storm of the same cause adds nothing."""
    clock = Clock()
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    nvml.xid(1, 48)
    for _ in range(200):
        nvml.xid(1, 79)
    nvml.xid(1, 48)
    with caplog.at_level(logging.INFO, logger=health_mod.__name__):
        _steps(monitor, 202)
    lines = [r.getMessage() for r in caplog.records if "GPU 1" in r.getMessage()]
    assert len(lines) == 2, lines
    assert "XID 48" in lines[0] and "XID 79" in lines[1] and nvml.gpus[1].uuid in lines[1], lines
    assert monitor.state(1).reason == "XID 48"


@pytest.mark.parametrize("pending", ["rows", "pages", "failure"])
def test_gpu_waiting_for_a_reset_is_not_offered_again_after_the_quiet_period(
    nvml: FakeNVML, caplog: pytest.LogCaptureFixture, pending: str
) -> None:
    """An uncorrectable ECC error (XID 48, 94, 95) leaves rows to remap or pages to retire at the next GPU
    reset; until then the memory is bad although the GPU answers and sends no more XIDs. The GPU stays out
    of service past the quiet period (the log says why, once) and is back once NVML shows no reset pending."""
    clock = Clock()
    if pending == "rows":
        nvml.remapped[1] = (0, 1, 1, 0)
    elif pending == "failure":
        nvml.remapped[1] = (0, 1, 0, 1)
    else:
        nvml.pages_pending[1] = pynvml.NVML_FEATURE_ENABLED
    monitor = _monitor(nvml, clock, quiet_period=60.0, probe_period=1.0)
    _prepare(monitor)
    nvml.xid(1, 48)
    next_probe = monitor._step(0.0)
    assert not monitor.state(1).healthy
    with caplog.at_level(logging.WARNING, logger=health_mod.__name__):
        for _ in range(5):
            clock.now += 61
            next_probe = monitor._step(next_probe)
    assert not monitor.state(1).healthy
    lines = [r.getMessage() for r in caplog.records if "GPU 1" in r.getMessage() and "XID" not in r.getMessage()]
    assert len(lines) == 1 and nvml.gpus[1].uuid in lines[0], lines
    assert ("service" if pending == "failure" else "reset") in lines[0], lines
    nvml.remapped.pop(1, None)
    nvml.pages_pending[1] = pynvml.NVML_FEATURE_DISABLED
    clock.now += 1.5
    with caplog.at_level(logging.INFO, logger=health_mod.__name__):
        monitor._step(next_probe)
    assert monitor.state(1).healthy
    back = [r.getMessage() for r in caplog.records if "healthy again" in r.getMessage()]
    assert back and "after 306 s" in back[0], back  # the time it really was out without errors
    assert monitor.state(0).healthy


def test_gpu_in_mig_mode_is_unhealthy_when_start_returns(nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device lists are made right after the monitor starts: a GPU that cannot be used (MIG mode, or
    failing NVML queries) is known to be out by then, not at the thread's first probe."""
    release = threading.Event()
    nvml.mig = {2: pynvml.NVML_DEVICE_MIG_ENABLE}
    nvml.no_handle = {}
    nvml.lost.add(3)  # a handle, but its queries fail
    monitor = _monitor(nvml, Clock())
    first_step = monitor._step

    def step(next_probe: float) -> float:  # the thread's first probe waits until the states are read
        release.wait(30)
        return first_step(next_probe)

    monkeypatch.setattr(monitor, "_step", step)
    monitor.start()
    try:
        states = monitor.snapshot()
        assert not states[2].healthy and states[2].reason == health_mod.MIG_ENABLED
        assert not states[3].healthy and states[3].reason == "lost"
        assert states[0].healthy and states[1].healthy
    finally:
        release.set()
        monitor.stop(timeout=30)
    assert not monitor.alive()


def test_nvml_answering_that_every_gpu_is_lost_still_answers(nvml: FakeNVML) -> None:
    """/readyz's nvml check says whether NVML answers: a node whose GPUs are all lost has an NVML that
    answers (GPU_IS_LOST), and its agent serves (refusing allocations), so a rollout is not stopped there.
    An NVML that answers nothing else (an error of its own) is still a problem."""
    clock = Clock()
    nvml.lost.update(range(4))
    # A probe at each step (the clock moves 1 s a step) and an event wait of 10 ms, not 0.5 s, per step.
    monitor = _monitor(nvml, clock, probe_period=0.01)
    _prepare(monitor)
    next_probe = 0.0
    for _ in range(30):
        next_probe = monitor._step(next_probe)
        clock.now += 1.0
    assert all(not s.healthy for s in monitor.snapshot().values())
    assert monitor.nvml_problem() == ""
    nvml.lost.clear()
    nvml.no_handle = {}
    original = nvml.memory

    def broken(handle: Any) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    nvml.memory = broken  # type: ignore[method-assign]
    pynvml_memory = pynvml.nvmlDeviceGetMemoryInfo
    try:
        pynvml.nvmlDeviceGetMemoryInfo = broken
        for _ in range(30):
            next_probe = monitor._step(next_probe)
            clock.now += 1.0
        assert "has not answered" in monitor.nvml_problem()
    finally:
        pynvml.nvmlDeviceGetMemoryInfo = pynvml_memory
        nvml.memory = original  # type: ignore[method-assign]


def test_gpu_lost_at_start_is_not_offered_until_nvml_names_it(nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU lost at start is described by a guess (or the saved inventory) until it answers; offering it
    before NVML gives its UUID would hand containers a made-up NVIDIA_VISIBLE_DEVICES."""
    clock = Clock()
    nvml.lost.add(2)
    monitor = _monitor(nvml, clock, lost=[2], quiet_period=5.0, probe_period=1.0)
    _prepare(monitor)
    next_probe = monitor._step(0.0)
    nvml.lost.clear()

    def no_uuid(handle: Any) -> str:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", no_uuid)
    for _ in range(10):
        clock.now += 1.0
        next_probe = monitor._step(next_probe)
    assert not monitor.state(2).healthy
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", nvml.uuid)
    clock.now += 1.0
    monitor._step(next_probe)
    assert monitor.state(2).healthy


# -- the thread ------------------------------------------------------------------------------------


def _health_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpu-health"]


def test_stop_during_an_xid_storm_ends_the_thread(nvml: FakeNVML) -> None:
    before = len(_health_threads())

    class Endless(deque[tuple[str, Any, int]]):
        def __bool__(self) -> bool:
            return True

        def popleft(self) -> tuple[str, Any, int]:
            return ("event", nvml.handles[0], 79)

    nvml.queue = Endless()
    monitor = _monitor(nvml, Clock())
    monitor.start()
    for _ in range(1000):
        if monitor.xid_events > 100:
            break
        threading.Event().wait(0.01)
    monitor.stop(timeout=30)
    assert not monitor.alive()
    assert monitor._thread not in threading.enumerate()
    assert len(_health_threads()) <= before


# -- the simulated node: what the kubelet hears ----------------------------------------------------

CORE = names.VCORE_RESOURCE
MEM = names.VMEMORY_RESOURCE
V100_BLOCKS = 32768 // 256


def _unhealthy(devices: dict[str, Any]) -> set[str]:
    return {i for i, d in devices.items() if not d.healthy}


def _core_ids(gpu: int) -> set[str]:
    return {f"tencent.com/vcuda-core-{n}" for n in range(gpu * 100, gpu * 100 + 100)}


def _mem_ids(gpu: int) -> set[str]:
    first = gpu * V100_BLOCKS
    return {f"tencent.com/vcuda-memory-268435456-{n}" for n in range(first, first + V100_BLOCKS)}


def _list_messages(kubelet: Any, resource: str) -> list[Any]:
    return [u for u in kubelet.updates(resource) if u.kind == "list_and_watch"]


def test_xid_reaches_both_resources_once_with_exactly_that_gpus_devices(kubelet: Any, start_agent: Any) -> None:
    from tests.agent_fixtures import gpusim

    agent = start_agent("v100-pcie-x4", "--health-quiet-period=2s", "--health-probe-period=200ms")
    kubelet.wait_for_registration(CORE, timeout=60)
    kubelet.wait_for_registration(MEM, timeout=60)
    kubelet.wait_for_devices(CORE, 400, timeout=60)
    kubelet.wait_for_devices(MEM, 4 * V100_BLOCKS, timeout=60)
    gpusim(agent, "xid", "--gpu", "2", "--xid", "13")  # an application error: nothing changes
    gpusim(agent, "xid", "--gpu", "2", "--xid", "79")
    core = kubelet.wait_for_devices(CORE, lambda d: bool(_unhealthy(d)), timeout=60)
    mem = kubelet.wait_for_devices(MEM, lambda d: bool(_unhealthy(d)), timeout=60)
    assert _unhealthy(core) == _core_ids(2)
    assert _unhealthy(mem) == _mem_ids(2)
    kubelet.wait_for_devices(CORE, 400, timeout=60)
    kubelet.wait_for_devices(MEM, 4 * V100_BLOCKS, timeout=60)
    agent.wait_for_log("is healthy again", timeout=60)
    for resource in (CORE, MEM):
        states = [frozenset(_unhealthy(dict(u.devices))) for u in _list_messages(kubelet, resource)]
        # the first list, GPU 2 out, GPU 2 back: no message repeats the list before it
        assert all(a != b for a, b in itertools.pairwise(states)), (resource, len(states))
        assert states[-1] == frozenset()
    log = agent.log_text()
    assert "XID 13 ignored" in log
    assert log.count("is unhealthy: XID 79") == 1


def test_lost_gpu_is_out_on_both_resources_and_back_after_restore(kubelet: Any, start_agent: Any) -> None:
    from tests.agent_fixtures import gpusim

    agent = start_agent("v100-pcie-x4", "--health-quiet-period=1s", "--health-probe-period=200ms")
    kubelet.wait_for_devices(CORE, 400, timeout=60)
    kubelet.wait_for_devices(MEM, 4 * V100_BLOCKS, timeout=60)
    gpusim(agent, "lost", "--gpu", "1")
    core = kubelet.wait_for_devices(CORE, lambda d: bool(_unhealthy(d)), timeout=60)
    mem = kubelet.wait_for_devices(MEM, lambda d: bool(_unhealthy(d)), timeout=60)
    assert _unhealthy(core) == _core_ids(1)
    assert _unhealthy(mem) == _mem_ids(1)
    # an XID on another GPU while GPU 1 is lost is still acted on
    gpusim(agent, "xid", "--gpu", "3", "--xid", "48")
    core = kubelet.wait_for_devices(CORE, lambda d: _core_ids(3) <= _unhealthy(d), timeout=60)
    assert _unhealthy(core) == _core_ids(1) | _core_ids(3)
    gpusim(agent, "restore", "--gpu", "1")
    kubelet.wait_for_devices(CORE, 400, timeout=60)
    kubelet.wait_for_devices(MEM, 4 * V100_BLOCKS, timeout=60)
    log = agent.log_text()
    assert log.count("is unhealthy: lost") == 1, log


@pytest.mark.parametrize("missing", [1, 3])
def test_gpu_missing_from_nvml_after_a_restart_is_named_and_every_gpu_keeps_its_device_ids(
    kubelet: Any, tmp_path: Any, sim_built: Any, missing: int
) -> None:
    """A GPU that fell off the bus so hard that NVML no longer counts it (3 GPUs where the last start saw 4)
    moves the NVML indexes of the GPUs after it. The log names the missing GPU by index and UUID (not 'an
    inventory of other GPUs'); every GPU keeps its device IDs (the missing one's listed Unhealthy), so the
    kubelet's IDs of running containers still name their GPU, and an XID of NVML's GPU 1 takes out exactly
    the device IDs of the GPU NVML now counts at index 1."""
    from simnode.agent_process import AgentProcess
    from tests.agent_fixtures import gpusim, spec_path

    full = json.loads(spec_path("v100-pcie-x4").read_text())
    first = AgentProcess(tmp_path, spec_path("v100-pcie-x4")).start()
    try:
        kubelet.wait_for_devices(CORE, 400, timeout=60)
        first.wait_for_log("GPU 3: Tesla", timeout=60)
        saved = tmp_path / "checkpoint" / "gpumanager_node_inventory"
        for _ in range(600):  # written beside the checkpoint once the allocation state is up
            if saved.exists():
                break
            time.sleep(0.1)
        assert saved.exists()
    finally:
        first.stop()
    short = dict(full)
    short["gpus"] = [g for i, g in enumerate(full["gpus"]) if i != missing]
    short["topology"] = [
        [v for j, v in enumerate(row) if j != missing] for i, row in enumerate(full["topology"]) if i != missing
    ]
    short_spec = tmp_path / "v100-missing-one.json"
    short_spec.write_text(json.dumps(short))
    since = time.monotonic()
    agent = AgentProcess(tmp_path, short_spec, state=tmp_path / "short.state").start()
    try:
        kubelet.wait_for_registration(CORE, since=since, timeout=60, with_devices=True)
        core = kubelet.wait_for_devices(CORE, lambda d: len(d) == 400 and _unhealthy(d) == _core_ids(missing), 60)
        kubelet.wait_for_devices(MEM, 3 * V100_BLOCKS, timeout=60)  # healthy ones
        assert set(core) == set().union(*(_core_ids(g) for g in range(4)))
        log = agent.wait_for_log("no longer counted", timeout=30)
        line = next(x for x in log.splitlines() if "no longer counted" in x)
        assert f"GPU {missing} ({full['gpus'][missing]['uuid']})" in line, line
        assert "other GPUs" not in log
        gpusim(agent, "xid", "--gpu", "1", "--xid", "79")
        place = 1 if missing > 1 else 2  # the GPU NVML now counts at index 1
        core = kubelet.wait_for_devices(CORE, lambda d: len(_unhealthy(d)) > 100, timeout=60)
        assert _unhealthy(core) == _core_ids(missing) | _core_ids(place)
    finally:
        agent.stop()


# -- --ignored-xids -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "named"), [("13,abc", "'abc'"), ("79;13", "'79;13'"), ("13, 0x4f", "'0x4f'"), ("48,,1.5", "'1.5'")]
)
def test_malformed_ignored_xids_are_refused_naming_the_bad_item(
    value: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpumanager.cli import build_parser, normalize_argv

    with pytest.raises(SystemExit) as exc:
        build_parser({}).parse_args(normalize_argv([f"--ignored-xids={value}"]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--ignored-xids" in err and named in err, err


@pytest.mark.parametrize(("value", "xids"), [("", ()), (" 79 , 13,13 ", (13, 79)), ("109", (109,))])
def test_ignored_xids_accepts_lists_and_empty(value: str, xids: tuple[int, ...]) -> None:
    from gpumanager.cli import build_parser, config_from_args, normalize_argv

    args = build_parser({}).parse_args(normalize_argv([f"--ignored-xids={value}"]))
    assert config_from_args(args, {}).ignored_xids == xids


def test_event_registration_failing_on_every_gpu_is_reported_like_failing_on_some(nvml: FakeNVML) -> None:
    """XID events watched on no GPU at all (registration fails with an error on each) is reported on
    /healthz and /readyz as when it fails on some GPUs; it clears once a retry registers them."""
    clock = Clock()
    reports: list[tuple[str, str | None]] = []
    nvml.register_error = dict.fromkeys(range(4), pynvml.NVML_ERROR_UNKNOWN)
    monitor = _monitor(nvml, clock, report=lambda name, problem: reports.append((name, problem)))
    _prepare(monitor)
    assert "GPU 0" in monitor.event_problem() and "GPU 3" in monitor.event_problem()
    assert reports and reports[-1][0] == health_mod.XID_EVENTS and reports[-1][1]
    nvml.register_error = {}
    clock.now += health_mod.EVENT_SET_RETRY_MAX + 1
    _steps(monitor, 1)
    assert monitor.event_problem() == ""
    assert reports[-1] == (health_mod.XID_EVENTS, None)
    nvml.xid(1, 79)
    _steps(monitor, 1)
    assert not monitor.state(1).healthy


def test_gpus_without_xid_events_are_not_a_problem(nvml: FakeNVML) -> None:
    clock = Clock()
    nvml.register_error = dict.fromkeys(range(4), pynvml.NVML_ERROR_NOT_SUPPORTED)
    monitor = _monitor(nvml, clock)
    _prepare(monitor)
    _steps(monitor, 3)
    assert monitor.event_problem() == ""


def test_event_set_that_cannot_be_made_is_reported_until_it_can(
    nvml: FakeNVML, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    reports: list[tuple[str, str | None]] = []
    failing = [True]

    def create() -> object:
        if failing[0]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return object()

    monkeypatch.setattr(pynvml, "nvmlEventSetCreate", create)
    monitor = _monitor(nvml, clock, report=lambda name, problem: reports.append((name, problem)))
    _prepare(monitor)
    assert "Unknown Error" in monitor.event_problem()
    assert reports and reports[-1][1]
    failing[0] = False
    clock.now += health_mod.EVENT_SET_RETRY_MAX + 1
    _steps(monitor, 1)
    assert monitor.event_problem() == ""
    assert reports[-1] == (health_mod.XID_EVENTS, None)


def test_xid_storm_on_the_simulated_node_neither_floods_the_log_nor_hides_another_gpus_error(
    kubelet: Any, start_agent: Any
) -> None:
    from simnode.gpusim_state import GpuSimState

    agent = start_agent("v100-pcie-x4", "--health-probe-period=200ms")
    kubelet.wait_for_devices(CORE, 400, timeout=60)
    before = len(agent.log_text().splitlines())
    with GpuSimState(agent.state) as state:
        for n in range(5000):
            state.queue_xid(0, 13 if n % 2 else 43)  # applications failing over and over
            if n % 500 == 0:
                state.queue_xid(1, 31)
    with GpuSimState(agent.state) as state:
        state.queue_xid(2, 79)
    core = kubelet.wait_for_devices(CORE, lambda d: bool(_unhealthy(d)), timeout=60)
    assert _unhealthy(core) == _core_ids(2)
    lines = agent.log_text().splitlines()[before:]
    xid_lines = [line for line in lines if "XID" in line]
    assert 1 <= len(xid_lines) <= 10, xid_lines[:20]


def test_returned_gpu_that_cannot_be_described_is_logged_with_its_uuid_and_the_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gpumanager.device import propagation as propagation_mod
    from gpumanager.device.propagation import HealthPropagation

    gpus = _gpus(2)
    listeners: list[Any] = []

    class Monitor:
        def add_listener(self, listener: Any) -> None:
            listeners.append(listener)

        def snapshot(self) -> dict[int, HealthState]:
            return {g.index: HealthState(g.index != 1, "lost at start" if g.index == 1 else "") for g in gpus}

    class Allocator:
        def __init__(self) -> None:
            self.healthy: dict[int, bool] = {}

        def set_healthy(self, index: int, healthy: bool) -> None:
            self.healthy[index] = healthy

        def replace_gpu(self, info: GPUInfo) -> None:
            raise AssertionError("not described")

    def describe(index: int) -> GPUInfo:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    prop = HealthPropagation(Monitor(), gpus, [1], describe=describe)
    prop.listen()
    allocator = Allocator()
    prop.attach_allocator(allocator)
    with caplog.at_level(logging.WARNING, logger=propagation_mod.__name__):
        for listener in listeners:
            listener(1, HealthState(True, "", 0.0))
    lines = [r.getMessage() for r in caplog.records]
    assert any("GPU 1" in line and gpus[1].uuid in line and "Unknown Error" in line for line in lines), lines
