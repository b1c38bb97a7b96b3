"""Metric families: text format, upstream's legacy families byte for byte, usage attribution, the page."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gpumanager import buildinfo, names
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.devices import DeviceLayout
from gpumanager.metrics import legacy, textformat, usage
from gpumanager.metrics.calls import CallMetrics
from gpumanager.metrics.containers import ContainerFamilies, usage_response
from gpumanager.metrics.page import MetricsPage
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage, UsageSampler
from gpumanager.vmanager import cgroups
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, v100x4

MIB = 1 << 20
H100 = 81559 * MIB
GPUS = [
    GPUInfo(i, f"GPU-{i:08d}-0000-0000-0000-000000000000", "NVIDIA H100", i, H100, f"0000:{i:02x}:00.0")
    for i in range(4)
]


def pod(
    name: str, namespace: str, uid: str, containers: list[str], ids: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {"nodeName": "sim-node", "containers": [{"name": c} for c in containers]},
        "status": {
            "qosClass": "Guaranteed",
            "containerStatuses": [{"name": c, "containerID": f"containerd://{i}"} for c, i in (ids or {}).items()],
        },
    }


def alloc(uid: str, container: str, minors: tuple[int, ...], cores: int, memory: int) -> ContainerAllocation:
    return ContainerAllocation(uid, container, minors, cores, memory)


def sample_usages() -> list[ContainerUsage]:
    metered = pod("metered", "default", "uid-a", ["main", "side"])
    whole = pod("whole", "ml", "uid-b", ["train"])
    return [
        ContainerUsage(
            metered,
            alloc("uid-a", "main", (3,), 50, 8 * names.MEMORY_BLOCK_BYTES),
            [DeviceUsage(GPUS[3], 1500 * MIB, 0.37, 37.0, (4001,))],
        ),
        ContainerUsage(
            whole,
            alloc("uid-b", "train", (1, 2), 200, 0),
            [DeviceUsage(GPUS[1], 0, 0.0, 0.0, ()), DeviceUsage(GPUS[2], 2 * MIB + 5, 0.25, 50.0, (4002, 4003))],
        ),
    ]


@pytest.mark.parametrize(
    ("value", "go"),
    [
        (0.0, "0"),
        (-0.0, "0"),
        (1.0, "1"),
        (0.5, "0.5"),
        (0.05, "0.05"),
        (37.0, "37"),
        (2048.0, "2048"),
        (163118.0, "163118"),
        (999999.0, "999999"),
        (1e6, "1e+06"),
        (1234567.0, "1.234567e+06"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (-2.5, "-2.5"),
        (float("inf"), "+Inf"),
        (float("nan"), "NaN"),
    ],
)
def test_go_float_is_strconv_format_float_g(value: float, go: str) -> None:
    assert textformat.go_float(value) == go


def test_label_values_are_escaped() -> None:
    assert textformat.labels(["a", "b"], ['x"y', "back\\slash\nnl"]) == '{a="x\\"y",b="back\\\\slash\\nnl"}'


# What tkestack gpu-manager 1.x wrote for sample_usages() (client_golang text format).
LEGACY = (Path(__file__).parent / "data" / "legacy-metrics.prom").read_text()


def test_legacy_families_are_upstreams_text_byte_for_byte() -> None:
    assert legacy.render(sample_usages()) == LEGACY


def test_legacy_families_are_absent_without_containers() -> None:
    assert legacy.render([]) == ""


def families(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_container_families_in_base_units_with_the_same_gpu_label() -> None:
    renderer = ContainerFamilies()
    text = renderer.render(sample_usages())
    assert renderer.render(sample_usages()) == text  # label sets reused, same text
    got = families(text)
    main = key(namespace="default", pod="metered", container="main", gpu="3", uuid=GPUS[3].uuid)
    train1 = key(namespace="ml", pod="whole", container="train", gpu="1", uuid=GPUS[1].uuid)
    train2 = key(namespace="ml", pod="whole", container="train", gpu="2", uuid=GPUS[2].uuid)
    assert got["gpu_manager_container_gpu_memory_limit_bytes"] == {main: 2048.0 * MIB, train1: H100, train2: H100}
    assert got["gpu_manager_container_gpu_core_limit_ratio"] == {main: 0.5, train1: 1.0, train2: 1.0}
    assert got["gpu_manager_container_gpu_memory_used_bytes"] == {
        main: 1500.0 * MIB,
        train1: 0.0,
        train2: 2.0 * MIB + 5,
    }
    assert got["gpu_manager_container_gpu_utilization_ratio"] == {main: 0.37, train1: 0.0, train2: 0.25}
    assert "node=" not in text and "total" not in text and "pod_name" not in text


def test_container_families_have_headers_without_containers() -> None:
    text = ContainerFamilies().render([])
    assert text.count("# TYPE ") == 4 and "{" not in text


# -- attribution of GPU processes to containers -------------------------------------------------


class FakeNode:
    """NVML processes per GPU and cgroup PIDs per container, with a count of cgroup readings."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.procs: dict[int, dict[int, int]] = {}
        self.samples: dict[int, dict[int, list[float]]] = {}
        self.cgroup_pids: dict[str, list[int]] = {}
        self.cgroup_reads = 0
        self.now = 1000.0
        self.lost: set[int] = set()  # GPUs NVML answers GPU_IS_LOST for
        monkeypatch.setattr(usage, "_sample_gpu", self._sample_gpu)
        monkeypatch.setattr(cgroups.CgroupLocator, "pids", self._pids)

    def _sample_gpu(self, index: int, since_us: int) -> Any:
        if index in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        sm = self.samples.get(index, {})
        return usage._GPUSample(
            dict(self.procs.get(index, {})), {p: sum(v) for p, v in sm.items()}, {p: len(v) for p, v in sm.items()}
        )

    def _pids(self, pod_uid: str, container_id: str, qos: str | None = None) -> list[int]:
        self.cgroup_reads += 1
        return list(self.cgroup_pids.get(container_id, []))


