"""The agent's API-server side against an API server that misbehaves as real ones (and the proxies in
front of them) do: long Retry-After answers, objects of unexpected shape, streams that stop."""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from gpumanager.kube.client import kube_client
from gpumanager.kube.pods import PodCache
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest

NODE = "node-1"


@pytest.fixture()
def sim() -> Any:
    with ApiServerSimulator() as server:
        server.add_node(NODE)
        yield server


def _client(sim: ApiServerSimulator, tmp_path: Path) -> Any:
    return kube_client(str(sim.write_kubeconfig(tmp_path / "kubeconfig")))


def test_pod_cache_lists_soon_after_a_429_asking_an_hour(sim: ApiServerSimulator, tmp_path: Path) -> None:
    """A 429 whose Retry-After says an hour (a proxy's, or an overloaded server's) held the pod cache's
    list for that hour, three times over: the cache stayed unsynced long after the server answered
    again. The wait a Retry-After asks for is bounded."""
    sim.create_pod(pod_manifest("p0", node=NODE))
    sim.fail_next("GET", r"^/api/v1/pods$", 429, count=1, retry_after=3600)
    cache = PodCache(_client(sim, tmp_path), NODE, request_timeout=5.0)
    cache.start()
    try:
        started = time.monotonic()
        assert cache.wait_synced(25.0), "the pod cache never listed after one 429 with Retry-After: 3600"
        assert time.monotonic() - started < 25.0
        assert [p["metadata"]["name"] for p in cache.pods()] == ["p0"]
    finally:
        cache.stop()


