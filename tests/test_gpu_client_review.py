"""gpu-client against unix-socket peers that a real agent may present: a listener whose accept
queue is full (the agent busy or hung), a path that is not a socket."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.gpu_client_fixtures import ASAN_CLIENT, client_built  # noqa: F401 (fixture)
from tests.test_gpu_client import CID, POD, SANITIZER, run_client, upstream_args

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