@pytest.fixture
def node(monkeypatch: pytest.MonkeyPatch) -> FakeNode:
    return FakeNode(monkeypatch)


def sampler_for(
    node: FakeNode,
    allocs: list[ContainerAllocation],
    pods: dict[str, dict[str, Any]],
    version: Callable[[], Hashable] | None = None,
) -> UsageSampler:
    return UsageSampler(
        gpus=GPUS,
        allocations=lambda: list(allocs),
        pod=pods.get,
        cgroup_root=Path("/nonexistent"),
        sample_period=1.0,
        clock=lambda: node.now,
        version=version,
    )


def by_key(usages: list[ContainerUsage]) -> dict[tuple[str, str], list[DeviceUsage]]:
    return {u.allocation.key: u.devices for u in usages}


def test_gpu_processes_are_attributed_to_their_containers(node: FakeNode) -> None:
    pods = {"a": pod("a", "default", "a", ["main"], {"main": "cid-a"}), "b": pod("b", "ns", "b", ["w"], {"w": "cid-b"})}
    allocs = [alloc("a", "main", (0,), 30, 4 * names.MEMORY_BLOCK_BYTES), alloc("b", "w", (0, 1), 200, 0)]
    node.cgroup_pids = {"cid-a": [10, 11], "cid-b": [20]}
    node.procs = {0: {10: 100 * MIB, 11: 50 * MIB, 20: 7 * MIB, 99: 999 * MIB}, 1: {20: 3 * MIB}}
    node.samples = {0: {10: [30.0, 50.0], 11: [10.0], 99: [90.0]}, 1: {20: [60.0, 60.0]}}
    got = by_key(sampler_for(node, allocs, pods).sample())
    (a0,) = got[("a", "main")]
    assert (a0.gpu.index, a0.used_bytes, a0.pids) == (0, 150 * MIB, (10, 11))
    assert a0.sm_ratio == pytest.approx(0.5)  # mean 40 % + 10 %
    assert a0.sm_samples_sum == 90.0  # gpu-manager's figure: every sample added up
    b0, b1 = got[("b", "w")]
    assert (b0.used_bytes, b0.pids, b0.sm_ratio) == (7 * MIB, (20,), 0.0)
    assert (b1.used_bytes, b1.sm_ratio, b1.sm_samples_sum) == (3 * MIB, pytest.approx(0.6), 120.0)


def test_cgroups_are_read_again_only_when_something_changed(node: FakeNode) -> None:
    pods = {"a": pod("a", "default", "a", ["main"], {"main": "cid-a"})}
    allocs = [alloc("a", "main", (0,), 30, 4 * names.MEMORY_BLOCK_BYTES)]
    node.cgroup_pids = {"cid-a": [10]}
    node.procs = {0: {10: MIB, 99: MIB}}  # 99: a process of no container
    sampler = sampler_for(node, allocs, pods)
    for _ in range(5):
        sampler.sample()
    assert sampler.scans == 1  # the stranger 99 does not make every scrape read the cgroups

    node.cgroup_pids["cid-a"] = [10, 12]
    node.procs[0][12] = 5 * MIB  # a new process: read again, and it is counted at once
    assert by_key(sampler.sample())[("a", "main")][0].used_bytes == 6 * MIB
    assert sampler.scans == 2

    pods["b"] = pod("b", "default", "b", ["c"], {"c": "cid-b"})
    allocs.append(alloc("b", "c", (1,), 30, 4 * names.MEMORY_BLOCK_BYTES))
    node.cgroup_pids["cid-b"] = [99]  # the stranger turns out to be b's, now that b's ID is known
    node.procs[1] = {99: MIB}
    assert by_key(sampler.sample())[("b", "c")][0].pids == (99,)
    assert sampler.scans == 3

    sampler.sample()
    assert sampler.scans == 3
    node.now += usage.RESCAN_SECONDS
    sampler.sample()
    assert sampler.scans == 4  # never trusted longer than the rescan period