class RawApi:
    """An API server answering what a test scripts, byte for byte: ``list_body(handler)`` for a list of
    pods, ``watch(handler)`` for a watch (which writes the response itself)."""

    def __init__(self) -> None:
        self.list_body: Any = lambda _h: {"kind": "PodList", "metadata": {"resourceVersion": "10"}, "items": []}
        self.watch: Any = None
        self.list_raw: Any = None  # writes a list's whole response itself, as ``watch`` does
        self.watches = 0
        self.lists = 0
        self.stopping = threading.Event()
        raw = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                query = parse_qs(urlsplit(self.path).query)
                if query.get("watch") == ["true"]:
                    raw.watches += 1
                    if raw.watch is not None:
                        raw.watch(self)
                        return
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                raw.lists += 1
                if raw.list_raw is not None:
                    raw.list_raw(self)
                    return
                body = json.dumps(raw.list_body(self)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def start_stream(self, handler: BaseHTTPRequestHandler) -> None:
        """Answer a watch 200 with a chunked body that :meth:`event` writes to."""
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

    @staticmethod
    def event(handler: BaseHTTPRequestHandler, event: Any) -> None:
        data = json.dumps(event).encode() + b"\n"
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()

    def kubeconfig(self, path: Path) -> str:
        url = f"http://127.0.0.1:{self.server.server_address[1]}"
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        return str(path)

    def close(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def raw() -> Any:
    server = RawApi()
    yield server
    server.close()


def _pod(name: str, uid: str, **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "uid": uid, "resourceVersion": "5", **meta},
        "spec": {"nodeName": NODE, "containers": [{"name": "c"}]},
        "status": {"phase": "Pending"},
    }


def test_pod_cache_lists_a_node_holding_a_pod_of_unexpected_shape(
    raw: RawApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One object of the list whose metadata is a list (or null, or whose labels are a list) failed
    the whole list, every time: the cache never synced, and no pod of the node could start. The
    object is skipped, named, and the others are cached."""
    odd = _pod("odd", "u-odd")
    odd["metadata"] = ["name", "odd"]
    items = [_pod("good", "u-good", labels=["a", "b"]), odd, {"metadata": None, "kind": "Pod"}, _pod("fine", "u-fine")]
    raw.list_body = lambda _h: {"metadata": {"resourceVersion": "10"}, "items": items}
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=5.0)
    caplog.set_level(logging.INFO)
    cache.start()
    try:
        assert cache.wait_synced(8.0), f"never synced: {caplog.text[-2000:]}"
        assert sorted(p["metadata"]["name"] for p in cache.pods()) == ["fine", "good"]
        assert cache.find("default", "good") is not None
    finally:
        cache.stop()
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.exc_info]


def test_pod_cache_watches_again_after_a_watch_that_goes_silent(raw: RawApi, tmp_path: Path) -> None:
    """A watch stream that stops sending without closing (a hung API server, a proxy that lost its
    upstream) is dropped and watched again, with BOOKMARKs and events of unknown types taken in stride."""
    raw.list_body = lambda _h: {"metadata": {"resourceVersion": "10"}, "items": [_pod("a", "u-a")]}

    def silent(handler: BaseHTTPRequestHandler) -> None:
        raw.start_stream(handler)
        raw.event(handler, {"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": {"resourceVersion": "11"}}})
        raw.event(handler, {"type": "SURPRISE", "object": {"metadata": {"uid": "u-x"}}})
        raw.event(handler, {"type": "ADDED", "object": _pod(f"b{raw.watches}", f"u-b{raw.watches}")})
        raw.stopping.wait(60)

    raw.watch = silent
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=2.0, watch_timeout=1)
    cache.start()
    try:
        deadline = time.monotonic() + 20
        while raw.watches < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert raw.watches >= 2, "a silent watch was never dropped"
        assert cache.find("default", "b1") is not None
        assert cache.get("u-x") is None
    finally:
        cache.stop()


def test_pod_watch_skips_events_of_unexpected_shape(
    raw: RawApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch event whose object is no pod (metadata a list, no object at all, a bare string) failed the
    watch, which resumed from the same resourceVersion into the same event: no later change was seen."""

    def odd(handler: BaseHTTPRequestHandler) -> None:
        raw.start_stream(handler)
        raw.event(handler, {"type": "ADDED", "object": {"metadata": ["x"]}})
        raw.event(handler, {"type": "MODIFIED", "object": "pod"})
        raw.event(handler, {"type": "BOOKMARK", "object": {"metadata": []}})
        raw.event(handler, ["not", "an", "event"])
        raw.event(handler, {"type": "ADDED", "object": _pod("later", "u-later")})
        raw.stopping.wait(60)

    raw.watch = odd
    caplog.set_level(logging.INFO)
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=5.0, watch_timeout=30)
    cache.start()
    try:
        deadline = time.monotonic() + 8
        while cache.find("default", "later") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cache.find("default", "later") is not None, caplog.text[-2000:]
        assert raw.watches == 1
    finally:
        cache.stop()
    assert 'is no pod (its metadata is not an object but ["x"])' in caplog.text
    assert not [r for r in caplog.records if r.exc_info]


def test_pod_cache_lists_again_when_the_resource_version_went_back(sim: ApiServerSimulator, tmp_path: Path) -> None:
    """After the API server's etcd was restored from a backup its resourceVersion is lower than the one the
    cache watched from: every watch from it was answered 504 "Too large resource version" and watched again
    from the same resourceVersion, for ever, so no pod created or deleted since was ever seen (the GPUs of
    the deleted stayed held). The cache lists again, as client-go's reflector does."""
    sim.create_pod(pod_manifest("before", node=NODE))
    backup = sim.backup()
    sim.create_pod(pod_manifest("lost", node=NODE))
    cache = PodCache(_client(sim, tmp_path), NODE, request_timeout=5.0)
    cache.start()
    try:
        assert cache.wait_synced(5.0)
        assert sim.wait_for_watches(1)
        for i in range(5):  # the cache's resourceVersion moves well past the backup's
            sim.create_pod(pod_manifest(f"more{i}", node=NODE))
        deadline = time.monotonic() + 5
        while cache.find("default", "more4") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        sim.restore(backup)
        sim.create_pod(pod_manifest("after", node=NODE))
        deadline = time.monotonic() + 25
        while cache.find("default", "after") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cache.find("default", "after") is not None, "the pod created after the restore was never seen"
        assert cache.find("default", "lost") is None
        assert sorted(p["metadata"]["name"] for p in cache.pods()) == ["after", "before"]
    finally:
        cache.stop()


def test_pod_cache_lists_again_when_a_watch_is_answered_410(raw: RawApi, tmp_path: Path) -> None:
    """A watch refused with HTTP 410 Gone (rather than a 410 ERROR event in a 200 stream, as an API server
    without its watch cache or a proxy answers) was watched again from the same resourceVersion for ever."""
    raw.list_body = lambda _h: {"metadata": {"resourceVersion": str(10 + raw.lists)}, "items": []}

    def gone(handler: BaseHTTPRequestHandler) -> None:
        if raw.lists >= 2:
            raw.start_stream(handler)
            raw.stopping.wait(60)
            return
        body = json.dumps({"kind": "Status", "status": "Failure", "code": 410, "reason": "Expired"}).encode()
        handler.send_response(410)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    raw.watch = gone
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=5.0)
    cache.start()
    try:
        deadline = time.monotonic() + 10
        while raw.lists < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.lists >= 2, f"listed {raw.lists} time(s), watched {raw.watches} time(s)"
    finally:
        cache.stop()


