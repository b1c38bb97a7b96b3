"""The DRA driver's API-server side against an API server that misbehaves."""

from __future__ import annotations

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