def test_a_restarted_container_is_read_again(node: FakeNode) -> None:
    pods = {"a": pod("a", "default", "a", ["main"], {"main": "cid-1"})}
    allocs = [alloc("a", "main", (0,), 30, 4 * names.MEMORY_BLOCK_BYTES)]
    node.cgroup_pids = {"cid-1": [10], "cid-2": [11]}
    node.procs = {0: {10: MIB, 11: 2 * MIB}}
    sampler = sampler_for(node, allocs, pods)
    assert by_key(sampler.sample())[("a", "main")][0].pids == (10,)
    pods["a"] = pod("a", "default", "a", ["main"], {"main": "cid-2"})
    assert by_key(sampler.sample())[("a", "main")][0].pids == (11,)


def four_containers(node: FakeNode) -> tuple[list[ContainerAllocation], dict[str, dict[str, Any]]]:
    """a on GPU 0, b and c on GPU 1, d on GPU 2; one process each, on its GPU."""
    names_gpus = {"a": 0, "b": 1, "c": 1, "d": 2}
    pods = {n: pod(n, "default", n, ["main"], {"main": f"cid-{n}"}) for n in names_gpus}
    allocs = [alloc(n, "main", (g,), 30, 4 * names.MEMORY_BLOCK_BYTES) for n, g in names_gpus.items()]
    node.cgroup_pids = {f"cid-{n}": [100 + i] for i, n in enumerate(names_gpus)}
    node.procs = {0: {100: MIB}, 1: {101: MIB, 102: MIB}, 2: {103: MIB}}
    return allocs, pods


def test_a_new_process_is_looked_for_only_in_the_containers_holding_its_gpu(node: FakeNode) -> None:
    allocs, pods = four_containers(node)
    sampler = sampler_for(node, allocs, pods)
    sampler.sample()
    assert node.cgroup_reads == 4
    node.cgroup_pids["cid-c"].append(202)
    node.procs[1][202] = 2 * MIB  # c starts a second process on GPU 1
    assert by_key(sampler.sample())[("c", "main")][0].pids == (102, 202)
    assert node.cgroup_reads == 4 + 2  # b and c, the containers of GPU 1


def test_a_reused_pid_is_placed_in_its_new_container_at_once(node: FakeNode) -> None:
    allocs, pods = four_containers(node)
    sampler = sampler_for(node, allocs, pods)
    assert by_key(sampler.sample())[("b", "main")][0].pids == (101,)
    del node.procs[1][101]  # b's process ends ...
    node.cgroup_pids["cid-b"] = []
    sampler.sample()
    node.cgroup_pids["cid-c"].append(101)  # ... and c's new process gets its PID, well within the rescan period
    node.procs[1][101] = 5 * MIB
    got = by_key(sampler.sample())
    assert got[("b", "main")][0].pids == () and got[("c", "main")][0].pids == (101, 102)


def test_only_containers_with_a_gpu_process_are_read_again_after_the_rescan_period(node: FakeNode) -> None:
    allocs, pods = four_containers(node)
    node.procs[2] = {}  # d runs no GPU process
    sampler = sampler_for(node, allocs, pods)
    sampler.sample()
    reads = node.cgroup_reads
    node.now += usage.RESCAN_SECONDS
    sampler.sample()
    assert node.cgroup_reads == reads + 3  # a, b and c confirm their processes; d's PIDs do not matter
    node.procs[2] = {103: MIB}  # until one of them shows up on a GPU: then it is confirmed
    assert by_key(sampler.sample())[("d", "main")][0].pids == (103,)
    assert node.cgroup_reads == reads + 4


