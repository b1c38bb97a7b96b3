"""Tests of the kubelet simulator (simnode.kubelet) against a tiny fake device plugin."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.api import deviceplugin_v1beta1_pb2_grpc as pb_grpc
from gpumanager.api import podresources_v1_pb2 as prpb
from gpumanager.api import podresources_v1_pb2_grpc as prpb_grpc
from simnode.kubelet import (
    AllocationError,
    KubeletSimulator,
    PluginRPCError,
    is_extended_resource_name,
)
from simnode.kubelet_checkpoint import (
    CHECKPOINT_FILE,
    CheckpointEntry,
    write_checkpoint_v1,
    write_checkpoint_v2,
    write_checkpoint_v2_boot_id,
)

RES = "example.com/gpu"
REPO = Path(__file__).resolve().parent.parent

# gpu-0..2 on NUMA 0, gpu-3..4 on NUMA 1, gpu-5 without topology
TOPOLOGY: dict[str, list[int]] = {
    "gpu-0": [0],
    "gpu-1": [0],
    "gpu-2": [0],
    "gpu-3": [1],
    "gpu-4": [1],
    "gpu-5": [],
}


def make_devices(unhealthy: set[str] | None = None, topology: dict[str, list[int]] | None = None) -> list[Any]:
    out = []
    for dev_id, nodes in (topology or TOPOLOGY).items():
        health = "Unhealthy" if unhealthy and dev_id in unhealthy else "Healthy"
        d = pb.Device(ID=dev_id, health=health)
        if nodes:
            d.topology.nodes.extend([pb.NUMANode(ID=n) for n in nodes])
        out.append(d)
    return out


class FakePlugin(pb_grpc.DevicePluginServicer):
    """A device plugin with a handful of devices; records every call it gets."""

    def __init__(
        self,
        devices: list[Any] | None = None,
        *,
        pre_start_required: bool = False,
        preferred: Callable[[list[str], list[str], int], list[str]] | None = None,
    ) -> None:
        self.devices = devices if devices is not None else make_devices()
        self.pre_start_required = pre_start_required
        self.preferred = preferred
        self.updates: queue.Queue[list[Any] | None] = queue.Queue()
        self.preferred_requests: list[tuple[list[str], list[str], int]] = []
        self.allocate_requests: list[list[str]] = []
        self.prestart_requests: list[list[str]] = []
        self.allocate_error: tuple[grpc.StatusCode, str] | None = None
        self.prestart_error: tuple[grpc.StatusCode, str] | None = None
        self.stream_closed = threading.Event()
        self.server: grpc.Server | None = None
        self.socket: Path | None = None

    # --- DevicePlugin
    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(
            pre_start_required=self.pre_start_required,
            get_preferred_allocation_available=self.preferred is not None,
        )

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        try:
            yield pb.ListAndWatchResponse(devices=self.devices)
            while context.is_active():
                try:
                    msg = self.updates.get(timeout=0.02)
                except queue.Empty:
                    continue
                if msg is None:
                    return
                yield pb.ListAndWatchResponse(devices=msg)
        finally:
            self.stream_closed.set()

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        assert len(request.container_requests) == 1
        req = request.container_requests[0]
        args = (list(req.available_deviceIDs), list(req.must_include_deviceIDs), req.allocation_size)
        self.preferred_requests.append(args)
        assert self.preferred is not None
        ids = self.preferred(*args)
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=ids)]
        )

    def Allocate(self, request: Any, context: Any) -> Any:
        assert len(request.container_requests) == 1
        ids = list(request.container_requests[0].devices_ids)
        self.allocate_requests.append(ids)
        if self.allocate_error is not None:
            context.abort(*self.allocate_error)
        car = pb.ContainerAllocateResponse(
            envs={"FAKE_VISIBLE_DEVICES": ",".join(sorted(ids))},
            annotations={"fake/count": str(len(ids))},
            mounts=[pb.Mount(container_path="/usr/local/fake", host_path="/opt/fake", read_only=True)],
            devices=[pb.DeviceSpec(container_path="/dev/fake0", host_path="/dev/fake0", permissions="rw")],
        )
        return pb.AllocateResponse(container_responses=[car])

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        self.prestart_requests.append(list(request.devices_ids))
        if self.prestart_error is not None:
            context.abort(*self.prestart_error)
        return pb.PreStartContainerResponse()

    # --- helpers
    def serve(self, plugin_dir: Path, endpoint: str) -> Path:
        self.stream_closed.clear()
        self.socket = plugin_dir / endpoint
        server = grpc.server(thread_pool())
        pb_grpc.add_DevicePluginServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self.server = server
        return self.socket

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None


def thread_pool() -> Any:
    from concurrent import futures

    return futures.ThreadPoolExecutor(max_workers=8)


def register(
    sim: KubeletSimulator,
    endpoint: str,
    resource: str = RES,
    version: str = "v1beta1",
    timeout: float = 15.0,
) -> None:
    with grpc.insecure_channel(f"unix://{sim.socket_path}") as ch:
        pb_grpc.RegistrationStub(ch).Register(
            pb.RegisterRequest(
                version=version,
                endpoint=endpoint,
                resource_name=resource,
                options=pb.DevicePluginOptions(pre_start_required=True),
            ),
            timeout=timeout,
        )


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    # short path: unix socket paths are limited to ~107 bytes
    d = Path(tempfile.mkdtemp(prefix="ksim-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def sim(plugin_dir: Path) -> Iterator[KubeletSimulator]:
    s = KubeletSimulator(plugin_dir, dial_timeout=2.0, fill="sorted", rpc_timeout=10.0)
    s.start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def plugins() -> Iterator[list[FakePlugin]]:
    made: list[FakePlugin] = []
    yield made
    for p in made:
        p.stop()


def start_plugin(
    sim: KubeletSimulator, plugins: list[FakePlugin], endpoint: str = "fake.sock", **kw: Any
) -> FakePlugin:
    p = FakePlugin(**kw)
    plugins.append(p)
    p.serve(sim.plugin_dir, endpoint)
    register(sim, endpoint)
    sim.wait_for_devices(RES, lambda devs: len(devs) == len(p.devices), timeout=5)
    return p


def read_checkpoint(sim: KubeletSimulator) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(sim.checkpoint_path.read_text())
    return data


def prefer_last(available: list[str], must: list[str], size: int) -> list[str]:
    rest = sorted(set(available) - set(must))
    return list(must) + rest[len(rest) - (size - len(must)) :]


# ------------------------------------------------------------------------------------------ registration


def test_registration_records_fields(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    t0 = time.monotonic()
    p = start_plugin(sim, plugins, pre_start_required=True, preferred=prefer_last)
    rec = sim.wait_for_registration(RES, with_devices=True)
    assert rec.index == 0
    assert rec.resource == RES
    assert rec.endpoint == "fake.sock"
    assert rec.version == "v1beta1"
    # the options the kubelet uses come from GetDevicePluginOptions, not from the request
    assert rec.options.pre_start_required is True
    assert rec.options.get_preferred_allocation_available is True
    assert rec.request_options.pre_start_required is True
    assert rec.request_options.get_preferred_allocation_available is False
    assert rec.first_list_and_watch_at is not None
    assert t0 <= rec.registered_at <= rec.connected_at <= rec.first_list_and_watch_at
    assert rec.list_and_watch_messages == 1
    assert rec.ended_at is None
    assert sim.registration_count(RES) == 1
    assert sim.endpoint_options(RES).get_preferred_allocation_available
    devs = sim.devices(RES)
    assert set(devs) == set(TOPOLOGY)
    assert devs["gpu-3"].numa_nodes == (1,)
    assert devs["gpu-5"].numa_nodes == ()
    assert sim.healthy_ids(RES) == set(TOPOLOGY)
    assert not p.stream_closed.is_set()


def test_register_rejects_bad_version(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = FakePlugin()
    plugins.append(p)
    p.serve(sim.plugin_dir, "fake.sock")
    with pytest.raises(grpc.RpcError) as exc:
        register(sim, "fake.sock", version="v1alpha")
    assert exc.value.code() == grpc.StatusCode.UNKNOWN
    assert exc.value.details() == (
        'requested API version "v1alpha" is not supported by kubelet. Supported version is "v1beta1"'
    )
    assert sim.registrations == []
    assert sim.registration_errors[-1][1] == RES


@pytest.mark.parametrize("name", ["gpu", "kubernetes.io/gpu", "example.com/", "requests.example.com/gpu", "a/b/c"])
def test_register_rejects_bad_resource_name(sim: KubeletSimulator, plugins: list[FakePlugin], name: str) -> None:
    p = FakePlugin()
    plugins.append(p)
    p.serve(sim.plugin_dir, "fake.sock")
    with pytest.raises(grpc.RpcError) as exc:
        register(sim, "fake.sock", resource=name)
    assert exc.value.details() == f'the ResourceName "{name}" is invalid'
    assert sim.registrations == []


def test_extended_resource_names() -> None:
    assert is_extended_resource_name("tencent.com/vcuda-core")
    assert is_extended_resource_name("tencent.com/vcuda-memory")
    assert is_extended_resource_name("nvidia.com/gpu")
    assert not is_extended_resource_name("cpu")
    assert not is_extended_resource_name("kubernetes.io/foo")
    assert not is_extended_resource_name("Example.com/gpu")
    assert not is_extended_resource_name("example.com/-gpu")


def test_register_dial_failure(plugin_dir: Path) -> None:
    with KubeletSimulator(plugin_dir, dial_timeout=0.5) as s:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            register(s, "nobody-listens.sock")
        assert time.monotonic() - t0 >= 0.45
        assert exc.value.details().startswith("failed to dial device plugin:")
        assert s.registrations == []
        assert s.registration_errors[0][2].startswith("failed to dial device plugin:")


def test_start_cleans_sockets_only(plugin_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(plugin_dir / "stale.sock"))
    stale.close()
    (plugin_dir / CHECKPOINT_FILE).write_text("{}")
    (plugin_dir / "notes.txt").write_text("keep me")
    (plugin_dir / "sub").mkdir()
    with KubeletSimulator(plugin_dir) as s:
        assert not (plugin_dir / "stale.sock").exists()
        assert (plugin_dir / CHECKPOINT_FILE).read_text() == "{}"
        assert (plugin_dir / "notes.txt").exists()
        assert (plugin_dir / "sub").is_dir()
        assert s.socket_path.exists()


# ------------------------------------------------------------------------------------------ ListAndWatch


def test_list_and_watch_updates_and_health(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    assert read_checkpoint(sim)["Data"]["RegisteredDevices"][RES] == sorted(TOPOLOGY)
    p.updates.put(make_devices(unhealthy={"gpu-1"}))
    devs = sim.wait_for_devices(RES, 5, timeout=5)
    assert devs["gpu-1"].health == "Unhealthy"
    assert not devs["gpu-1"].healthy
    assert sim.healthy_ids(RES) == set(TOPOLOGY) - {"gpu-1"}
    # the checkpoint's RegisteredDevices lists healthy devices only
    assert "gpu-1" not in read_checkpoint(sim)["Data"]["RegisteredDevices"][RES]
    # a shrinking list replaces the whole set
    p.updates.put(make_devices(topology={"gpu-9": [0]}))
    devs = sim.wait_for_devices(RES, lambda d: set(d) == {"gpu-9"}, timeout=5)
    assert devs["gpu-9"].healthy
    kinds = [u.kind for u in sim.updates(RES)]
    assert kinds == ["list_and_watch"] * 3
    assert sim.wait_for_registration(RES).list_and_watch_messages == 3


def _slow_checkpoint_writes(
    sim: KubeletSimulator, monkeypatch: pytest.MonkeyPatch, seconds: float, *, wake_waiters: bool = False
) -> None:
    """Each checkpoint write of the simulator takes ``seconds``; with ``wake_waiters``, halfway
    through it another event (another resource's update) wakes everyone waiting on the simulator."""
    import simnode.kubelet as kubelet_module

    real = kubelet_module.write_checkpoint_v2

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds / 2)
        if wake_waiters:
            with sim._cond:
                sim._cond.notify_all()
        time.sleep(seconds / 2)
        return real(*args, **kwargs)

    monkeypatch.setattr(kubelet_module, "write_checkpoint_v2", slow)


