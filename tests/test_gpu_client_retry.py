"""gpu-client sends its (idempotent) registration again when the agent did not complete it: the agent
restarted under the call, or refused the stream before processing it."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import hpack

from tests import h2_servers as hs
from tests.gpu_client_fixtures import ASAN_CLIENT, client_built
from tests.test_gpu_client import CID, POD, SANITIZER, run_client, upstream_args

__all__ = ["client_built"]


def _ok_answer() -> bytes:
    enc = hpack.Encoder()
    out = hs.frame(hs.SETTINGS, 0, 0)
    out += hs.frame(
        hs.HEADERS, hs.END_HEADERS, 1, enc.encode([(":status", "200"), ("content-type", "application/grpc")])
    )
    out += hs.frame(hs.DATA, 0, 1, hs.grpc_message())
    out += hs.frame(hs.HEADERS, hs.END_HEADERS | hs.END_STREAM, 1, enc.encode([("grpc-status", "0")]))
    return out


def _flaky(first: str) -> tuple[hs.UnixServer, list[str]]:
    """A server whose first connection fails as ``first`` says; later ones answer OK."""
    seen: list[str] = []

    def handle(sock: socket.socket) -> None:
        seen.append("conn")
        if len(seen) == 1:
            if first == "close-at-once":
                return  # closed before the client has written anything
            sock.settimeout(2)
            with contextlib.suppress(TimeoutError):
                sock.recv(65536)
            if first == "close-after-request":
                return
            if first == "refused-stream":
                sock.sendall(hs.frame(hs.SETTINGS, 0, 0) + hs.frame(hs.RST_STREAM, 0, 1, b"\0\0\0\7"))
            elif first == "goaway-unprocessed":
                sock.sendall(hs.frame(hs.SETTINGS, 0, 0) + hs.frame(hs.GOAWAY, 0, 0, b"\0\0\0\0\0\0\0\0"))
            elif first == "unavailable":
                enc = hpack.Encoder()
                headers = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "14")]
                sock.sendall(hs.frame(hs.SETTINGS, 0, 0) + hs.frame(hs.HEADERS, 0x5, 1, enc.encode(headers)))
            with contextlib.suppress(OSError):
                sock.recv(65536)
            return
        sock.settimeout(2)
        with contextlib.suppress(TimeoutError):
            sock.recv(65536)
        sock.sendall(_ok_answer())
        with contextlib.suppress(OSError):
            sock.recv(65536)

    return hs.UnixServer(handle), seen


def test_a_call_the_server_did_not_complete_is_sent_again(client_built: Path) -> None:
    for first in ("close-at-once", "close-after-request", "refused-stream", "goaway-unprocessed", "unavailable"):
        server, seen = _flaky(first)
        try:
            result = run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "10"))
        finally:
            server.close()
        assert result.rc == 0, (first, result.rc, result.stderr)
        assert len(seen) == 2, (first, seen)
        assert not SANITIZER.search(result.stderr), result.stderr


def test_a_refusal_is_not_sent_again(client_built: Path) -> None:
    enc = hpack.Encoder()
    headers = [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "7")]
    answer = hs.frame(hs.SETTINGS, 0, 0) + hs.frame(hs.HEADERS, 0x5, 1, enc.encode(headers))
    seen: list[int] = []

    def handle(sock: socket.socket) -> None:
        seen.append(1)
        hs.raw_handler(answer)(sock)

    server = hs.UnixServer(handle)
    try:
        result = run_client(ASAN_CLIENT, *upstream_args(server.path, POD, CID, "--timeout", "10"))
    finally:
        server.close()
    assert result.rc == 1 and "PERMISSION_DENIED" in result.stderr, result.stderr
    assert len(seen) == 1