def test_readings_taken_together_fall_due_over_several_scrapes_within_the_rescan_period(node: FakeNode) -> None:
    pods = {f"p{i}": pod(f"p{i}", "default", f"p{i}", ["main"], {"main": f"cid-{i}"}) for i in range(40)}
    allocs = [alloc(f"p{i}", "main", (i % 4,), 10, 0) for i in range(40)]
    node.cgroup_pids = {f"cid-{i}": [1000 + i] for i in range(40)}
    node.procs = {g: {1000 + i: MIB for i in range(40) if i % 4 == g} for g in range(4)}
    sampler = sampler_for(node, allocs, pods)
    sampler.sample()
    assert node.cgroup_reads == 40
    per_scrape = []
    for _ in range(8):  # a scrape every eighth of the rescan period
        node.now += usage.RESCAN_SECONDS / 8
        reads = node.cgroup_reads
        sampler.sample()
        per_scrape.append(node.cgroup_reads - reads)
    assert per_scrape[:3] == [0, 0, 0]  # each reading is trusted for at least half the period
    assert sum(per_scrape[:8]) >= 40  # and none for longer than the period
    assert max(per_scrape) < 20, per_scrape  # not all in one scrape


# -- what a sample keeps between scrapes ----------------------------------------------------------


def two_containers(node: FakeNode) -> tuple[list[ContainerAllocation], dict[str, dict[str, Any]]]:
    pods = {"a": pod("a", "default", "a", ["main"], {"main": "cid-a"}), "b": pod("b", "ns", "b", ["w"], {"w": "cid-b"})}
    allocs = [alloc("a", "main", (0,), 30, 4 * names.MEMORY_BLOCK_BYTES), alloc("b", "w", (1,), 20, 0)]
    node.cgroup_pids = {"cid-a": [10], "cid-b": [20]}
    node.procs = {0: {10: MIB}, 1: {20: MIB}}
    return allocs, pods


def test_usage_is_read_on_every_sample_while_the_containers_are_looked_up_once(node: FakeNode) -> None:
    allocs, pods = two_containers(node)
    lookups: list[str] = []

    def lookup(uid: str) -> dict[str, Any] | None:
        lookups.append(uid)
        return pods.get(uid)

    sampler = UsageSampler(
        gpus=GPUS,
        allocations=lambda: list(allocs),
        pod=lookup,
        cgroup_root=Path("/nonexistent"),
        sample_period=1.0,
        clock=lambda: node.now,
        version=lambda: 7,  # the allocation state and the pod cache stay as they are
    )
    assert by_key(sampler.sample())[("a", "main")][0].used_bytes == MIB
    node.procs[0][10] = 3 * MIB  # what NVML says moves on all the same
    node.samples = {0: {10: [40.0]}}
    (a0,) = by_key(sampler.sample())[("a", "main")]
    assert (a0.used_bytes, a0.sm_ratio) == (3 * MIB, pytest.approx(0.4))
    node.procs[0] = {}
    assert by_key(sampler.sample())[("a", "main")][0].used_bytes == 0
    assert sampler.plans == 1 and sorted(lookups) == ["a", "b"]


def test_an_unchanged_container_is_handed_out_as_the_same_object(node: FakeNode) -> None:
    allocs, pods = two_containers(node)
    version = [1]
    sampler = sampler_for(node, allocs, pods, version=lambda: version[0])
    first = {u.allocation.key: u for u in sampler.sample()}
    node.procs[0][10] = 2 * MIB
    second = {u.allocation.key: u for u in sampler.sample()}
    assert second[("b", "w")] is first[("b", "w")]
    assert second[("a", "main")] is not first[("a", "main")]
    assert second[("a", "main")].devices[0].used_bytes == 2 * MIB

    # The allocation state moves on (a container more): the others stay the same objects.
    pods["c"] = pod("c", "ns", "c", ["x"], {"x": "cid-c"})
    allocs.append(alloc("c", "x", (2,), 10, 0))
    version[0] += 1
    third = {u.allocation.key: u for u in sampler.sample()}
    assert third[("a", "main")] is second[("a", "main")] and third[("b", "w")] is second[("b", "w")]
    assert ("c", "x") in third and sampler.plans == 2

    # A pod that changed (a new object in the cache) is a new usage, even with the same figures.
    pods["b"] = pod("b", "ns", "b", ["w"], {"w": "cid-b"})
    version[0] += 1
    assert {u.allocation.key: u for u in sampler.sample()}[("b", "w")] is not third[("b", "w")]


def test_kept_container_lines_are_what_a_fresh_renderer_writes(node: FakeNode) -> None:
    allocs, pods = two_containers(node)
    version = [1]
    sampler = sampler_for(node, allocs, pods, version=lambda: version[0])
    renderer = ContainerFamilies()
    renderer.render(sampler.sample())
    node.procs[0][10] = 2 * MIB  # a's usage changes
    pods["b"] = pod("b-renamed", "ns", "b", ["w"], {"w": "cid-b"})  # b's labels change
    version[0] += 1
    usages = sampler.sample()
    text = renderer.render(usages)
    assert text == ContainerFamilies().render(usages)
    got = families(text)["gpu_manager_container_gpu_memory_used_bytes"]
    assert got[key(namespace="default", pod="a", container="main", gpu="0", uuid=GPUS[0].uuid)] == 2 * MIB
    assert key(namespace="ns", pod="b-renamed", container="w", gpu="1", uuid=GPUS[1].uuid) in got
    assert renderer.render(sampler.sample()) == text  # nothing changed: the same text


