"""The query port as an operator's tools meet it: gpu-manager's gateway JSON byte for byte, a scrape
configured with the wrong scheme, the empty line some clients send before a request."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpumanager.api import display_pb2 as display
from gpumanager.metrics.http import QueryServer
from simnode.cluster import SimCluster, gpu_pod


@pytest.fixture
def server() -> Iterator[QueryServer]:
    s = QueryServer(
        "127.0.0.1",
        0,
        routes={
            "/version": lambda: display.VersionResponse(version="3eda4fe"),
            "/graph": lambda: display.GraphResponse(graph="ROOT:1\n|---GPU0 (pids: [])\n"),
            "/usage": lambda: display.UsageResponse(),
        },
        metrics=lambda: b"# HELP a b\n# TYPE a gauge\na 1\n",
        health=lambda: (True, {}),
    )
    s.start()
    yield s
    s.stop()


def _exchange(port: int, data: bytes, *, wait: float = 5.0) -> tuple[bytes, float]:
    """Send ``data`` (the connection left open for writing, as a waiting client leaves it) and read the
    answer until the server closes; (answer, seconds it took)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
    return out, time.monotonic() - start


def _body(answer: bytes) -> bytes:
    return answer.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/version", b'{"version":"3eda4fe"}'),
        ("/graph", b'{"graph":"ROOT:1\\n|---GPU0 (pids: [])\\n"}'),
        ("/usage", b"{}"),
    ],
)
def test_display_paths_answer_compact_json_as_the_gateway_did(server: QueryServer, path: str, expected: bytes) -> None:
    """grpc-gateway v1 wrote compact JSON (docs/monitoring.md shows ``{"version":"3eda4fe"}``): scripts
    that match the text (``grep '"version":"'``) keep working after the upgrade."""
    answer, _ = _exchange(server.port, f"GET {path} HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert _body(answer) == expected


def test_usage_keeps_non_ascii_text_as_utf8(server: QueryServer) -> None:
    """The gateway wrote UTF-8 text as it is (a cluster name or a SUBMITTER with accents), not ``\\u`` escapes."""
    usage = display.UsageResponse()
    usage.usage["uid-1"].cluster = "équipe"
    server._routes["/usage"] = lambda: usage
    answer, _ = _exchange(server.port, b"GET /usage HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert _body(answer) == '{"usage":{"uid-1":{"cluster":"équipe"}}}'.encode()


def test_error_answers_are_compact_json_too(server: QueryServer) -> None:
    answer, _ = _exchange(server.port, b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 404 ")
    body = _body(answer)
    assert body.startswith(b'{"error":"no endpoint /nope;'), body
    assert json.loads(body)["error"].startswith("no endpoint /nope")


# A TLS 1.2 ClientHello's first bytes: a handshake record (0x16), version 3.1, then the hello. A real one
# carries random bytes that may hold no newline at all, so the request line never ends.
_CLIENT_HELLO = bytes.fromhex("160301 00a5 01 0000a1 0303") + bytes(range(32)).replace(b"\n", b"\x00") + b"\x00" * 64


def test_a_tls_handshake_is_answered_at_once_in_plain_http(server: QueryServer) -> None:
    """A scrape job set to ``scheme: https`` by mistake: answered 400 at once, in plain HTTP (Go's TLS
    client then says "server gave HTTP response to HTTPS client"), not after the 10 s header deadline,
    which is Prometheus' default scrape timeout (the operator saw only "context deadline exceeded")."""
    answer, took = _exchange(server.port, _CLIENT_HELLO, wait=8.0)
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    assert took < 5.0
    error = json.loads(_body(answer))["error"]
    assert "plain HTTP" in error and "https" in error, error


def test_a_tls_handshake_does_not_hold_a_slot_while_scrapes_go_on(server: QueryServer) -> None:
    hellos = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(10)]
    try:
        for s in hellos:
            s.sendall(_CLIENT_HELLO)
        answer, _ = _exchange(server.port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 ")
        for s in hellos:
            assert s.recv(20).startswith(b"HTTP/1.0 400 ")
    finally:
        for s in hellos:
            s.close()


@pytest.mark.parametrize("lead", [b"\r\n", b"\n", b"\r\n\r\n"])
def test_empty_lines_before_the_request_line_are_ignored(server: QueryServer, lead: bytes) -> None:
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line before the request line (a client
    that ended its last request with an extra CRLF); it used to close the connection without a word."""
    answer, _ = _exchange(server.port, lead + b"GET /version HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    assert _body(answer) == b'{"version":"3eda4fe"}'


def test_a_request_of_empty_lines_alone_is_answered_400(server: QueryServer) -> None:
    """Empty lines and then nothing (the client gave up writing): a 400 naming what is missing, not a
    silent close that the client reads as a crash."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\r\n\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 400 "), answer[:200]
    assert "request line" in json.loads(_body(answer))["error"]


def _families(body: bytes) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _consistent(body: bytes) -> list[str]:
    """What a page says that its allocations cannot be: more than a whole GPU's compute or memory given
    to the containers on one GPU, limits beyond what the GPU's own allocated figures say."""
    page = _families(body)
    capacity = {labels["gpu"]: value for labels, value in page.get("gpu_manager_gpu_memory_bytes", [])}
    cores: dict[str, float] = {}
    memory: dict[str, float] = {}
    for labels, value in page.get("gpu_manager_container_gpu_core_limit_ratio", []):
        cores[labels["gpu"]] = cores.get(labels["gpu"], 0.0) + value
    for labels, value in page.get("gpu_manager_container_gpu_memory_limit_bytes", []):
        memory[labels["gpu"]] = memory.get(labels["gpu"], 0.0) + value
    wrong = [f"GPU {gpu}: container core limits add up to {total}" for gpu, total in cores.items() if total > 1 + 1e-9]
    wrong += [
        f"GPU {gpu}: container memory limits {total} > {capacity.get(gpu)}"
        for gpu, total in memory.items()
        if total > capacity.get(gpu, 0)
    ]
    return wrong


def test_series_of_deleted_pods_vanish_and_scrapes_during_churn_stay_consistent(
    tmp_path: Path, sim_built: Path
) -> None:
    """Pods created and deleted in a burst while three scrapers read the page: every page parses and no
    GPU has more than its compute or memory given out in the per-container series; once the pods are gone
    the page has no series of theirs, /usage is empty, and the page is the size it was."""
    with SimCluster(tmp_path, "h100-nvlink-x8", status_lag=0) as c:
        assert c.agent is not None
        url = f"http://127.0.0.1:{c.agent.query_port}"
        before = urllib.request.urlopen(url + "/metrics", timeout=10).read()
        stop = threading.Event()
        wrong: list[str] = []
        scrapes = [0]

        def scrape() -> None:
            while not stop.is_set():
                try:
                    wrong.extend(_consistent(urllib.request.urlopen(url + "/metrics", timeout=10).read()))
                    scrapes[0] += 1
                except Exception as exc:  # a failed scrape is a finding too
                    wrong.append(repr(exc))

        threads = [threading.Thread(target=scrape, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for i in range(25):
                runs = [
                    c.run_pod(gpu_pod(f"churn{i}-{j}", [("main", 25, 2), ("side", 25, 2)], namespace=f"ns{i % 3}"))
                    for j in range(4)
                ]
                for run in runs:
                    c.delete(run, wait=True)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=20)
        assert not wrong, wrong[:5]
        assert scrapes[0] > 25
        deadline = time.monotonic() + 20
        while True:
            after = urllib.request.urlopen(url + "/metrics", timeout=10).read()
            left = [line for line in after.decode().splitlines() if 'pod="churn' in line]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, left[:5]
        assert json.loads(urllib.request.urlopen(url + "/usage", timeout=10).read()) == {}
        assert set(_families(after)) == set(_families(before))
        assert len(after) < len(before) * 1.1
