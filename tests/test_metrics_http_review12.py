"""The query port as Prometheus and curl meet it: the page gzip-compressed for a client that accepts it
(Prometheus always does), HTTP/1.1 with keep-alive, and clients that send a request and never read the
answer, which must not hold the threads that serve scrapes."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpumanager.api import display_pb2 as display
from gpumanager.metrics import http as mhttp
from gpumanager.metrics.http import QueryServer, accepts_gzip

#: A page of the size 250 containers make (about 176 KiB), of lines like the real ones.
PAGE = b"".join(
    b'container_gpu_memory_total{pod_name="bench-%03d",namespace="default",node="n",container_name="main"} %d\n'
    % (i % 125, i * 7919)
    for i in range(1800)
)


#: A page larger than a socket takes from a client that does not read (Linux lets the send buffer of a
#: loopback connection grow to some 3 MiB; a page of 176 KiB would fit there, on a remote link it need not).
BIG = b"x" * (6 << 20)


def _server(**kw: Any) -> QueryServer:
    server = QueryServer(
        "127.0.0.1",
        0,
        routes={
            "/version": lambda: display.VersionResponse(version="3eda4fe"),
            "/graph": lambda: display.GraphResponse(graph="ROOT:1\n" + "|---GPU0 (pids: [])\n" * 500),
        },
        metrics=kw.pop("metrics", lambda: PAGE),
        health=lambda: (True, {}),
    )
    server.start()
    return server


@pytest.fixture
def server() -> Iterator[QueryServer]:
    s = _server()
    yield s
    s.stop()


def _handler_threads() -> int:
    return sum(1 for t in threading.enumerate() if "process_request_thread" in t.name)


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", path, headers=headers or {})
    return conn.getresponse()


def _read_answer(sock: socket.socket) -> tuple[bytes, bytes]:
    """One answer read by its Content-Length from ``sock``: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before the end of the headers: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed before the end of the body"
        body += chunk
    assert len(body) == length, "more bytes than the Content-Length"
    return head, body


def _read_answers(sock: socket.socket, count: int) -> list[tuple[bytes, bytes]]:
    """``count`` answers read by their Content-Length from ``sock``, whatever reads they come in."""
    data = b""
    answers = []
    while len(answers) < count:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {len(answers)} answers"
        data += chunk
        while b"\r\n\r\n" in data:
            head, _, rest = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            if len(rest) < length:
                break
            answers.append((head, rest[:length]))
            data = rest[length:]
    assert data == b"" and len(answers) == count, (answers, data)
    return answers


# gzip


def test_metrics_are_gzip_compressed_for_a_client_that_accepts_it(server: QueryServer) -> None:
    """Prometheus sends ``Accept-Encoding: gzip`` with every scrape; the page went out as it is (176 KiB
    for 250 containers, a 10th of that compressed)."""
    resp = _get(server.port, "/metrics", {"Accept-Encoding": "gzip"})
    body = resp.read()
    assert resp.status == 200
    assert resp.getheader("Content-Encoding") == "gzip"
    assert resp.getheader("Vary") == "Accept-Encoding"
    assert int(resp.getheader("Content-Length") or -1) == len(body)
    assert gzip.decompress(body) == PAGE
    assert len(body) < len(PAGE) // 5


@pytest.mark.parametrize("accept", [None, "identity", "gzip;q=0", "deflate, br"])
def test_metrics_are_plain_for_a_client_that_does_not_accept_gzip(server: QueryServer, accept: str | None) -> None:
    """curl without --compressed, or a client that refuses gzip (q=0): the page as it is."""
    resp = _get(server.port, "/metrics", {"Accept-Encoding": accept} if accept else {})
    body = resp.read()
    assert resp.getheader("Content-Encoding") is None
    assert resp.getheader("Vary") == "Accept-Encoding"  # a cache must not give this to a gzip client
    assert body == PAGE


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("gzip", True),
        ("GZIP", True),
        ("x-gzip", True),
        ("gzip, deflate, br", True),
        ("deflate;q=1.0, gzip;q=0.5", True),
        ("*", True),
        ("*;q=0.1", True),
        ("gzip;q=0", False),
        ("gzip; q=0.000", False),
        ("*, gzip;q=0", False),
        ("identity", False),
        ("", False),
        ("gzipped", False),
        ("gzip;q=zero", False),
    ],
)
def test_accept_encoding_is_read_as_rfc_9110_says(header: str, expected: bool) -> None:
    assert accepts_gzip(header) is expected