def test_usage_on_a_lost_gpu_is_absent_not_zero(node: FakeNode) -> None:
    """A GPU NVML cannot read has no usage series (as gpu_manager_gpu_memory_used_bytes); the limits stay."""
    pods = {
        "a": pod("a", "default", "a", ["main"], {"main": "cid-a"}),
        "b": pod("b", "ns", "b", ["w"], {"w": "cid-b"}),
        "c": pod("c", "ns", "c", ["idle"], {"idle": "cid-c"}),
    }
    allocs = [
        alloc("a", "main", (0,), 30, 4 * names.MEMORY_BLOCK_BYTES),
        alloc("b", "w", (0, 1), 200, 0),
        alloc("c", "idle", (1,), 10, names.MEMORY_BLOCK_BYTES),
    ]
    node.cgroup_pids = {"cid-a": [10], "cid-b": [20, 21], "cid-c": []}
    node.procs = {0: {10: 100 * MIB, 20: 7 * MIB}, 1: {21: 3 * MIB}}
    node.samples = {0: {20: [50.0]}, 1: {21: [60.0]}}
    version = [1]
    sampler = sampler_for(node, allocs, pods, version=lambda: version[0])
    renderer = ContainerFamilies()
    renderer.render(sampler.sample())
    node.lost = {1}
    usages = sampler.sample()
    text = renderer.render(usages)
    assert text == ContainerFamilies().render(usages)
    got = families(text)
    a0 = key(namespace="default", pod="a", container="main", gpu="0", uuid=GPUS[0].uuid)
    b0 = key(namespace="ns", pod="b", container="w", gpu="0", uuid=GPUS[0].uuid)
    b1 = key(namespace="ns", pod="b", container="w", gpu="1", uuid=GPUS[1].uuid)
    c1 = key(namespace="ns", pod="c", container="idle", gpu="1", uuid=GPUS[1].uuid)
    assert got["gpu_manager_container_gpu_memory_used_bytes"] == {a0: 100.0 * MIB, b0: 7.0 * MIB}
    assert got["gpu_manager_container_gpu_utilization_ratio"] == {a0: 0.0, b0: 0.5}
    assert set(got["gpu_manager_container_gpu_memory_limit_bytes"]) == {a0, b0, b1, c1}
    assert set(got["gpu_manager_container_gpu_core_limit_ratio"]) == {a0, b0, b1, c1}

    lines = set(legacy.render(usages).splitlines())
    b = 'container_name="w",{},namespace="ns",node="sim-node",pod_name="b"'
    assert "container_gpu_memory_total{" + b.format('gpu_memory="gpu0"') + "} 7" in lines
    assert not [line for line in lines if 'gpu_memory="gpu1"' in line or 'gpu="gpu1"' in line]
    assert not [line for line in lines if 'pod_name="b"' in line and '"total"' in line and "request" not in line]
    assert any(line.startswith("container_request_gpu_memory{") and 'pod_name="c"' in line for line in lines)

    answer = usage_response(usages)  # /usage: no figures for the lost GPU
    assert [d.card_idx for d in answer.usage["b"].stat["w"].dev] == ["0"]

    node.lost = set()  # back: measured again
    got = families(renderer.render(sampler.sample()))
    assert got["gpu_manager_container_gpu_memory_used_bytes"][b1] == 3.0 * MIB
    assert got["gpu_manager_container_gpu_memory_used_bytes"][c1] == 0.0


def init_pod(init_state: str | None, *, sidecar: bool = False) -> dict[str, Any]:
    """Pod ``p``: init container ``setup`` (in state ``init_state``), app containers ``app`` and ``other``."""
    p = pod("p", "default", "p", ["app", "other"], {"app": "cid-app", "other": "cid-other"})
    p["spec"]["initContainers"] = [{"name": "setup", **({"restartPolicy": "Always"} if sidecar else {})}]
    if init_state is not None:
        p["status"]["initContainerStatuses"] = [
            {"name": "setup", "containerID": "containerd://cid-setup", "state": {init_state: {}}}
        ]
    return p


