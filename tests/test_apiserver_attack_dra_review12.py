"""The DRA driver's API-server side against an API server that misbehaves."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager.dra.publisher import SlicePublisher
from gpumanager.kube.client import kube_client
from tests.test_apiserver_attack_review12 import RawApi


@pytest.fixture()
def raw() -> Any:
    server = RawApi()
    yield server
    server.close()


def test_slice_watch_is_no_hot_loop_when_every_watch_ends_at_once(raw: RawApi, tmp_path: Path) -> None:
    """An API server (or a proxy in front of it that does not stream) ending every watch at once with no
    event: the ResourceSlice watch listed and watched again at once, without end (hundreds of requests a
    second from every node). It waits its backoff, as the pod cache does (client-go's "very short watch")."""
    raw.list_body = lambda _h: {"kind": "ResourceSliceList", "metadata": {"resourceVersion": "7"}, "items": []}
    publisher = SlicePublisher(
        kube_client(raw.kubeconfig(tmp_path / "kc")),
        node="node-1",
        driver="gpu.example.com",
        content=lambda _generation: {},
    )
    thread = threading.Thread(target=publisher._watch_loop, daemon=True)
    thread.start()
    time.sleep(3.0)
    publisher._stop.set()
    thread.join(5)
    assert raw.watches <= 6, f"{raw.lists} lists and {raw.watches} watches in 3 s"


def _resetting_server(tmp_path: Path) -> tuple[str, int, Any]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(50)
    port = srv.getsockname()[1]

    def reset_all() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(100)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_all, daemon=True).start()
    config = tmp_path / "kc"
    cluster = {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": cluster}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(config), port, srv


def test_claim_read_refused_by_a_connection_reset_says_so_in_one_clear_line(tmp_path: Path) -> None:
    """NodePrepareResources' error for a claim that could not be read through a connection reset quoted urllib3's
    own text ("HTTPSConnectionPool(...): Max retries exceeded with url: ... (Caused by ...)"); the slice
    publisher's error did the same. Both now name the server and why."""
    from gpumanager.dra.claims import ClaimError
    from gpumanager.dra.prepare import api_reader

    config, port, srv = _resetting_server(tmp_path)
    try:
        read = api_reader(kube_client(config), timeout=5.0)
        with pytest.raises(ClaimError) as refused:
            read("default", "claim-1")
        publisher = SlicePublisher(
            kube_client(config), node="node-1", driver="gpu.example.com", content=lambda _generation: {}
        )
        publisher._sync_logged()
    finally:
        srv.close()
    for message in (str(refused.value), publisher.last_error):
        assert f"cannot reach the API server at https://127.0.0.1:{port}" in message, message
        assert "Max retries" not in message and "\n" not in message, message
    assert str(refused.value).startswith("claim default/claim-1: cannot read it: ")