def test_head_says_what_get_would_send(server: QueryServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    conn.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
    got = conn.getresponse()
    got.read()
    conn.request("HEAD", "/metrics", headers={"Accept-Encoding": "gzip"})
    head = conn.getresponse()
    assert head.read() == b""
    assert head.getheader("Content-Encoding") == "gzip"
    assert head.getheader("Content-Length") == got.getheader("Content-Length")
    conn.close()


def test_large_display_answers_are_compressed_too_small_ones_not(server: QueryServer) -> None:
    resp = _get(server.port, "/graph", {"Accept-Encoding": "gzip"})
    assert resp.getheader("Content-Encoding") == "gzip"
    assert json.loads(gzip.decompress(resp.read()))["graph"].startswith("ROOT:1\n|---GPU0")
    resp = _get(server.port, "/version", {"Accept-Encoding": "gzip"})
    assert resp.getheader("Content-Encoding") is None  # a few bytes: gzip would only add to them
    assert resp.read() == b'{"version":"3eda4fe"}'
    resp = _get(server.port, "/healthz", {"Accept-Encoding": "gzip"})
    assert resp.getheader("Content-Encoding") is None and json.loads(resp.read())["ok"] is True


# HTTP/1.1 keep-alive


def test_http_1_1_requests_share_one_connection(server: QueryServer) -> None:
    """The answer said HTTP/1.0 and the connection was closed after every request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        for path in ("/metrics", "/version", "/healthz", "/nope", "/metrics"):
            conn.request("GET", path, headers={"Accept-Encoding": "gzip"})
            resp = conn.getresponse()
            resp.read()
            assert resp.version == 11, path
            assert not resp.will_close, path
        assert conn.sock is not None  # the same connection all along: http.client reconnects only when closed
    finally:
        conn.close()


def test_pipelined_requests_are_answered_in_order(server: QueryServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        (head, body), (head2, body2) = _read_answers(s, 2)
        assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"version":"3eda4fe"}'
        assert head2.startswith(b"HTTP/1.1 200 ") and json.loads(body2)["ok"] is True


def test_connection_close_is_honoured(server: QueryServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, body = _read_answer(s)
        assert body == b'{"version":"3eda4fe"}'
        assert b"\r\nConnection: close" in head
        assert s.recv(100) == b""


def test_http_1_0_is_answered_as_before(server: QueryServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /version HTTP/1.0\r\n\r\n")
        head, body = _read_answer(s)
        assert head.startswith(b"HTTP/1.0 200 ") and body == b'{"version":"3eda4fe"}'
        assert s.recv(100) == b""


def test_a_request_with_a_body_closes_its_connection(server: QueryServer) -> None:
    """The body is not read: the next request would start in the middle of it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nGET /x")
        head, _ = _read_answer(s)
        assert head.startswith(b"HTTP/1.1 405 ") and b"\r\nConnection: close" in head
        assert s.recv(100) == b""


def test_an_idle_connection_is_closed_after_the_idle_timeout_and_holds_no_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mhttp, "IDLE_TIMEOUT", 0.5)
    s = _server()
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
            c.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_answer(c)
            started = time.monotonic()
            time.sleep(0.2)
            assert _handler_threads() == 0, "an idle keep-alive connection holds a thread"
            assert c.recv(100) == b""  # closed, without a word (no answer to a request never sent)
            assert 0.3 < time.monotonic() - started < 3
    finally:
        s.stop()