@pytest.mark.parametrize(
    ("init_state", "sidecar", "reported"),
    [
        (None, False, {"app", "other"}),  # allocated, nothing started: the share is app's
        ("waiting", False, {"app", "other"}),
        ("running", False, {"setup", "other"}),  # the init container uses the share now
        ("terminated", False, {"app", "other"}),  # and has handed it on
        ("running", True, {"setup", "app", "other"}),  # a sidecar's IDs are its own
    ],
)
def test_a_share_handed_on_within_a_pod_is_reported_once(
    node: FakeNode, init_state: str | None, sidecar: bool, reported: set[str]
) -> None:
    """An init container and the container the kubelet handed its IDs on to hold one share: one of them
    has series (sum by pod counts the share once), the one that runs or will."""
    pods = {"p": init_pod(init_state, sidecar=sidecar)}
    ids = ("core-1",) if not sidecar else ("core-2",)
    allocs = [
        ContainerAllocation("p", "setup", (1,), 30, 4 * names.MEMORY_BLOCK_BYTES, device_ids=("core-1",)),
        ContainerAllocation("p", "app", (1,), 30, 4 * names.MEMORY_BLOCK_BYTES, device_ids=ids),
        ContainerAllocation("p", "other", (2,), 20, 2 * names.MEMORY_BLOCK_BYTES, device_ids=("core-3",)),
    ]
    got = families(ContainerFamilies().render(sampler_for(node, allocs, pods).sample()))
    limits = got["gpu_manager_container_gpu_memory_limit_bytes"]
    assert {dict(labels)["container"] for labels in limits} == reported


def test_a_terminated_init_container_of_its_own_share_is_left_out(node: FakeNode) -> None:
    pods = {"p": init_pod("terminated")}
    allocs = [
        ContainerAllocation("p", "setup", (1,), 30, 4 * names.MEMORY_BLOCK_BYTES, device_ids=("core-1",)),
        ContainerAllocation("p", "app", (2,), 20, 4 * names.MEMORY_BLOCK_BYTES, device_ids=("core-2",)),
    ]
    usages = sampler_for(node, allocs, pods).sample()
    assert [u.container for u in usages] == ["app"]
    assert list(usage_response(usages).usage["p"].spec) == ["app"]


def test_a_container_using_two_claims_has_both_in_the_legacy_families_and_usage() -> None:
    """DRA: one container, two claims (a whole GPU and a share of another): one allocation each."""
    p = pod("two", "default", "uid-two", ["main"])
    whole = ContainerUsage(p, alloc("uid-two", "main", (0,), 100, 0), [DeviceUsage(GPUS[0], 3 * MIB, 0.1, 10.0, (7,))])
    share = ContainerUsage(
        p,
        alloc("uid-two", "main", (1,), 30, 4 * names.MEMORY_BLOCK_BYTES),
        [DeviceUsage(GPUS[1], 5 * MIB, 0.2, 20.0, (8,))],
    )
    lines = set(legacy.render([whole, share]).splitlines())
    labels = 'container_name="main",{}namespace="default",node="sim-node",pod_name="two"{}'
    h100_mib = H100 >> 20
    for line in (
        "container_gpu_memory_total{" + labels.format('gpu_memory="gpu0",', "") + "} 3",
        "container_gpu_memory_total{" + labels.format('gpu_memory="gpu1",', "") + "} 5",
        "container_gpu_memory_total{" + labels.format('gpu_memory="total",', "") + "} 8",
        "container_gpu_utilization{" + labels.format('gpu="total",', "") + "} 30",
        "container_request_gpu_utilization{" + labels.format("", ',req_of_gpu="total"') + "} 1.3",
        "container_request_gpu_memory{" + labels.format("", ',req_of_gpu_memory="total"') + f"}} {h100_mib + 1024}",
    ):
        assert line in lines, (line, sorted(lines))
    stat = usage_response([whole, share]).usage["uid-two"]
    assert [d.card_idx for d in stat.stat["main"].dev] == ["0", "1"]
    assert (stat.spec["main"].gpu, stat.spec["main"].mem) == (pytest.approx(1.3), 1024.0)


