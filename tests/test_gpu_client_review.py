"""gpu-client against unix-socket peers that a real agent may present: a listener whose accept
queue is full (the agent busy or hung), one that closes mid-frame then falls silent, one that stops
reading after its complete answer, a path that is not a socket."""

from __future__ import annotations

import contextlib
import re
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.gpu_client_fixtures import ASAN_CLIENT, client_built
from tests.test_gpu_client import CID, POD, SANITIZER, run_client, upstream_args

__all__ = ["client_built"]

BINARIES = ["static", "asan"]


def _binary(kind: str, built: Path) -> Path:
    return built if kind == "static" else ASAN_CLIENT


@pytest.mark.parametrize("kind", BINARIES)
def test_full_accept_queue_ends_at_the_deadline(kind: str, client_built: Path, tmp_path: Path) -> None:
    """A listener that does not accept, its backlog full: connect() must not block past --timeout."""
    sock = tmp_path / "vcuda.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held: list[socket.socket] = []
    try:
        listener.bind(str(sock))
        listener.listen(0)
        while True:  # fill the accept queue
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(str(sock))
            except BlockingIOError:
                c.close()
                break
            held.append(c)
            assert len(held) < 64, "the accept queue never filled"
        try:
            res = run_client(_binary(kind, client_built), *upstream_args(sock, POD, CID, "--timeout", "1"), timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("gpu-client hung in connect() past its 1 s deadline (accept queue full)")
    finally:
        for c in held:
            c.close()
        listener.close()
    assert res.rc == 1, res.stderr
    assert not SANITIZER.search(res.stderr), res.stderr
    assert str(sock) in res.stderr and "deadline" in res.stderr, res.stderr


def _serve_once(sock: Path, answer: bytes) -> tuple[socket.socket, threading.Thread]:
    """Accept connections on sock: the first gets answer after the client's request, then is
    closed; later ones are accepted and left silent (an agent that stopped answering)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(16)
    kept: list[socket.socket] = []

    def serve() -> None:
        first = True
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            kept.append(conn)
            if first:
                first = False
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.sendall(answer)
                conn.close()
        for c in kept:
            c.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize("kind", BINARIES)
def test_deadline_message_names_the_timeout_and_the_earlier_failure(
    kind: str, client_built: Path, tmp_path: Path
) -> None:
    """A server that closes mid-frame, then a silent one: the call ends at --timeout, and stderr
    names the timeout and why the first attempt failed (not only 'before the deadline')."""
    sock = tmp_path / "vcuda.sock"
    settings = b"\0\0\0\x04\0\0\0\0\0"
    headers_cut = b"\0\0\x10\x01\x04\0\0\0\x01\x88"  # a HEADERS frame cut after 1 of its 16 bytes
    listener, thread = _serve_once(sock, settings + headers_cut)
    try:
        try:
            res = run_client(_binary(kind, client_built), *upstream_args(sock, POD, CID, "--timeout", "1.5"))
        except subprocess.TimeoutExpired:
            pytest.fail("gpu-client hung past its 1.5 s deadline")
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
    assert res.rc == 1, res.stderr
    assert not SANITIZER.search(res.stderr), res.stderr
    assert "1.5 s" in res.stderr, res.stderr
    # the first connection's loss: seen as EOF, or as a failed send of the SETTINGS ACK
    assert re.search(
        r"earlier attempt: (the server closed the connection|cannot send to the server|cannot read from the server)",
        res.stderr,
    ), res.stderr


@pytest.mark.parametrize("kind", BINARIES)
def test_a_path_that_is_not_a_socket_is_named_at_once(kind: str, client_built: Path, tmp_path: Path) -> None:
    """A regular file where the socket should be never becomes one (the agent only replaces stale
    sockets): say so, naming the path, instead of retrying 'Connection refused' to the deadline."""
    path = tmp_path / "vcuda.sock"
    path.write_text("")
    try:
        res = run_client(_binary(kind, client_built), *upstream_args(path, POD, CID, "--timeout", "10"))
    except subprocess.TimeoutExpired:
        pytest.fail("gpu-client kept retrying a regular file past 20 s")
    assert res.rc == 1, res.stderr
    assert not SANITIZER.search(res.stderr), res.stderr
    assert f"{path} is not a socket" in res.stderr, res.stderr
    assert "retried until the deadline" not in res.stderr, res.stderr


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


@pytest.mark.parametrize("kind", BINARIES)
def test_an_answer_is_read_although_acknowledging_the_servers_settings_fails(
    kind: str, client_built: Path, tmp_path: Path
) -> None:
    """A server that answers OK and stops reading (going away: GOAWAY after the call, then
    close): the SETTINGS and PING acknowledgements cannot be sent (EPIPE), but the complete answer
    is already on the socket and must be taken, not retried into the deadline."""
    sock = tmp_path / "vcuda.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(16)
    # ":status: 200" (static index 8), content-type application/grpc (literal, name index 31)
    headers = b"\x88" + b"\x0f\x10\x10application/grpc"
    trailers = b"\x00\x0bgrpc-status\x010"
    answer = (
        _frame(0x4, 0, 0)  # SETTINGS
        + _frame(0x6, 0, 0, b"12345678")  # PING
        + _frame(0x1, 0x4, 1, headers)
        + _frame(0x0, 0, 1, b"\0\0\0\0\0")  # the empty VDeviceResponse
        + _frame(0x1, 0x5, 1, trailers)
        + _frame(0x7, 0, 0, struct.pack(">II", 1, 0))  # GOAWAY NO_ERROR, last stream 1
    )
    answered: list[int] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(65536)
                    conn.shutdown(socket.SHUT_RD)  # the client's writes now fail with EPIPE
                    conn.sendall(answer)
                    answered.append(1)
                    time.sleep(0.5)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        try:
            res = run_client(_binary(kind, client_built), *upstream_args(sock, POD, CID, "--timeout", "3"))
        except subprocess.TimeoutExpired:
            pytest.fail("gpu-client hung past its 3 s deadline")
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
    assert not SANITIZER.search(res.stderr), res.stderr
    assert res.rc == 0, res.stderr
    assert len(answered) == 1, f"the call was sent {len(answered)} times"
