"""The HTTP endpoints against unkind clients: half requests, idle connections, resets, odd methods and
request lines, a full fd table; none of them may hold the agent's threads or fill its log."""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpumanager.api import display_pb2 as display
from gpumanager.metrics import http
from gpumanager.metrics.http import QueryServer


def _server(**kw: Any) -> QueryServer:
    def metrics() -> bytes:
        return b"# a page\n"

    server = QueryServer(
        kw.pop("addr", "127.0.0.1"),
        0,
        routes={"/version": lambda: display.VersionResponse(version="1")},
        metrics=kw.pop("metrics", metrics),
        health=lambda: (True, {}),
    )
    server.start()
    return server


@pytest.fixture
def server() -> Iterator[QueryServer]:
    s = _server()
    yield s
    s.stop()


def _ask(port: int, raw: bytes, *, host: str = "127.0.0.1", family: int = socket.AF_INET) -> bytes:
    with socket.socket(family, socket.SOCK_STREAM) as c:
        c.settimeout(5)
        c.connect((host, port))
        c.sendall(raw)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
        return out


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def _wait(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_half_requests_let_their_threads_go(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "CLIENT_TIMEOUT", 0.3)
    s = _server()
    clients = []
    try:
        for _ in range(20):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never ends its headers
            clients.append(c)
        _wait(lambda: _handler_threads() == 0, "threads of half requests were never let go")
        assert _ask(s.port, b"GET /healthz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")
    finally:
        for c in clients:
            c.close()
        s.stop()


def test_a_client_trickling_its_headers_is_cut_off_at_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "HEADER_DEADLINE", 0.5)
    s = _server()
    try:
        with socket.create_connection(("127.0.0.1", s.port)) as c:
            c.settimeout(5)
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            answer = b""
            try:
                while time.monotonic() - started < 5:
                    c.sendall(b"X")  # a header line that never ends, one byte at a time: never idle
                    time.sleep(0.05)
            except OSError:
                pass  # the server closed the connection
            try:
                while chunk := c.recv(65536):
                    answer += chunk
            except OSError:
                pass
            assert time.monotonic() - started < 2, "the trickling client kept its connection"
            assert answer == b"" or answer.startswith(b"HTTP/1.0 408"), answer
        assert _handler_threads() == 0
    finally:
        s.stop()


def _slow_scrapes(monkeypatch: pytest.MonkeyPatch) -> tuple[QueryServer, threading.Event]:
    """A server of 3 slots whose /metrics answers only once the returned event is set."""
    monkeypatch.setattr(http, "MAX_CONNECTIONS", 3)
    release = threading.Event()

    def slow_page() -> bytes:
        release.wait(10)
        return b"# a page\n"

    return _server(metrics=slow_page), release


def test_probes_are_answered_while_slow_clients_hold_every_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    s, release = _slow_scrapes(monkeypatch)
    busy: list[socket.socket] = []
    try:
        for _ in range(3):  # three scrapes in progress: every slot
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            busy.append(c)
        _wait(lambda: _handler_threads() == 3, "the scrapes are served")
        for _ in range(40):  # and clients that never finish their headers
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            busy.append(c)
        for path in (b"/healthz", b"/readyz", b"/healthz/"):
            assert _ask(s.port, b"GET " + path + b" HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200"), path
        assert _ask(s.port, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 503")
    finally:
        release.set()
        for c in busy:
            c.close()
        s.stop()


def test_connections_over_the_limit_are_answered_busy_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    s, release = _slow_scrapes(monkeypatch)
    scrapes = []
    try:
        for _ in range(3):
            c = socket.create_connection(("127.0.0.1", s.port))
            c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            scrapes.append(c)
        _wait(lambda: _handler_threads() == 3, "the scrapes are served")
        assert _ask(s.port, b"GET /version HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 503")
        release.set()
        _wait(lambda: _handler_threads() == 0, "the slots come back")
        assert _ask(s.port, b"GET /version HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")
    finally:
        release.set()
        for c in scrapes:
            c.close()
        s.stop()


def test_out_of_file_descriptors_does_not_spin(server: QueryServer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def no_fd() -> Any:
        calls.append(time.monotonic())
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(server._httpd, "get_request", no_fd)
    waiting = socket.create_connection(("127.0.0.1", server.port))  # the listener stays readable
    try:
        time.sleep(1.0)
        assert 1 <= len(calls) <= 30, f"{len(calls)} accept attempts in a second"
    finally:
        waiting.close()


def test_a_client_that_resets_fills_no_log(caplog: pytest.LogCaptureFixture) -> None:
    def slow_page() -> bytes:
        time.sleep(0.3)  # the client is gone by the time the page is written
        return b"x" * (1 << 20)

    s = _server(metrics=slow_page)
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(3):
                c = socket.create_connection(("127.0.0.1", s.port))
                c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()  # a reset
            time.sleep(0.6)  # each page is written after the client has gone
            _wait(lambda: _handler_threads() == 0, "the handlers finish")
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert loud == [], [r.getMessage() for r in loud]
    finally:
        s.stop()


def test_head_and_other_methods(server: QueryServer) -> None:
    head = _ask(server.port, b"HEAD /healthz HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") and head.endswith(b"\r\n\r\n"), head
    post = _ask(server.port, b"POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    assert post.startswith(b"HTTP/1.0 405") and b"Allow: GET, HEAD" in post
    for method in (b"TRACE", b"CONNECT", b"FOO", b"PROPFIND"):  # methods http.server knows nothing of
        answer = _ask(server.port, method + b" /metrics HTTP/1.0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.0 405") and b"Allow: GET, HEAD" in answer, (method, answer[:80])
        assert answer.endswith(b'{"error":"only GET and HEAD"}'), answer


def test_an_unreadable_request_line_gets_a_status_line(server: QueryServer) -> None:
    for raw in (b"GARBAGE\r\n\r\n", b"GET / HTTP/x\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"):
        answer = _ask(server.port, raw)
        assert answer.startswith(b"HTTP/1.0 400"), (raw, answer[:80])


def test_the_metrics_page_says_the_format_it_is_written_in(server: QueryServer) -> None:
    answer = _ask(server.port, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert b"Content-Type: text/plain; version=0.0.4; charset=utf-8" in answer


def test_an_ipv6_address_is_listened_on() -> None:
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    s = _server(addr="::1")
    try:
        answer = _ask(s.port, b"GET /healthz HTTP/1.0\r\n\r\n", host="::1", family=socket.AF_INET6)
        assert answer.startswith(b"HTTP/1.0 200")
    finally:
        s.stop()
