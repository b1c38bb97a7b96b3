"""A container started again from its saved answer on a smaller replacement GPU waits for room there
(UNAVAILABLE: the kubelet tries again), but not forever: --replaced-gpu-wait (5m) after its first refused
start, it is refused for good (FAILED_PRECONDITION, "PreStartContainer check failed"), naming the pod, the
container, the GPU, the room it needs and the room free there and how long it waited, so that the pod is
placed again instead of staying in ContainerCreating."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gpumanager import cli, names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.config import ConfigError
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.deviceplugin.handlers import Handlers
from gpumanager.deviceplugin.replaced import ReplacedGPUs, ReplacedRefusal
from gpumanager.deviceplugin.servicer import RequestError
from simnode.cluster import SimCluster, admission_annotations, gpu_pod
from simnode.kubelet import PluginRPCError
from tests.battery_fixtures import answered, gpu
from tests.test_gpu_replaced_review9 import _refusal, _restart_with, _spec

MIB = 1 << 20
OLD = GPUInfo(0, "GPU-old", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
NEW = GPUInfo(0, "GPU-new", "Tesla T4", 0, 8192 * MIB, "00000000:10:00.0", 0)  # the same device node


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _held(*pods: str, memory_mib: int = 6144) -> list[ContainerAllocation]:
    return [
        ContainerAllocation(pod, "c", (0,), 40, memory_mib * MIB, namespace="default", pod_name=pod, started=True)
        for pod in pods
    ]


def _guard(held: list[ContainerAllocation], clock: Clock, **kwargs: float) -> ReplacedGPUs:
    guard = ReplacedGPUs({0: OLD}, [NEW], [], lambda: held, clock=clock, **kwargs)
    guard.note_held(held)
    return guard


def test_a_start_waiting_for_room_is_refused_for_good_after_the_limit() -> None:
    held = _held("a", "b")
    clock = Clock()
    guard = _guard(held, clock)
    assert guard.check(held[0])
    guard.note_started(held[0])  # a runs on the 8 GiB replacement: 6 GiB of it
    for _ in range(3):
        with pytest.raises(ReplacedRefusal) as waits:
            guard.check(held[1])
        assert not waits.value.lasting
        clock.now += 100  # the kubelet tries again
    clock.now += 0.5  # 300.5 s since its first refused start
    with pytest.raises(ReplacedRefusal) as refused:
        guard.check(held[1])
    assert refused.value.lasting
    text = str(refused.value)
    for part in ("default/b", "container c", "GPU 0", "GPU-new", "8192 MiB", "default/a", "delete"):
        assert part in text, (part, text)
    assert "40 cores and 6144 MiB" in text and "60 cores and 2048 MiB free" in text, text
    assert "waited 5m" in text, text
    with pytest.raises(ReplacedRefusal) as again:  # the kubelet's next try, if any: still for good
        guard.check(held[1])
    assert again.value.lasting


def test_room_freed_before_the_limit_lets_it_start_and_the_wait_is_per_container() -> None:
    held = _held("a", "b", "c")
    clock = Clock()
    guard = _guard(held, clock, wait_limit=60)
    assert guard.check(held[0])
    guard.note_started(held[0])
    with pytest.raises(ReplacedRefusal):
        guard.check(held[1])
    clock.now += 50
    with pytest.raises(ReplacedRefusal) as c_waits:  # c's first refusal: its own wait starts now
        guard.check(held[2])
    assert not c_waits.value.lasting
    clock.now += 20  # b has waited 70 s, c 20 s
    with pytest.raises(ReplacedRefusal) as b_done:
        guard.check(held[1])
    assert b_done.value.lasting and "waited 1m10s" in str(b_done.value), str(b_done.value)
    with pytest.raises(ReplacedRefusal) as c_still:
        guard.check(held[2])
    assert not c_still.value.lasting
    del held[0]  # a's pod ended: room for c
    assert guard.check(held[1])  # b too may start now that there is room (the kubelet may still try it)
    guard.forget(held[0])


def test_the_refusal_for_good_is_failed_precondition_at_prestart(tmp_path: Path) -> None:
    """Through the handler: UNAVAILABLE while it waits, then PreStartContainer check failed."""
    from tests.alloc_fixtures import FakePods, core_ids, make_pod, uid_of
    from tests.test_lifecycle_review import _one_gpu

    ids = {"a": core_ids(0, 40), "b": core_ids(0, 40, start=40)}
    allocator = _one_gpu(tmp_path, FakePods([make_pod(name, [("c", 40, 24)]) for name in ids]))
    for mine in ids.values():
        allocator.allocate(mine)
    clock = Clock()
    guard = ReplacedGPUs({0: OLD}, [NEW], [], allocator.allocations, clock=clock, wait_limit=30)
    guard.note_held(allocator.allocations())

    def owner(resource: object, devs: object, pod: object, since: object, listed: object) -> tuple[str, str]:
        return next((uid_of(name), "c") for name, mine in ids.items() if set(mine) == set(devs))  # type: ignore[arg-type]

    handlers = Handlers(
        allocator=allocator, layout=DeviceLayout([NEW]), owner=owner, prepared=lambda a: None, replaced=guard
    )
    handlers.pre_start_core(pb.PreStartContainerRequest(devices_ids=ids["a"]))
    with pytest.raises(RequestError) as waits:
        handlers.pre_start_core(pb.PreStartContainerRequest(devices_ids=ids["b"]))
    assert waits.value.code == grpc.StatusCode.UNAVAILABLE
    clock.now += 31
    with pytest.raises(RequestError) as refused:
        handlers.pre_start_core(pb.PreStartContainerRequest(devices_ids=ids["b"]))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(refused.value).startswith(f"{names.PRESTART_FAILED}: "), str(refused.value)
    assert "waited 31s" in str(refused.value), str(refused.value)


def test_the_flag_is_read_and_checked() -> None:
    args = cli.build_parser().parse_args(["--replaced-gpu-wait=90s"])
    assert cli.config_from_args(args).replaced_gpu_wait == 90.0
    assert cli.config_from_args(cli.build_parser().parse_args([])).replaced_gpu_wait == 300.0
    assert cli.config_from_args(cli.build_parser().parse_args(["--replaced-gpu-wait=0"])).replaced_gpu_wait == 0
    with pytest.raises(ConfigError, match=r"--replaced-gpu-wait=-5"):
        cli.config_from_args(cli.build_parser().parse_args(["--replaced-gpu-wait=-5s"]))


def test_the_agent_refuses_for_good_after_its_flag(tmp_path: Path) -> None:
    """The agent's flag reaches the check: two 6 GiB shares on a GPU replaced by an 8 GiB one, the second
    start waits, and one second later is refused for good."""
    import time

    old = [gpu(i, memory_mib=16384) for i in range(2)]
    cluster = SimCluster(
        tmp_path / "node", _spec(tmp_path / "before.json", old), agent_flags=["--replaced-gpu-wait=1s"]
    )
    with cluster:
        runs = [
            cluster.run_pod(gpu_pod(f"s{i}", [("main", 40, 24)], annotations=admission_annotations([[0]], 1)))
            for i in range(2)
        ]
        assert [answered(r)["main"][0] for r in runs] == [(0,), (0,)]
        new = dict(gpu(7, memory_mib=8192), pci_bus_id=old[0]["pci_bus_id"], minor=0)
        _restart_with(cluster, tmp_path / "after.json", [new, old[1]])
        cluster.start_containers(runs[0])
        err: PluginRPCError = _refusal(cluster, runs[1])
        assert err.code == grpc.StatusCode.UNAVAILABLE, err
        time.sleep(1.2)
        err = _refusal(cluster, runs[1])
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION, err
        for part in (names.PRESTART_FAILED, "default/s1", "container main", new["uuid"], "waited"):
            assert part in err.details, (part, err.details)