def test_idle_connections_make_room_for_new_ones_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mhttp, "MAX_PENDING", 8)
    s = _server()
    idle = []
    try:
        for _ in range(8):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
            c.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_answer(c)
            idle.append(c)
        for _ in range(8):  # as many again, one after the other: each is served
            resp = _get(s.port, "/metrics")
            assert resp.status == 200 and resp.read() == PAGE
        closed = 0
        for c in idle:
            c.settimeout(0.1)
            try:
                closed += c.recv(10) == b""
            except TimeoutError:
                pass
        assert closed >= 1, "no idle connection was closed to make room"
    finally:
        for c in idle:
            c.close()
        s.stop()


# clients that never read


def test_clients_that_never_read_do_not_starve_scrapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As many connections as there are request threads (64; 4 here) that each asked for the page (more
    than the socket takes) and never read held every thread for 10 s (the send timeout); scrapes
    meanwhile were answered 503."""
    monkeypatch.setattr(mhttp, "CLIENT_TIMEOUT", 5.0)
    monkeypatch.setattr(mhttp, "MAX_CONNECTIONS", 4)
    s = _server(metrics=lambda: BIG)
    stuck = []
    try:
        for _ in range(4):
            c = socket.socket()
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.connect(("127.0.0.1", s.port))
            c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stuck.append(c)
        time.sleep(0.5)  # the answers are written as far as the sockets take them
        assert _handler_threads() == 0, "clients that do not read hold request threads"
        started = time.monotonic()
        resp = _get(s.port, "/metrics", {"Accept-Encoding": "gzip"})
        assert resp.status == 200 and gzip.decompress(resp.read()) == BIG
        assert time.monotonic() - started < 2
    finally:
        for c in stuck:
            c.close()
        s.stop()


def test_a_client_that_never_reads_is_closed_after_the_client_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mhttp, "CLIENT_TIMEOUT", 0.5)
    s = _server(metrics=lambda: BIG)
    try:
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", s.port))
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(2.0)
        c.settimeout(5)
        got = b""
        try:
            while chunk := c.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
        assert len(got) < len(BIG), "the whole page reached a client that stopped reading for 2 s"
        c.close()
    finally:
        s.stop()


def test_a_client_that_reads_slowly_gets_the_whole_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each read comes within the client timeout: the page is written in full, however long it takes."""
    monkeypatch.setattr(mhttp, "CLIENT_TIMEOUT", 0.5)
    s = _server(metrics=lambda: BIG)
    try:
        c = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        c.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        started = time.monotonic()
        data = b""
        reads = 0
        while len(data.partition(b"\r\n\r\n")[2]) < len(BIG):
            reads += 1
            time.sleep(0.3 if reads < 6 else 0.01)  # pauses shorter than the client timeout
            chunk = c.recv(4 << 20)
            assert chunk, f"closed after {len(data)} bytes"
            data += chunk
            assert time.monotonic() - started < 30
        assert data.startswith(b"HTTP/1.1 200 ") and data.partition(b"\r\n\r\n")[2] == BIG
        c.close()
    finally:
        s.stop()


def test_the_next_request_on_a_kept_connection_has_the_header_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle, a kept connection waits up to the idle timeout; once its next request has begun, that request
    must come whole within the header deadline, as on a new connection."""
    monkeypatch.setattr(mhttp, "HEADER_DEADLINE", 0.5)
    s = _server()
    try:
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as c:
            c.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_answer(c)
            time.sleep(0.8)  # idle longer than the header deadline: kept
            c.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n")  # and then never ends its headers
            started = time.monotonic()
            head, _ = _read_answer(c)
            assert head.startswith(b"HTTP/1.0 408 "), head
            assert time.monotonic() - started < 3
    finally:
        s.stop()


def test_stop_closes_kept_and_unread_connections() -> None:
    s = _server(metrics=lambda: BIG)
    kept = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    kept.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
    _read_answer(kept)
    unread = socket.socket()
    unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    unread.connect(("127.0.0.1", s.port))
    unread.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    s.stop()
    try:
        assert kept.recv(100) == b""
        unread.settimeout(5)
        got = 0
        try:
            while chunk := unread.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < len(BIG)
        assert _handler_threads() == 0
    finally:
        kept.close()
        unread.close()
