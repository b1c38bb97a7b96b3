"""An API server's answer without end (a broken proxy, a server gone wrong) is read up to a bound, not to the
agent's memory limit: the list is given up with one clear line, and listed again."""

from __future__ import annotations

import logging
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from gpumanager.kube import rest
from gpumanager.kube.client import kube_client
from gpumanager.kube.pods import PodCache
from tests.test_apiserver_attack_review12 import NODE, RawApi, raw

__all__ = ["raw"]  # fixture

LIMIT = 4 << 20


def test_pod_list_without_end_is_given_up_at_the_bound(
    raw: RawApi, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PodList whose body goes on (64 MiB here, for ever behind a broken proxy) was read whole before its JSON
    was looked at. Past the bound (4 MiB here, 128 MiB in production) the answer is dropped and its connection
    closed, the error names the request and the bound, and the list is asked for again."""
    monkeypatch.setattr(rest, "MAX_BODY_BYTES", LIMIT)
    sent: list[int] = []

    def endless(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        block = b'{"kind": "PodList", "items": [' + b" " * (1 << 20)
        total = 0
        try:
            while total < (64 << 20) and not raw.stopping.is_set():
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                total += len(block)
                block = b" " * (1 << 20)
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass
        sent.append(total)

    raw.list_raw = endless
    caplog.set_level(logging.WARNING)
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=5.0)
    cache.start()
    try:
        deadline = time.monotonic() + 30
        while (raw.lists < 2 or not sent) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.lists >= 2, "the list was never asked for again"
        assert sent and sent[0] < (32 << 20), f"the reader took {sent[0] >> 20} MiB of an answer bound at 4 MiB"
        assert not cache.synced()
        assert "/api/v1/pods" in caplog.text and "longer than 4 MiB" in caplog.text, caplog.text[-2000:]
    finally:
        cache.stop()
