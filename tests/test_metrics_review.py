"""The metrics page, /usage, /graph and the HTTP server under odd and hostile conditions: several
allocations of one container, an NVML that stops answering, odd request targets."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.allocation.records import ContainerAllocation
from gpumanager.api import display_pb2
from gpumanager.device.types import GPUInfo
from gpumanager.metrics.collector import AgentCollector
from gpumanager.metrics.http import QueryServer
from gpumanager.metrics.page import MetricsPage
from gpumanager.metrics.usage import ContainerUsage, DeviceUsage, UsageSampler

GIB = 1 << 30
GPU0 = GPUInfo(0, "GPU-0000", "NVIDIA H100", 0, 80 * GIB, "00000000:01:00.0")
GPU1 = GPUInfo(1, "GPU-1111", "NVIDIA H100", 1, 80 * GIB, "00000000:02:00.0")
#: Long enough for any loaded machine to finish what takes microseconds; a hang never finishes.
PATIENCE = 60.0


class _Agent:
    """What the collector reads, with nothing started but the GPUs."""

    def __init__(self, gpus: list[GPUInfo]) -> None:
        self.gpus = gpus
        self.layout = None
        self.health = None
        self.plugins = None
        self.allocator = None


def _pod(uid: str, name: str, namespace: str = "ns", containers: tuple[str, ...] = ("c",)) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid, "name": name, "namespace": namespace},
        "spec": {"nodeName": "node-1", "containers": [{"name": c} for c in containers]},
        "status": {"phase": "Running"},
    }


def _series(page: str) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    return [
        (s.name, tuple(sorted(s.labels.items())))
        for family in text_string_to_metric_families(page)
        for s in family.samples
    ]


def _samples(page: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name == name
    }


# -- one container, several allocations on one GPU ------------------------------------------------


def _two_claims_one_gpu() -> list[ContainerUsage]:
    """A container using two DRA claims that both share GPU 0 (an allocation per claim)."""
    pod = _pod("uid-1", "p")
    used = DeviceUsage(GPU0, 3 * (1 << 20), 0.25, 25.0, (101,))
    a = ContainerAllocation("uid-1", "c", (0,), 30, 1 * GIB, namespace="ns", pod_name="p", extra={"claim": "a"})
    b = ContainerAllocation("uid-1", "c", (0,), 20, 2 * GIB, namespace="ns", pod_name="p", extra={"claim": "b"})
    return [ContainerUsage(pod, a, (used,)), ContainerUsage(pod, b, (used,))]


def test_container_with_two_allocations_on_one_gpu_has_one_series_per_family() -> None:
    usages = _two_claims_one_gpu()
    page = MetricsPage(agent=_Agent([]), registry=CollectorRegistry(), sample=lambda: usages, legacy_metrics=False)
    text = page.render().decode()
    series = _series(text)
    duplicates = {s for s in series if series.count(s) > 1}
    assert not duplicates, duplicates
    key = (("container", "c"), ("gpu", "0"), ("namespace", "ns"), ("pod", "p"), ("uuid", "GPU-0000"))
    # Its limits on the GPU are those of both claims; what its processes use is counted once.
    assert _samples(text, "gpu_manager_container_gpu_memory_limit_bytes") == {key: 3.0 * GIB}
    assert _samples(text, "gpu_manager_container_gpu_core_limit_ratio") == {key: 0.5}
    assert _samples(text, "gpu_manager_container_gpu_memory_used_bytes") == {key: 3.0 * (1 << 20)}
    assert _samples(text, "gpu_manager_container_gpu_utilization_ratio") == {key: 0.25}
    # A second scrape of the same sample (kept lines) says the same.
    again = page.render().decode()
    for name in ("gpu_manager_container_gpu_memory_limit_bytes", "gpu_manager_container_gpu_memory_used_bytes"):
        assert _samples(again, name) == _samples(text, name)


def test_container_with_a_whole_gpu_and_a_share_of_it_is_capped_at_the_gpu() -> None:
    pod = _pod("uid-1", "p")
    used = DeviceUsage(GPU0, 0, 0.0, 0.0, ())
    whole = ContainerAllocation("uid-1", "c", (0,), 100, 0, extra={"claim": "a"})
    share = ContainerAllocation("uid-1", "c", (0,), 40, 4 * GIB, extra={"claim": "b"})
    usages = [ContainerUsage(pod, whole, (used,)), ContainerUsage(pod, share, (used,))]
    page = MetricsPage(agent=_Agent([]), registry=CollectorRegistry(), sample=lambda: usages, legacy_metrics=False)
    text = page.render().decode()
    assert list(_samples(text, "gpu_manager_container_gpu_memory_limit_bytes").values()) == [80.0 * GIB]
    assert list(_samples(text, "gpu_manager_container_gpu_core_limit_ratio").values()) == [1.0]


def test_container_with_a_whole_gpu_claim_and_an_admin_access_claim_on_it_has_one_series() -> None:
    """An adminAccess claim gets a whole GPU beside the claims already on it (it consumes nothing)."""
    pod = _pod("uid-1", "p")
    used = DeviceUsage(GPU0, 5 * (1 << 20), 0.5, 50.0, (101,))
    whole = ContainerAllocation("uid-1", "c", (0,), 100, 0, extra={"claim": "gpu"})
    admin = ContainerAllocation("uid-1", "c", (0,), 100, 0, extra={"claim": "monitor"})
    usages = [ContainerUsage(pod, whole, (used,)), ContainerUsage(pod, admin, (used,))]
    page = MetricsPage(agent=_Agent([]), registry=CollectorRegistry(), sample=lambda: usages, legacy_metrics=False)
    text = page.render().decode()
    series = _series(text)
    assert len(series) == len(set(series)), "a series is written twice"
    key = (("container", "c"), ("gpu", "0"), ("namespace", "ns"), ("pod", "p"), ("uuid", "GPU-0000"))
    assert _samples(text, "gpu_manager_container_gpu_memory_limit_bytes") == {key: 80.0 * GIB}
    assert _samples(text, "gpu_manager_container_gpu_core_limit_ratio") == {key: 1.0}
    assert _samples(text, "gpu_manager_container_gpu_memory_used_bytes") == {key: 5.0 * (1 << 20)}


def test_container_with_allocations_on_different_gpus_has_a_series_for_each() -> None:
    pod = _pod("uid-1", "p")
    a = ContainerAllocation("uid-1", "c", (0,), 30, 1 * GIB, extra={"claim": "a"})
    b = ContainerAllocation("uid-1", "c", (1,), 20, 2 * GIB, extra={"claim": "b"})
    usages = [
        ContainerUsage(pod, a, (DeviceUsage(GPU0, 0, 0.0, 0.0, ()),)),
        ContainerUsage(pod, b, (DeviceUsage(GPU1, 0, 0.0, 0.0, ()),)),
    ]
    page = MetricsPage(agent=_Agent([]), registry=CollectorRegistry(), sample=lambda: usages, legacy_metrics=False)
    limits = _samples(page.render().decode(), "gpu_manager_container_gpu_memory_limit_bytes")
    assert sorted((dict(k)["gpu"], v) for k, v in limits.items()) == [("0", 1.0 * GIB), ("1", 2.0 * GIB)]


# -- an NVML that stops answering --------------------------------------------------------------------


@pytest.fixture
def hung_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """hang(name): the pynvml function ``name`` blocks until the test ends (then fails as a lost GPU)."""
    release = threading.Event()
    try:
        import gpumanager.metrics.bounded as bounded
    except ImportError:  # nothing bounds the NVML calls of a scrape: the test finds the hang
        pass
    else:
        monkeypatch.setattr(bounded, "DEADLINE", 0.2)

    def hang(name: str) -> None:
        def blocked(*args: object, **kwargs: object) -> Any:
            release.wait()
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

        monkeypatch.setattr(pynvml, name, blocked)

    yield hang
    release.set()


def _finishes(fn: Callable[[], Any]) -> tuple[bool, Any]:
    """(whether fn returned in PATIENCE seconds, its result)."""
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    thread.start()
    thread.join(PATIENCE)
    return (not thread.is_alive() and bool(box)), (box[0] if box else None)


def _sampler(tmp_path: Path) -> UsageSampler:
    pod = _pod("uid-1", "p")
    alloc = ContainerAllocation("uid-1", "c", (0,), 30, 1 * GIB, namespace="ns", pod_name="p")
    return UsageSampler(
        gpus=[GPU0],
        allocations=lambda: [alloc],
        pod=lambda uid: pod if uid == "uid-1" else None,
        cgroup_root=tmp_path,
        sample_period=1.0,
    )


def test_usage_sample_answers_while_nvml_hangs(tmp_path: Path, hung_nvml: Callable[[str], None]) -> None:
    hung_nvml("nvmlDeviceGetHandleByIndex")
    sampler = _sampler(tmp_path)
    for _ in range(2):  # the first waits for NVML a while, the next knows it hangs
        done, usages = _finishes(sampler.sample)
        assert done, "a usage sample waits for NVML forever"
        (usage,) = usages
        # Its usage is unknown (left out, as for a lost GPU); its allocation is still there.
        assert [d.measured for d in usage.devices] == [False]


def test_metrics_page_answers_while_nvml_hangs(tmp_path: Path, hung_nvml: Callable[[str], None]) -> None:
    hung_nvml("nvmlDeviceGetHandleByIndex")
    sampler = _sampler(tmp_path)
    page = MetricsPage(agent=_Agent([GPU0]), registry=CollectorRegistry(), sample=sampler.sample, legacy_metrics=True)
    done, body = _finishes(page.render)
    assert done, "a scrape waits for NVML forever"
    text = body.decode()
    assert _samples(text, "gpu_manager_gpu_memory_bytes") == {(("gpu", "0"), ("uuid", "GPU-0000")): 80.0 * GIB}
    assert not _samples(text, "gpu_manager_gpu_memory_used_bytes")
    assert len(_samples(text, "gpu_manager_container_gpu_memory_limit_bytes")) == 1
    assert not _samples(text, "gpu_manager_container_gpu_memory_used_bytes")
    done, _ = _finishes(page.render)
    assert done


def test_agent_collector_answers_while_nvml_hangs(
    monkeypatch: pytest.MonkeyPatch, hung_nvml: Callable[[str], None]
) -> None:
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    hung_nvml("nvmlDeviceGetMemoryInfo")
    collector = AgentCollector(_Agent([GPU0, GPU1]))
    done, families = _finishes(lambda: list(collector.collect()))
    assert done, "the agent's families wait for NVML forever"
    by_name = {f.name: f for f in families}
    assert len(by_name["gpu_manager_gpu_info"].samples) == 2
    assert not by_name["gpu_manager_gpu_memory_used_bytes"].samples


def test_graph_answers_while_nvml_hangs(hung_nvml: Callable[[str], None]) -> None:
    from gpumanager.metrics.endpoints import DisplayData

    hung_nvml("nvmlDeviceGetHandleByIndex")
    seen: list[dict[int, Any]] = []

    def graph(usages: Any) -> str:
        seen.append(dict(usages))
        return "ROOT:1\n"

    data = DisplayData([GPU0], graph, lambda: [])
    done, text = _finishes(data.graph_text)
    assert done, "/graph waits for NVML forever"
    assert text == "ROOT:1\n" and seen == [{}]


# -- the HTTP server -------------------------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[QueryServer]:
    srv = QueryServer(
        "127.0.0.1",
        0,
        routes={"/version": lambda: display_pb2.VersionResponse(version="abc1234")},
        metrics=lambda: b"# HELP up_x x\n# TYPE up_x gauge\nup_x 1\n",
        health=lambda: (True, {}),
    )
    srv.start()
    yield srv
    srv.stop()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as conn:
        conn.sendall(request)
        out = b""
        while chunk := conn.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    ("target", "status"),
    [
        (b"http://127.0.0.1/metrics", b" 200 "),
        (b"http://localhost:5678/metric?x=1", b" 200 "),
        (b"HTTP://gpu-manager.kube-system/version", b" 200 "),
        (b"http://localhost:5678", b" 404 "),
        (b"http://localhost:5678/nothing", b" 404 "),
    ],
)
def test_absolute_form_request_target_is_served(server: QueryServer, target: bytes, status: bytes) -> None:
    """RFC 9112 3.2.2: a server must accept a request target in absolute form (proxies send it)."""
    answer = _raw(server.port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status in answer.split(b"\r\n", 1)[0] + b" ", answer[:200]


@pytest.mark.parametrize(
    ("request_bytes", "status_line"),
    [
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03 <b>x</b>\r\n\r\n", b"HTTP/1.0 400 Bad Request"),
        (b"GET /metrics HTTP/2.0\r\n\r\n", b"HTTP/1.0 505 HTTP Version Not Supported"),
        (b"GET /metrics HTTP/x.y\r\n\r\n", b"HTTP/1.0 400 Bad Request"),
        (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", b"HTTP/1.0 414 Request-URI Too Long"),
    ],
)
def test_unreadable_requests_are_answered_in_json(
    server: QueryServer, request_bytes: bytes, status_line: bytes
) -> None:
    """Like every other answer; the status line carries the standard reason, not the request's bytes."""
    answer = _raw(server.port, request_bytes)
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == status_line
    assert b"Content-Type: application/json" in lines
    assert b"Connection: close" in lines
    assert "error" in json.loads(body)


def test_a_host_name_listens_on_its_ipv4_address_where_it_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--query-addr=localhost`` (the default) on a host whose resolver lists ::1 first, as most do:
    gpu-manager (Go's net.Listen) listened on 127.0.0.1, where local scrapers and curl look."""
    real = socket.getaddrinfo

    def ipv6_first(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "localhost":
            return real(host, port, *args, **kwargs)
        stream, tcp = socket.SOCK_STREAM, socket.IPPROTO_TCP
        return [
            (socket.AF_INET6, stream, tcp, "", ("::1", port, 0, 0)),
            (socket.AF_INET, stream, tcp, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", ipv6_first)
    srv = QueryServer("localhost", 0, routes={}, metrics=lambda: b"", health=lambda: (True, {}))
    srv.start()
    try:
        answer = _raw(srv.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    finally:
        srv.stop()
    assert answer.startswith(b"HTTP/1.0 200 ")