def test_a_scrape_waiting_on_nvml_holds_no_allocator_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pods = FakePods([make_pod(name, [("main", cores, 4)]) for name, cores in (("a", 50), ("b", 30), ("c", 20))])
    allocator = make_allocator(tmp_path, pods)
    allocator.allocate(core_ids(0, 50))
    hanging = {"memory": threading.Event(), "processes": threading.Event()}
    entered = {name: threading.Event() for name in hanging}

    def hang(name: str, answer: Any) -> Callable[..., Any]:
        def call(*_: Any) -> Any:
            entered[name].set()
            hanging[name].wait(10)
            return answer

        return call

    # NVML calls that hang, as they can while a GPU falls off the bus.
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: index)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", hang("memory", SimpleNamespace(used=0, total=0)))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUtilizationRates", lambda handle: SimpleNamespace(gpu=0, memory=0))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", hang("processes", []))
    agent = SimpleNamespace(gpus=v100x4()[0], layout=None, health=None, plugins=None, allocator=allocator)
    sampler = UsageSampler(
        gpus=agent.gpus,
        allocations=allocator.allocations,
        pod=pods.get,
        cgroup_root=tmp_path / "cgroup",
        sample_period=1.0,
        version=lambda: allocator.generation,
    )
    page = MetricsPage(agent=agent, registry=CollectorRegistry(), sample=sampler.sample, legacy_metrics=False)
    scrape = threading.Thread(target=page.render, daemon=True)
    scrape.start()
    # The per-container usage, then the GPU families: an Allocate meanwhile is answered.
    for name, device_ids in (("processes", core_ids(1, 30)), ("memory", core_ids(2, 20))):
        assert entered[name].wait(10)
        allocate = threading.Thread(target=allocator.allocate, args=(device_ids,), daemon=True)
        allocate.start()
        allocate.join(5)
        assert not allocate.is_alive(), f"Allocate waited for a scrape blocked in NVML ({name})"
        hanging[name].set()
    scrape.join(10)
    assert not scrape.is_alive()
    assert len(allocator.allocations()) == 3


# -- the whole page -------------------------------------------------------------------------------


class FakeAgent:
    def __init__(self) -> None:
        self.gpus = GPUS
        self.layout: DeviceLayout | None = DeviceLayout(GPUS)
        self.health = None
        self.plugins = None
        self.allocator = None


@pytest.fixture
def page_text() -> Iterator[str]:
    registry = CollectorRegistry()
    calls = CallMetrics(registry)
    calls.observe(names.VCORE_RESOURCE, "Allocate", 0.002, ok=False)
    page = MetricsPage(agent=FakeAgent(), registry=registry, sample=sample_usages, legacy_metrics=False)
    yield page.render().decode()


def test_page_has_build_info_process_metrics_and_no_created_series(page_text: str) -> None:
    got = families(page_text)
    assert got["gpu_manager_build_info"] == {key(version=buildinfo.version(), commit=buildinfo.commit()): 1.0}
    assert "process_resident_memory_bytes" in got and "process_start_time_seconds" in got
    assert "_created" not in page_text
    assert "\ncontainer_" not in page_text and "# TYPE container_" not in page_text  # legacy: off by default


def test_error_counters_have_every_series_from_the_start(page_text: str) -> None:
    errors = families(page_text)["gpu_manager_kubelet_call_errors_total"]
    assert errors == {
        key(resource=names.VCORE_RESOURCE, call="Allocate"): 1.0,
        key(resource=names.VCORE_RESOURCE, call="PreStartContainer"): 0.0,
        key(resource=names.VMEMORY_RESOURCE, call="Allocate"): 0.0,
        key(resource=names.VMEMORY_RESOURCE, call="PreStartContainer"): 0.0,
    }
    got = families(page_text)
    assert set(got["gpu_manager_xid_events_total"]) == {key(ignored="true"), key(ignored="false")}
    assert got["gpu_manager_checkpoint_write_failures_total"] == {(): 0.0}


def test_gpu_label_is_the_index_in_every_family(page_text: str) -> None:
    for name, series in families(page_text).items():
        for labels in series:
            d = dict(labels)
            assert "node" not in d, name
            if "gpu" in d:
                assert d["gpu"].isdigit() and d["uuid"] == GPUS[int(d["gpu"])].uuid, (name, d)


def test_legacy_families_follow_the_others_when_enabled() -> None:
    page = MetricsPage(agent=FakeAgent(), registry=CollectorRegistry(), sample=sample_usages, legacy_metrics=True)
    text = page.render().decode()
    assert text.endswith(LEGACY)


def test_family_text_is_what_generate_latest_writes() -> None:
    registry = CollectorRegistry()
    calls = CallMetrics(registry)
    calls.observe(names.VCORE_RESOURCE, "Allocate", 0.002, ok=False)
    MetricsPage(agent=FakeAgent(), registry=registry, sample=lambda: [], legacy_metrics=False)
    renderer = textformat.FamilyText()
    first = renderer.render(registry.collect())
    calls.observe(names.VMEMORY_RESOURCE, "PreStartContainer", 0.3, ok=True)
    second = renderer.render(registry.collect())  # cached label sets, new values

    # The process collector's values move between two collections: compare the rest.
    def stable(text: str) -> str:
        return "".join(ln for ln in text.splitlines(keepends=True) if not ln.startswith("process_"))

    assert stable(second) == stable(generate_latest(registry).decode())
    assert first != second


