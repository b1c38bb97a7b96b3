"""The start's background work waits for the kubelet's first full ListAndWatch of both resources.

Loading the allocation state and the Kubernetes client is seconds of interpreter work; begun as soon
as Register returned, it competed with the kubelet's dial-back, GetDevicePluginOptions and the first
ListAndWatch answers for the interpreter, and the kubelet got its device lists tens of milliseconds
late. These tests hold the kubelet's ListAndWatch back and look at when the background start begins.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

import simnode.kubelet as kubelet_module
from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.kubelet import KubeletSimulator, _Endpoint

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
BACKGROUND_BEGINS = "at start-allocation"


def _held_kubelet(tmp_path: Path, gate: threading.Event) -> KubeletSimulator:
    """A kubelet that registers at once but opens ListAndWatch only once ``gate`` is set."""
    kubelet = KubeletSimulator(tmp_path / "device-plugins", fill="sorted")
    run = kubelet._run_list_and_watch

    def held(ep: _Endpoint) -> None:
        gate.wait(30)
        run(ep)

    kubelet._run_list_and_watch = held  # type: ignore[method-assign]
    kubelet.start()
    return kubelet


def _agent(tmp_path: Path) -> AgentProcess:
    return AgentProcess(tmp_path, SPEC_DIR / "t4-x1.json", env={"GPU_MANAGER_STALL_AT": "start-allocation:0"}).start()


def test_the_background_start_begins_after_both_first_lists_were_sent(tmp_path: Path) -> None:
    gate = threading.Event()
    kubelet = _held_kubelet(tmp_path, gate)
    agent = _agent(tmp_path)
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60)
        time.sleep(0.5)  # Register has returned to the agent; the kubelet has not asked for the lists
        assert BACKGROUND_BEGINS not in agent.log_text(), agent.log_text()[-3000:]
        gate.set()
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
        agent.wait_for_log(BACKGROUND_BEGINS, timeout=30)
    finally:
        gate.set()
        agent.stop()
        kubelet.stop()


def test_a_kubelet_that_never_asks_for_the_lists_does_not_hold_the_start_up(tmp_path: Path) -> None:
    gate = threading.Event()
    kubelet = _held_kubelet(tmp_path, gate)
    agent = _agent(tmp_path)
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60)
        agent.wait_for_log(BACKGROUND_BEGINS, timeout=30)
        agent.wait_for_log("devices in ", timeout=30)  # the start completes
    finally:
        gate.set()
        agent.stop()
        kubelet.stop()


def test_the_kubelet_simulator_does_not_read_an_unchanged_list_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kubelet restart brings both lists again, unchanged. The simulator read each one device by device
    (2,560 vcuda-memory IDs on 8 x H100: ~10 ms of its interpreter, ~35 ms on 16 x H200), and the other
    resource's answer, arriving meanwhile, was timestamped that much late: a Go kubelet reads each
    stream on its own. An unchanged list is now taken as it was."""
    made: list[str] = []

    class Counted(kubelet_module.DeviceState):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.healthy:  # read from a list (the restart marks the known ones Unhealthy: copies)
                made.append(self.id)

    monkeypatch.setattr(kubelet_module, "DeviceState", Counted)
    kubelet = KubeletSimulator(tmp_path / "device-plugins", fill="sorted")
    kubelet.start()
    agent = AgentProcess(tmp_path, SPEC_DIR / "t4-x1.json").start()
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60, with_devices=True)
        first = {r: len(kubelet.devices(r)) for r in RESOURCES}
        read = len(made)
        assert read == sum(first.values())
        before = {r: kubelet.registration_count(r) for r in RESOURCES}
        kubelet.restart()
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, after=before[resource], timeout=30)
            record = kubelet.wait_for_registration(resource, timeout=30, with_devices=True)
            assert record.index >= before[resource]
        assert {r: len(kubelet.healthy_ids(r)) for r in RESOURCES} == first
        assert len(made) == read
    finally:
        agent.stop()
        kubelet.stop()


def test_the_kubelet_simulator_reads_a_long_new_list_yielding_the_interpreter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new list of thousands of devices (8,500 vcuda-memory IDs on 16 x H200) took the simulator's
    interpreter ~30 ms in one stretch; the other resource's stream, read in another thread as a Go
    kubelet does in its own goroutine, is let in between every READ_YIELD_EVERY devices."""
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb

    count = 4 * kubelet_module.READ_YIELD_EVERY + 1
    raw = pb.ListAndWatchResponse(
        devices=[pb.Device(ID=f"{names.VMEMORY_RESOURCE}-0-{i}", health="Healthy") for i in range(count)]
    ).SerializeToString()
    kubelet = KubeletSimulator(tmp_path / "device-plugins", fill="sorted")
    record = kubelet_module.RegistrationRecord(
        index=0,
        resource=names.VMEMORY_RESOURCE,
        endpoint="m.sock",
        version="v1beta1",
        options=pb.DevicePluginOptions(),
        request_options=pb.DevicePluginOptions(),
        registered_at=time.monotonic(),
        connected_at=time.monotonic(),
    )
    channel = grpc.insecure_channel(f"unix://{tmp_path / 'none.sock'}")
    ep = _Endpoint(names.VMEMORY_RESOURCE, tmp_path / "m.sock", channel, pb.DevicePluginOptions(), record)
    kubelet._endpoints[names.VMEMORY_RESOURCE] = ep
    yields: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        if seconds == 0:
            yields.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", sleep)  # the module the simulator calls
    try:
        kubelet._on_devices(ep, raw, time.monotonic())
    finally:
        channel.close()
    assert len(kubelet.devices(names.VMEMORY_RESOURCE)) == count
    assert len(yields) == 4


def test_a_kubelet_that_starts_after_the_agent_is_registered_with_without_waiting_for_first_lists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory watch waits for the kubelet's first lists only once registered: with no kubelet yet,
    it opens at once, so the kubelet.sock made later is seen when it appears."""
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
    from gpumanager.deviceplugin import manager as manager_module
    from gpumanager.deviceplugin.manager import PluginManager
    from gpumanager.deviceplugin.server import PluginServer
    from gpumanager.deviceplugin.servicer import ResourceServicer

    monkeypatch.setattr(manager_module, "FIRST_LISTS_SECONDS", 60.0)  # a wait there would show
    listed = pb.ListAndWatchResponse(devices=[pb.Device(ID="r-0", health="Healthy")]).SerializeToString()
    servicer = ResourceServicer("example.com/r", devices=lambda: listed, options=pb.DevicePluginOptions())
    kubelet = KubeletSimulator(tmp_path / "device-plugins", dial_timeout=10.0)
    plugins = PluginManager(
        [PluginServer(servicer, tmp_path / "device-plugins" / "r.sock")],
        kubelet.socket_path,
        options_for=lambda _server: pb.DevicePluginOptions(),
        watch_period=600.0,
    )
    plugins.start()
    try:
        time.sleep(0.3)  # the first registration has failed: no kubelet.sock
        kubelet.start()
        kubelet.wait_for_registration("example.com/r", timeout=20, with_devices=True)
    finally:
        plugins.stop()
        kubelet.stop()