def test_annotation_patch_outlasts_a_503_storm(
    sim: ApiServerSimulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod's ready annotations (gpu-assigned=true) were given up after 10 failed attempts, about 3 minutes
    of backoff: an API server answering 503 for longer (a control-plane upgrade) left the pod without them
    for good, though it answered again later. Failures that say nothing of the pod (5xx, 429, a connection
    error) no longer count toward giving up."""
    from gpumanager.kube.patcher import AnnotationPatcher
    from gpumanager.retry import Backoff

    monkeypatch.setattr(Backoff, "next_delay", lambda _self: 0.02)
    created = sim.create_pod(pod_manifest("p0", node=NODE))
    sim.fail_next("PATCH", r"/pods/p0$", 503, count=25)
    sim.fail_next("PATCH", r"/pods/p0$", 500, count=10)
    sim.fail_next("PATCH", r"/pods/p0$", 429, count=10)
    patcher = AnnotationPatcher(_client(sim, tmp_path))
    patcher.start()
    try:
        done = patcher.submit("default", "p0", created["metadata"]["uid"], {"tencent.com/gpu-assigned": "true"})
        assert done.wait(20.0)
    finally:
        patcher.stop()
    pod = sim.get_pod("default", "p0")
    assert pod is not None
    assert pod["metadata"]["annotations"].get("tencent.com/gpu-assigned") == "true", patcher.failed


def _node_labels(sim: ApiServerSimulator) -> dict[str, str]:
    node = sim.get_node(NODE) or {}
    return dict((node.get("metadata") or {}).get("labels") or {})


def test_node_labels_survive_a_token_that_expired(sim: ApiServerSimulator, tmp_path: Path) -> None:
    """One 401 (a service-account token expired, renewed from its file within a minute) made the agent give
    up --node-labels for good: the node never got its labels (a nodeSelector on the GPU model never matched)."""
    from gpumanager.kube.connection import ApiConnection

    sim.fail_next("PATCH", rf"^/api/v1/nodes/{NODE}$", 401, count=1)
    conn = ApiConnection(kubeconfig=str(sim.write_kubeconfig(tmp_path / "kc")), node_name=NODE)
    assert conn.client() is not None
    try:
        assert conn.label_node({"gaia.tencent.com/gpu-model": ""}, "NVIDIA H100 80GB HBM3") == ""
    finally:
        conn.stop()
    assert _node_labels(sim).get("gaia.tencent.com/gpu-model") == "H100"


def test_node_labels_are_applied_once_a_long_outage_ends(
    sim: ApiServerSimulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An API server answering 503 for longer than the labelling's minute at start made the agent give up
    --node-labels for good, though the server answered again later. The error is told at once and the
    labels go on being tried in the background until they are applied (and the error is then withdrawn)."""
    from gpumanager.kube import nodelabels
    from gpumanager.kube.connection import ApiConnection
    from gpumanager.retry import Backoff

    monkeypatch.setattr(nodelabels, "LABEL_WINDOW", 0.5)
    monkeypatch.setattr(Backoff, "next_delay", lambda _self: 0.05)
    sim.fail_next("PATCH", rf"^/api/v1/nodes/{NODE}$", 503, count=40)
    conn = ApiConnection(kubeconfig=str(sim.write_kubeconfig(tmp_path / "kc")), node_name=NODE)
    assert conn.client() is not None
    results: list[str] = []
    try:
        problem = conn.label_node({"l": "v"}, "NVIDIA H100 80GB HBM3", on_result=results.append)
        assert "503" in problem and NODE in problem, problem
        deadline = time.monotonic() + 15
        while _node_labels(sim).get("l") != "v" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _node_labels(sim).get("l") == "v"
        deadline = time.monotonic() + 5
        while not results and time.monotonic() < deadline:
            time.sleep(0.05)
        assert results == [""]
    finally:
        conn.stop()


def test_pod_watch_drops_an_endless_event(raw: RawApi, tmp_path: Path) -> None:
    """A watch stream that sends bytes without ever ending the line (a broken proxy, a server gone wrong) was
    read into memory without bound, to the agent's out-of-memory kill. A line longer than any object the API
    server stores ends the watch, which is watched again."""
    sent: list[int] = []

    def endless(handler: BaseHTTPRequestHandler) -> None:
        raw.start_stream(handler)
        if raw.watches > 1:
            raw.stopping.wait(60)
            return
        block = b"x" * (1 << 20)
        total = 0
        try:
            while total < (200 << 20) and not raw.stopping.is_set():
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
                total += len(block)
        except OSError:
            pass
        sent.append(total)

    raw.watch = endless
    cache = PodCache(kube_client(raw.kubeconfig(tmp_path / "kc")), NODE, request_timeout=5.0)
    cache.start()
    try:
        deadline = time.monotonic() + 30
        while raw.watches < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert raw.watches >= 2, "the endless event was never given up"
        deadline = time.monotonic() + 10
        while not sent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sent and sent[0] < (100 << 20), sent
    finally:
        cache.stop()


def test_pod_list_refused_by_a_connection_reset_says_so_in_one_clear_line(tmp_path: Path) -> None:
    """An API server (or a TLS endpoint in front of it) resetting every connection: Allocate's refusal quoted
    urllib3's own text for the list it asked ("HTTPSConnectionPool(host=..., port=...): Max retries exceeded
    with url: ... (Caused by ProtocolError(...))") to the pod's events. It now names the server and why, as
    the pod cache's own log line does."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(50)
    port = srv.getsockname()[1]
    stopping = threading.Event()

    def reset_all() -> None:
        while not stopping.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.recv(100)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=reset_all, daemon=True).start()
    config = tmp_path / "kc"
    config.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}", "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    from types import SimpleNamespace

    from gpumanager.allocation.matching import refresh_pods
    from gpumanager.allocation.model import AllocationError

    cache = PodCache(kube_client(str(config)), NODE, request_timeout=2.0)
    try:
        with pytest.raises(AllocationError) as refused:
            refresh_pods(SimpleNamespace(_pods=cache), 50, ["vcore-0"])  # type: ignore[arg-type]
    finally:
        stopping.set()
        srv.close()
    message = str(refused.value)
    assert f"the API server cannot be asked: cannot reach the API server at https://127.0.0.1:{port}" in message
    assert "reset" in message.lower() and "Max retries" not in message and "\n" not in message, message