def test_devices_seen_means_their_checkpoint_is_written(
    sim: KubeletSimulator, plugins: list[FakePlugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kubelet writes its checkpoint after taking a device list; a slow disk must not let a
    # test that saw the devices read a checkpoint that is not there yet (or an older one).
    _slow_checkpoint_writes(sim, monkeypatch, 0.3, wake_waiters=True)
    p = start_plugin(sim, plugins)
    assert read_checkpoint(sim)["Data"]["RegisteredDevices"][RES] == sorted(TOPOLOGY)
    p.updates.put(make_devices(unhealthy={"gpu-1"}))
    sim.wait_for_devices(RES, 5, timeout=5)
    assert "gpu-1" not in read_checkpoint(sim)["Data"]["RegisteredDevices"][RES]


def test_a_state_the_devices_passed_through_is_seen(
    sim: KubeletSimulator, plugins: list[FakePlugin], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GPU marked unhealthy and recovered at once (while the checkpoint of the first update was
    # still being written): a waiter for the unhealthy state must not miss it.
    p = start_plugin(sim, plugins)
    _slow_checkpoint_writes(sim, monkeypatch, 0.1)
    got: list[dict[str, Any]] = []
    waiter = threading.Thread(target=lambda: got.append(sim.wait_for_devices(RES, 5, timeout=5)))
    waiter.start()
    time.sleep(0.05)
    p.updates.put(make_devices(unhealthy={"gpu-1"}))
    p.updates.put(make_devices())
    waiter.join(10)
    assert got and not got[0]["gpu-1"].healthy
    assert sim.wait_for_devices(RES, 6, timeout=5)["gpu-1"].healthy


def test_stream_end_marks_unhealthy(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    p.updates.put(None)  # plugin ends the stream
    devs = sim.wait_for_devices(RES, lambda d: len(d) == 6 and not any(x.healthy for x in d.values()), 5)
    assert set(devs) == set(TOPOLOGY)
    rec = sim.wait_for_registration(RES)
    assert rec.ended_at is not None and rec.end_reason
    last = sim.updates(RES)[-1]
    assert last.kind == "disconnected"
    assert "listAndWatch ended unexpectedly" in last.detail
    with pytest.raises(AllocationError, match="no healthy devices present"):
        sim.allocate(RES, 1, pod_uid="p", container_name="c")


def test_a_resource_stopped_past_the_grace_period_is_forgotten(
    sim: KubeletSimulator, plugins: list[FakePlugin]
) -> None:
    """endpointStopGracePeriod: until it ends, the resource is known with no healthy device; then the kubelet
    drops it (checkpoint included) and an allocation fails as for a resource never registered."""
    p = start_plugin(sim, plugins)
    sim.endpoint_stop_grace = 0.3
    p.updates.put(None)
    sim.wait_for_devices(RES, lambda d: bool(d) and not any(x.healthy for x in d.values()), timeout=5)
    with pytest.raises(AllocationError, match="no healthy devices present"):
        sim.allocate(RES, 1, pod_uid="p", container_name="c")
    deadline = time.monotonic() + 5
    while True:
        try:
            sim.allocate(RES, 1, pod_uid="p", container_name="c")
        except AllocationError as exc:
            if "cannot allocate unregistered device" in str(exc):
                break
        assert time.monotonic() < deadline, "the resource was never forgotten"
        time.sleep(0.05)
    assert RES not in read_checkpoint(sim)["Data"]["RegisteredDevices"]
    assert sim.updates(RES)[-1].kind == "expired"


def test_plugin_server_death_marks_unhealthy(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    p.stop()
    sim.wait_for_devices(RES, lambda d: not any(x.healthy for x in d.values()), timeout=5)


def test_reregistration_replaces_endpoint(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    """Kubelet <= 1.24: the replaced endpoint is stopped at once and its stream's end is ignored."""
    sim.keep_replaced_streams = False
    old = start_plugin(sim, plugins, endpoint="old.sock")
    n = sim.registration_count(RES)
    new = FakePlugin(make_devices(topology={"gpu-a": [0], "gpu-b": [1]}), preferred=prefer_last)
    plugins.append(new)
    new.serve(sim.plugin_dir, "new.sock")
    register(sim, "new.sock")
    rec = sim.wait_for_registration(RES, after=n, with_devices=True)
    assert rec.index == 1 and rec.endpoint == "new.sock"
    assert old.stream_closed.wait(5), "old ListAndWatch stream was not closed"
    sim.wait_for_devices(RES, lambda d: set(d) == {"gpu-a", "gpu-b"}, timeout=5)
    assert sim.registrations[0].ended_at is not None
    assert sim.endpoint_options(RES).get_preferred_allocation_available
    # the old stream's end does not turn the new devices unhealthy
    time.sleep(0.1)
    assert sim.healthy_ids(RES) == {"gpu-a", "gpu-b"}
    rec2 = sim.allocate(RES, 1, pod_uid="p", container_name="c")
    assert new.allocate_requests == [list(rec2.device_ids)] and old.allocate_requests == []


def test_replaced_stream_reads_on_and_its_end_stops_the_new_endpoint(
    sim: KubeletSimulator, plugins: list[FakePlugin]
) -> None:
    """Kubelet 1.25 on: the replaced client reads on (its messages set the devices), and when its stream ends
    PluginDisconnected marks every device unhealthy and stops the current endpoint: its calls are refused
    until the plugin registers again, while its own messages still set the devices' health."""
    old = start_plugin(sim, plugins, endpoint="old.sock")
    n = sim.registration_count(RES)
    new = FakePlugin(make_devices(topology={"gpu-a": [0], "gpu-b": [1]}))
    plugins.append(new)
    new.serve(sim.plugin_dir, "new.sock")
    register(sim, "new.sock")
    sim.wait_for_registration(RES, after=n, with_devices=True)
    assert not old.stream_closed.wait(0.2), "the replaced ListAndWatch was closed"
    old.updates.put(make_devices(topology={"gpu-z": []}))
    sim.wait_for_devices(RES, lambda d: set(d) == {"gpu-z"}, timeout=5)
    old.updates.put(None)
    sim.wait_for_devices(RES, lambda d: bool(d) and not any(x.healthy for x in d.values()), timeout=5)
    new.updates.put(make_devices(topology={"gpu-a": [0], "gpu-b": [1]}))
    sim.wait_for_devices(RES, 2, timeout=5)
    with pytest.raises(PluginRPCError, match="has been stopped"):
        sim.allocate(RES, 1, pod_uid="p", container_name="c")
    assert new.allocate_requests == []
    register(sim, "new.sock")
    sim.wait_for_registration(RES, after=n + 1, with_devices=True)
    sim.allocate(RES, 1, pod_uid="p", container_name="c")
    assert len(new.allocate_requests) == 1


# ------------------------------------------------------------------------------------------ allocation


def test_allocate_without_preferred_sorted_fill(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    rec = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main")
    assert rec.device_ids == ("gpu-0", "gpu-1")
    assert p.allocate_requests == [["gpu-0", "gpu-1"]]
    assert rec.preferred is None and p.preferred_requests == []
    assert rec.response.envs["FAKE_VISIBLE_DEVICES"] == "gpu-0,gpu-1"
    assert rec.timings.allocate_seconds is not None and rec.timings.total_seconds >= 0
    rec2 = sim.allocate(RES, 3, pod_uid="pod-2", container_name="main")
    assert rec2.device_ids == ("gpu-2", "gpu-3", "gpu-4")


def test_allocate_random_fill_is_seedable(plugin_dir: Path, plugins: list[FakePlugin]) -> None:
    picks = []
    for _ in range(2):
        with KubeletSimulator(plugin_dir, fill="random", seed=7) as s:
            p = FakePlugin()
            plugins.append(p)
            p.serve(plugin_dir, "fake.sock")
            register(s, "fake.sock")
            s.wait_for_devices(RES, 6, timeout=5)
            picks.append([s.allocate(RES, 3, pod_uid=f"p{i}", container_name="c").device_ids for i in range(2)])
            p.stop()
    assert picks[0] == picks[1]
    assert len(set(picks[0][0]) | set(picks[0][1])) == 6


def test_preferred_allocation_honoured_and_filled(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    def short_answer(available: list[str], must: list[str], size: int) -> list[str]:
        return ["gpu-5", "gpu-2", "not-a-device"]  # one bogus, one short

    p = start_plugin(sim, plugins, preferred=short_answer)
    rec = sim.allocate(RES, 3, pod_uid="pod-1", container_name="main")
    assert len(p.preferred_requests) == 1
    available, must, size = p.preferred_requests[0]
    assert sorted(available) == sorted(TOPOLOGY) and must == [] and size == 3
    assert rec.preferred == ("gpu-5", "gpu-2", "not-a-device")
    # preferred ∩ available first, then filled (sorted) from the rest
    assert set(rec.device_ids) == {"gpu-5", "gpu-2", "gpu-0"}
    assert sorted(p.allocate_requests[0]) == sorted(rec.device_ids)
    # next allocation: the plugin is only offered what is left
    sim.allocate(RES, 1, pod_uid="pod-2", container_name="main")
    assert sorted(p.preferred_requests[1][0]) == ["gpu-1", "gpu-3", "gpu-4"]


def test_preferred_answer_fully_used(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins, preferred=prefer_last)
    rec = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main")
    assert set(rec.device_ids) == {"gpu-4", "gpu-5"}
    assert p.preferred_requests[0][2] == 2


def test_numa_aligned_enough(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins, preferred=prefer_last)
    rec = sim.allocate(RES, 1, pod_uid="pod-1", container_name="main", numa_hint={1})
    # needed < len(aligned): the plugin is offered the aligned devices only
    available, must, size = p.preferred_requests[0]
    assert sorted(available) == ["gpu-3", "gpu-4"] and must == [] and size == 1
    assert rec.device_ids == ("gpu-4",)
    assert rec.devices_per_numa == {1: ("gpu-4",)}


def test_numa_aligned_exactly_enough_skips_preferred(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins, preferred=prefer_last)
    rec = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main", numa_hint={1})
    # needed == len(aligned): the kubelet takes all aligned devices and never asks the plugin
    assert set(rec.device_ids) == {"gpu-3", "gpu-4"}
    assert p.preferred_requests == [] and rec.preferred is None


def test_numa_aligned_not_enough(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    def must_plus_5(available: list[str], must: list[str], size: int) -> list[str]:
        return [*must, "gpu-5"]

    p = start_plugin(sim, plugins, preferred=must_plus_5)
    rec = sim.allocate(RES, 4, pod_uid="pod-1", container_name="main", numa_hint={1})
    # all aligned first, then the plugin is asked with mustInclude = aligned and the full size
    available, must, size = p.preferred_requests[0]
    assert sorted(must) == ["gpu-3", "gpu-4"] and size == 4
    assert sorted(available) == sorted(TOPOLOGY)
    # then unaligned (NUMA 0) fills before no-affinity devices
    assert set(rec.device_ids) == {"gpu-3", "gpu-4", "gpu-5", "gpu-0"}
    assert rec.devices_per_numa == {1: ("gpu-3", "gpu-4"), 0: ("gpu-0",), -1: ("gpu-5",)}


def test_numa_fill_order_unaligned_before_no_affinity(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    start_plugin(sim, plugins)  # no GetPreferredAllocation
    rec = sim.allocate(RES, 5, pod_uid="pod-1", container_name="main", numa_hint={1})
    assert set(rec.device_ids) == {"gpu-3", "gpu-4", "gpu-0", "gpu-1", "gpu-2"}
    # without a hint, everything is no-affinity and the sorted fill starts at gpu-0
    rec2 = sim.allocate(RES, 1, pod_uid="pod-2", container_name="main")
    assert rec2.device_ids == ("gpu-5",)


def test_devices_registered_later_take_their_natural_place_in_the_fill(
    sim: KubeletSimulator, plugins: list[FakePlugin]
) -> None:
    p = start_plugin(sim, plugins)
    first = sim.allocate(RES, 1, pod_uid="pod-1", container_name="main")
    assert first.device_ids == ("gpu-0",)
    # gpu-10 and gpu-1a are new: "gpu-10" sorts before "gpu-2" as text, after "gpu-5" naturally
    p.updates.put(make_devices(topology={**TOPOLOGY, "gpu-10": [], "gpu-1a": []}))
    sim.wait_for_devices(RES, lambda devs: len(devs) == len(TOPOLOGY) + 2, timeout=5)
    rest = sim.allocate(RES, 7, pod_uid="pod-2", container_name="main")
    assert rest.device_ids == ("gpu-1", "gpu-1a", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-10")
    assert p.allocate_requests[-1] == list(rest.device_ids)


def test_allocate_unavailable(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    start_plugin(sim, plugins)
    with pytest.raises(AllocationError) as exc:
        sim.allocate(RES, 7, pod_uid="pod-1", container_name="main")
    assert str(exc.value) == f"requested number of devices unavailable for {RES}. Requested: 7, Available: 6"
    sim.allocate(RES, 4, pod_uid="pod-1", container_name="main")
    with pytest.raises(AllocationError, match="Requested: 3, Available: 2"):
        sim.allocate(RES, 3, pod_uid="pod-2", container_name="main")
    with pytest.raises(AllocationError, match=re.escape("cannot allocate unregistered device other.com/x")):
        sim.allocate("other.com/x", 1, pod_uid="pod-2", container_name="main")


def test_allocate_error_propagates_and_records_nothing(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    p.allocate_error = (grpc.StatusCode.RESOURCE_EXHAUSTED, "no vcuda memory left")
    with pytest.raises(PluginRPCError) as exc:
        sim.allocate(RES, 6, pod_uid="pod-1", container_name="main")
    assert exc.value.method == "Allocate"
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert exc.value.details == "no vcuda memory left"
    assert "no vcuda memory left" in str(exc.value)
    assert sim.allocations() == []
    assert read_checkpoint(sim)["Data"]["PodDeviceEntries"] is None
    # nothing stays reserved: all six can be allocated once the plugin recovers
    p.allocate_error = None
    assert len(sim.allocate(RES, 6, pod_uid="pod-1", container_name="main").device_ids) == 6


def test_allocate_reuses_container_devices(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    first = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main")
    again = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main")
    assert again.reused and again.device_ids == first.device_ids
    assert len(p.allocate_requests) == 1
    with pytest.raises(AllocationError, match="changed request"):
        sim.allocate(RES, 3, pod_uid="pod-1", container_name="main")


def test_concurrent_allocations_do_not_overlap(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    start_plugin(sim, plugins, preferred=prefer_last)
    results: list[tuple[str, ...]] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results.append(sim.allocate(RES, 1, pod_uid=f"p{i}", container_name="c").device_ids)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(d for r in results for d in r) == sorted(TOPOLOGY)


def test_remove_pod_frees_devices(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    start_plugin(sim, plugins)
    sim.allocate(RES, 6, pod_uid="pod-1", container_name="main")
    assert sim.remove_pod("pod-1")
    # As the kubelet: the file keeps a removed pod's entries until the next admission writes it.
    assert [e["PodUID"] for e in read_checkpoint(sim)["Data"]["PodDeviceEntries"]] == ["pod-1"]
    assert len(sim.allocate(RES, 6, pod_uid="pod-2", container_name="main").device_ids) == 6
    assert [e["PodUID"] for e in read_checkpoint(sim)["Data"]["PodDeviceEntries"]] == ["pod-2"]
    assert not sim.remove_pod("nope")
    sim.keep_departed_in_checkpoint = False  # the file rewritten at once
    assert sim.remove_pod("pod-2")
    assert read_checkpoint(sim)["Data"]["PodDeviceEntries"] is None


# ------------------------------------------------------------------------------------------ checkpoint


def test_checkpoint_v2_content(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    topo = {**TOPOLOGY, "gpu-6": [0, 1]}
    p = FakePlugin(make_devices(topology=topo))
    plugins.append(p)
    p.serve(sim.plugin_dir, "fake.sock")
    register(sim, "fake.sock")
    sim.wait_for_devices(RES, 7, timeout=5)
    writes = sim.checkpoint_writes
    rec = sim.allocate(RES, 7, pod_uid="pod-uid-1", container_name="main")
    assert sim.checkpoint_writes == writes + 1
    raw = sim.checkpoint_path.read_text()
    doc = json.loads(raw)
    assert set(doc) == {"Data", "Checksum"}
    assert isinstance(doc["Checksum"], int)
    data = doc["Data"]
    assert data["RegisteredDevices"] == {RES: [f"gpu-{i}" for i in range(7)]}
    (entry,) = data["PodDeviceEntries"]
    assert entry["PodUID"] == "pod-uid-1"
    assert entry["ContainerName"] == "main"
    assert entry["ResourceName"] == RES
    ids = entry["DeviceIDs"]
    assert list(ids) == ["-1", "0", "1"]  # Go sorts map keys as strings
    assert sorted(ids["0"]) == ["gpu-0", "gpu-1", "gpu-2", "gpu-6"]
    assert sorted(ids["1"]) == ["gpu-3", "gpu-4", "gpu-6"]  # multi-NUMA device under each node
    assert ids["-1"] == ["gpu-5"]
    resp = pb.ContainerAllocateResponse.FromString(base64.b64decode(entry["AllocResp"]))
    assert resp == rec.response
    assert resp.envs["FAKE_VISIBLE_DEVICES"] == ",".join(sorted(topo))
    assert resp.mounts[0].host_path == "/opt/fake"
    # written atomically: no temp files left behind
    assert [f for f in os.listdir(sim.plugin_dir) if f.endswith(".tmp")] == []


def test_checkpoint_writers(plugin_dir: Path) -> None:
    car = pb.ContainerAllocateResponse(envs={"A": "1"})
    entries = [
        CheckpointEntry("uid-1", "c1", "tencent.com/vcuda-core", {0: ["core-1", "core-2"], 1: ["core-2"]}),
        CheckpointEntry.from_flat("uid-1", "c1", "tencent.com/vcuda-memory", ["mem-1"], car.SerializeToString()),
    ]
    registered = {"tencent.com/vcuda-core": ["core-1", "core-2", "core-3"], "tencent.com/vcuda-memory": ["mem-1"]}

    path = write_checkpoint_v1(plugin_dir, entries, registered, checksum=42)
    assert path == plugin_dir / CHECKPOINT_FILE
    v1 = json.loads(path.read_text())
    assert v1["Checksum"] == 42
    assert v1["Data"]["PodDeviceEntries"][0]["DeviceIDs"] == ["core-1", "core-2"]
    assert v1["Data"]["PodDeviceEntries"][1]["DeviceIDs"] == ["mem-1"]
    assert v1["Data"]["PodDeviceEntries"][0]["AllocResp"] == ""
    got = pb.ContainerAllocateResponse.FromString(base64.b64decode(v1["Data"]["PodDeviceEntries"][1]["AllocResp"]))
    assert got.envs["A"] == "1"
    assert v1["Data"]["RegisteredDevices"] == registered

    v2 = json.loads(write_checkpoint_v2(plugin_dir, entries, registered).read_text())
    assert v2["Data"]["PodDeviceEntries"][0]["DeviceIDs"] == {"0": ["core-1", "core-2"], "1": ["core-2"]}
    assert v2["Data"]["PodDeviceEntries"][1]["DeviceIDs"] == {"-1": ["mem-1"]}
    assert "BootID" not in v2

    v2b = json.loads(write_checkpoint_v2_boot_id(plugin_dir, entries, registered, "boot-123").read_text())
    assert v2b["BootID"] == "boot-123"
    assert v2b["Data"] == v2["Data"] and v2b["Checksum"] == v2["Checksum"]

    empty = json.loads(write_checkpoint_v2(plugin_dir / "other", [], {}).read_text())
    assert empty == {"Data": {"PodDeviceEntries": None, "RegisteredDevices": {}}, "Checksum": empty["Checksum"]}
    listed = json.loads(write_checkpoint_v2(plugin_dir / "other", [], {}, null_when_empty=False).read_text())
    assert listed["Data"]["PodDeviceEntries"] == []


# ------------------------------------------------------------------------------------------ PreStart


def test_pre_start_called_with_container_devices(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins, pre_start_required=True)
    rec = sim.allocate(RES, 3, pod_uid="pod-1", container_name="main")
    sim.allocate(RES, 1, pod_uid="pod-1", container_name="side")
    assert sim.pre_start(RES, pod_uid="pod-1", container_name="main") is True
    assert p.prestart_requests == [list(rec.device_ids)]
    p.prestart_error = (grpc.StatusCode.FAILED_PRECONDITION, "not ready")
    with pytest.raises(PluginRPCError) as exc:
        sim.pre_start(RES, pod_uid="pod-1", container_name="side")
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and exc.value.details == "not ready"
    with pytest.raises(Exception, match="no devices found allocated"):
        sim.pre_start(RES, pod_uid="pod-x", container_name="main")


def test_init_containers_devices_are_handed_on_healthy_or_not(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    """devicesToReuse is not filtered by health: an app container gets its init container's devices even when
    one turned unhealthy meanwhile; a shortfall beyond them names what is still needed."""
    p = start_plugin(sim, plugins)
    init = sim.allocate(RES, 2, pod_uid="pod-1", container_name="init", init_container=True)
    sick = init.device_ids[0]
    p.updates.put(make_devices(unhealthy={sick}))
    sim.wait_for_devices(RES, 5, timeout=5)
    app = sim.allocate(RES, 2, pod_uid="pod-1", container_name="app")
    assert set(app.device_ids) == set(init.device_ids)
    sim.allocate(RES, 1, pod_uid="pod-3", container_name="init", init_container=True)
    with pytest.raises(AllocationError, match="Requested: 5, Available: 3"):
        sim.allocate(RES, 6, pod_uid="pod-3", container_name="app")


def test_pre_start_skipped_when_not_required(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins, pre_start_required=False)
    sim.allocate(RES, 1, pod_uid="pod-1", container_name="main")
    assert sim.pre_start(RES, pod_uid="pod-1", container_name="main") is False
    assert p.prestart_requests == []


# ------------------------------------------------------------------------------------------ restart


def test_restart_wipes_sockets_and_recreates_kubelet_sock(sim: KubeletSimulator, plugins: list[FakePlugin]) -> None:
    p = start_plugin(sim, plugins)
    rec = sim.allocate(RES, 2, pod_uid="pod-1", container_name="main")
    assert p.socket is not None and p.socket.exists()
    (sim.plugin_dir / "keep.txt").write_text("x")
    # keep the old kubelet.sock inode alive through a hard link outside the directory, so that
    # a re-created socket cannot get the same inode number
    holder = Path(tempfile.mkdtemp(prefix="ksim-hold-", dir="/tmp"))
    os.link(sim.socket_path, holder / "old-kubelet.sock")
    old_ino = os.stat(sim.socket_path).st_ino
    n = sim.registration_count(RES)

    try:
        created = sim.restart()
        assert not p.socket.exists(), "the plugin's socket must be wiped by a kubelet restart"
        assert sim.socket_path.exists() and os.stat(sim.socket_path).st_ino != old_ino
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    assert (sim.plugin_dir / "keep.txt").exists() and sim.checkpoint_path.exists()
    assert sim.healthy_ids(RES) == set()
    assert sim.updates(RES)[-1].kind == "restart"
    assert sim.registrations[0].ended_at is not None
    assert p.stream_closed.wait(5)
    assert [a.device_ids for a in sim.allocations()] == [rec.device_ids]  # state kept

    # the plugin notices and re-registers on a fresh socket
    p.stop()
    p.serve(sim.plugin_dir, "fake.sock")
    register(sim, "fake.sock")
    new = sim.wait_for_registration(RES, after=n, with_devices=True)
    assert new.index == n and new.registered_at >= created
    sim.wait_for_devices(RES, 6, timeout=5)
    # devices held by pod-1 are still taken
    rec2 = sim.allocate(RES, 4, pod_uid="pod-2", container_name="main")
    assert not set(rec2.device_ids) & set(rec.device_ids)


def test_restarted_kubelet_starts_containers_without_pre_start_until_the_plugin_registers(
    sim: KubeletSimulator, plugins: list[FakePlugin]
) -> None:
    """After a restart the kubelet knows the resource's endpoint from its checkpoint only, without options:
    a container (re)started before the plugin registers again gets no PreStartContainer, not an error."""
    p = start_plugin(sim, plugins, pre_start_required=True)
    sim.allocate(RES, 1, pod_uid="pod-1", container_name="main")
    n = sim.registration_count(RES)
    sim.restart()
    assert sim.endpoint_options(RES) is None
    assert sim.pre_start(RES, pod_uid="pod-1", container_name="main") is False
    assert p.prestart_requests == []
    p.stop()
    p.serve(sim.plugin_dir, "fake.sock")
    register(sim, "fake.sock")
    sim.wait_for_registration(RES, after=n, with_devices=True)
    assert sim.pre_start(RES, pod_uid="pod-1", container_name="main") is True
    assert len(p.prestart_requests) == 1


def test_wait_for_registration_times_out(sim: KubeletSimulator) -> None:
    with pytest.raises(TimeoutError):
        sim.wait_for_registration(RES, timeout=0.1)
    with pytest.raises(TimeoutError):
        sim.wait_for_devices(RES, 1, timeout=0.1)


# ------------------------------------------------------------------------------------------ PodResources


@contextlib.contextmanager
def pod_resources_kubelet(
    plugin_dir: Path, plugins: list[FakePlugin]
) -> Iterator[tuple[KubeletSimulator, FakePlugin, Path]]:
    """A kubelet serving PodResources, the fake plugin of six devices registered with it, its socket."""
    pr_sock = plugin_dir / "pod-resources" / "kubelet.sock"
    with KubeletSimulator(plugin_dir, pod_resources_socket=pr_sock, fill="sorted") as s:
        p = FakePlugin()
        plugins.append(p)
        p.serve(plugin_dir, "fake.sock")
        register(s, "fake.sock")
        s.wait_for_devices(RES, 6, timeout=5)
        yield s, p, pr_sock


def test_pod_resources_api(plugin_dir: Path, plugins: list[FakePlugin]) -> None:
    with pod_resources_kubelet(plugin_dir, plugins) as (s, p, pr_sock):
        s.allocate(RES, 2, pod_uid="uid-1", container_name="main", pod_name="train", namespace="ml")
        s.allocate(RES, 1, pod_uid="uid-1", container_name="side", numa_hint={1})
        s.allocate(RES, 3, pod_uid="uid-2", container_name="c", pod_name="infer")
        with grpc.insecure_channel(f"unix://{pr_sock}") as ch:
            stub = prpb_grpc.PodResourcesListerStub(ch)
            listed = stub.List(prpb.ListPodResourcesRequest(), timeout=5)
            pods = {(x.namespace, x.name): x for x in listed.pod_resources}
            assert set(pods) == {("ml", "train"), ("default", "infer")}
            train = pods[("ml", "train")]
            conts = {c.name: c for c in train.containers}
            main_ids = sorted(i for d in conts["main"].devices for i in d.device_ids)
            assert main_ids == ["gpu-0", "gpu-1"]
            assert all(d.resource_name == RES for d in conts["main"].devices)
            (side,) = conts["side"].devices
            assert list(side.device_ids) == ["gpu-3"] and [n.ID for n in side.topology.nodes] == [1]

            got = stub.Get(prpb.GetPodResourcesRequest(pod_name="infer", pod_namespace="default"), timeout=5)
            got_devs = {d.device_ids[0]: d for c in got.pod_resources.containers for d in c.devices}
            assert set(got_devs) == {"gpu-2", "gpu-4", "gpu-5"}
            assert not got_devs["gpu-5"].HasField("topology")
            assert [n.ID for n in got_devs["gpu-2"].topology.nodes] == [0]

            with pytest.raises(grpc.RpcError) as exc:
                stub.Get(prpb.GetPodResourcesRequest(pod_name="ghost", pod_namespace="ml"), timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNKNOWN  # a plain Go error in the kubelet

            alloc = stub.GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=5)
            ids = [i for d in alloc.devices for i in d.device_ids]
            assert sorted(ids) == sorted(TOPOLOGY)  # one entry per device (single NUMA node each)
            p.updates.put(make_devices(unhealthy={"gpu-2"}))
            s.wait_for_devices(RES, 5, timeout=5)
            alloc = stub.GetAllocatableResources(prpb.AllocatableResourcesRequest(), timeout=5)
            assert {i for d in alloc.devices for i in d.device_ids} == set(TOPOLOGY) - {"gpu-2"}
            numa_of = {d.device_ids[0]: [n.ID for n in d.topology.nodes] for d in alloc.devices}
            assert numa_of["gpu-3"] == [1] and numa_of["gpu-5"] == []


# ------------------------------------------------------------------------------------------ process


def test_runs_as_process(plugin_dir: Path, plugins: list[FakePlugin]) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "simnode.kubelet", "--plugin-dir", str(plugin_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 15
        while not (plugin_dir / "kubelet.sock").exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "kubelet.sock never appeared"
            time.sleep(0.05)
        p = FakePlugin()
        plugins.append(p)
        p.serve(plugin_dir, "fake.sock")
        sim_like = KubeletSimulator(plugin_dir)  # only used for its socket path
        register(sim_like, "fake.sock")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "registered device plugin example.com/gpu" in out


def test_pod_resources_list_follows_every_allocation_and_removal(plugin_dir: Path, plugins: list[FakePlugin]) -> None:
    with (
        pod_resources_kubelet(plugin_dir, plugins) as (s, _p, pr_sock),
        grpc.insecure_channel(f"unix://{pr_sock}") as ch,
    ):
        stub = prpb_grpc.PodResourcesListerStub(ch)

        def listed() -> dict[str, list[str]]:
            answer = stub.List(prpb.ListPodResourcesRequest(), timeout=5)
            return {
                x.name: sorted(i for c in x.containers for d in c.devices for i in d.device_ids)
                for x in answer.pod_resources
            }

        assert listed() == {}
        s.allocate(RES, 2, pod_uid="uid-1", container_name="main", pod_name="a")
        assert listed() == listed() == {"a": ["gpu-0", "gpu-1"]}
        s.allocate(RES, 1, pod_uid="uid-2", container_name="main", pod_name="b")
        assert listed() == {"a": ["gpu-0", "gpu-1"], "b": ["gpu-2"]}
        s.allocate(RES, 1, pod_uid="uid-1", container_name="side")
        assert listed() == {"a": ["gpu-0", "gpu-1", "gpu-3"], "b": ["gpu-2"]}
        s.remove_pod("uid-1")
        assert listed() == {"b": ["gpu-2"]}
        s.allocate(RES, 1, pod_uid="uid-2", container_name="side", pod_name="b2")  # the pod's name as sent now
        assert listed() == {"b2": ["gpu-0", "gpu-2"]}


def test_pod_resources_rate_limit(plugin_dir: Path) -> None:
    """The kubelet's token bucket: ``burst`` calls at once, the rest refused at once with ResourceExhausted."""
    pr_sock = plugin_dir / "pod-resources" / "kubelet.sock"
    # 0.001 calls a second: no token comes back during the test.
    with KubeletSimulator(
        plugin_dir, pod_resources_socket=pr_sock, pod_resources_qps=0.001, pod_resources_burst=3
    ) as s:
        with grpc.insecure_channel(f"unix://{pr_sock}") as ch:
            stub = prpb_grpc.PodResourcesListerStub(ch)
            codes = []
            for _ in range(5):
                try:
                    stub.List(prpb.ListPodResourcesRequest(), timeout=5)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
                    assert exc.details() == "rejected by rate limit"
        assert codes == [grpc.StatusCode.OK] * 3 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
        assert [(c.method, c.admitted) for c in s.pod_resources_calls] == [("List", True)] * 3 + [("List", False)] * 2