def test_family_text_writes_a_kept_line_again_only_when_its_value_changed() -> None:
    values = [1.0, 1.0, 2.5, 0.0, -0.0, -0.0, float("nan"), 1e21, 7.0]

    class Gauge(Collector):
        value = 0.0

        def collect(self) -> Iterator[Metric]:
            family = GaugeMetricFamily("some_ratio", "A value", labels=["gpu"])
            family.add_metric(["0"], self.value)
            family.add_metric(["1"], 1.0)
            yield family

    registry = CollectorRegistry()
    gauge = Gauge()
    registry.register(gauge)
    renderer = textformat.FamilyText()
    for value in values:
        gauge.value = value
        assert renderer.render(registry.collect()) == generate_latest(registry).decode(), value


# -- DRA claims ---------------------------------------------------------------------------------------

# Minors unlike the indices: the `gpu` label is the index, as in every other family.
CLAIM_GPUS = [
    GPUInfo(i, f"GPU-{i:08d}-0000-0000-0000-00000000c1a1", "NVIDIA H100", 10 + i, H100, f"0000:{i:02x}:00.0")
    for i in range(2)
]


def claim_page() -> str:
    from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
    from gpumanager.metrics.claims import ClaimCollector

    def dev(request: str, minor: int, cores: int, memory: int, whole: bool = False) -> ClaimDevice:
        return ClaimDevice(request, "node-a", f"gpu-{minor - 10}", minor, "" if whole else f"s-{request}", cores,
                           memory, whole)  # fmt: skip

    claims = [
        ClaimAllocation("uid-share", "ml", "share", (dev("gpu", 11, 30, 4 << 30),)),
        # two requests of one claim on the same GPU: one series, their sum
        ClaimAllocation("uid-two", "ml", "two", (dev("a", 10, 20, 1 << 30), dev("b", 10, 10, 1 << 30))),
        ClaimAllocation("uid-whole", "default", "whole", (dev("gpu", 10, 100, H100, whole=True),)),
    ]
    user = pod("trainer", "ml", "uid-p", ["main", "side"])
    user["spec"]["resourceClaims"] = [{"name": "g", "resourceClaimName": "share"}]
    for c in user["spec"]["containers"]:
        c["resources"] = {"claims": [{"name": "g"}]}
    registry = CollectorRegistry()
    registry.register(ClaimCollector(lambda: claims, lambda: [user], CLAIM_GPUS))
    return generate_latest(registry).decode()


def test_claim_families_label_gpus_by_index_and_uuid_as_every_family() -> None:
    families = {f.name: f for f in text_string_to_metric_families(claim_page())}
    cores, memory = families["gpu_manager_claim_gpu_core_ratio"], families["gpu_manager_claim_gpu_memory_bytes"]
    got = {(s.labels["claim"], s.labels["gpu"], s.labels["uuid"], s.labels["share"]): s.value for s in cores.samples}
    assert got == {
        ("share", "1", CLAIM_GPUS[1].uuid, "true"): 0.3,
        ("two", "0", CLAIM_GPUS[0].uuid, "true"): 0.3,
        ("whole", "0", CLAIM_GPUS[0].uuid, "false"): 1.0,
    }
    assert {s.labels["claim"]: s.value for s in memory.samples} == {"share": 4 << 30, "two": 2 << 30, "whole": H100}
    for family in (cores, memory):
        for s in family.samples:
            assert set(s.labels) == {"namespace", "claim", "claim_uid", "gpu", "uuid", "share"}
    (users,) = families["gpu_manager_claim_containers"].samples
    assert users.labels == {"namespace": "ml", "claim": "share", "claim_uid": "uid-share", "pod": "trainer"}
    assert users.value == 2


def test_legacy_families_are_written_again_only_for_a_sample_that_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's families were rebuilt, sorted and formatted on every scrape (p99 21 ms with 250
    containers); the sampler keeps a container's usage object while nothing of it changes."""
    same = sample_usages()
    current = [same]
    page = MetricsPage(agent=FakeAgent(), registry=CollectorRegistry(), sample=lambda: current[0], legacy_metrics=True)
    renders = []
    real = legacy.render

    def counted(usages: Any, node: str = "") -> str:
        renders.append(len(usages))
        return real(usages, node)

    monkeypatch.setattr(legacy, "render", counted)
    for _ in range(3):
        assert page.render().endswith(LEGACY.encode())
    assert len(renders) == 1
    current[0] = sample_usages()  # new objects: a new sample
    page.render()
    current[0] = []
    assert b"\ncontainer_" not in page.render()
    assert len(renders) == 3


def test_version_is_the_short_commit_else_the_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpumanager.metrics import query

    monkeypatch.setattr(buildinfo, "commit", lambda: "0123456789abcdef0123456789abcdef01234567")
    assert query.display_version() == "0123456"
    monkeypatch.setattr(buildinfo, "commit", lambda: buildinfo.UNKNOWN)
    assert query.display_version() == buildinfo.version()
