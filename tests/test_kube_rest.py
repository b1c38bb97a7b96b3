"""The agent's API-server calls through ApiClient (gpumanager.kube.rest), against the API-server simulator."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes.client.exceptions import ApiException

from gpumanager.kube.rest import MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeRest
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator(history=50) as sim:
        sim.add_node("node-1")
        yield sim


@pytest.fixture
def rest(api: ApiServerSimulator) -> KubeRest:
    return KubeRest(api.client(retries=False))


def test_list_and_watch_pods_of_one_node(api: ApiServerSimulator, rest: KubeRest) -> None:
    api.create_pod(pod_manifest("mine"))
    api.create_pod(pod_manifest("other", node="node-2"))
    listed = rest.list_pods(field_selector="spec.nodeName=node-1", timeout=5)
    assert [p["metadata"]["name"] for p in listed["items"]] == ["mine"]
    rv = listed["metadata"]["resourceVersion"]
    response = rest.watch_pods(field_selector="spec.nodeName=node-1", resource_version=rv, timeout_seconds=5, timeout=5)
    try:
        api.create_pod(pod_manifest("later"))
        line = response.readline()
    finally:
        response.release_conn()
    event = json.loads(line)
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "later")


def test_patch_pod_and_node(api: ApiServerSimulator, rest: KubeRest) -> None:
    api.create_pod(pod_manifest("p"))
    rest.patch_pod(
        "default", "p", {"metadata": {"annotations": {"a": "1"}}}, content_type=STRATEGIC_MERGE_PATCH, timeout=5
    )
    pod = api.get_pod("default", "p")
    assert pod is not None and pod["metadata"]["annotations"]["a"] == "1"
    rest.patch_node("node-1", {"metadata": {"labels": {"l": "v"}}}, content_type=MERGE_PATCH, timeout=5)
    node = api.get_node("node-1")
    assert node is not None and node["metadata"]["labels"]["l"] == "v"


def test_errors_are_the_clients_api_exceptions(api: ApiServerSimulator, rest: KubeRest) -> None:
    with pytest.raises(ApiException) as missing:
        rest.patch_pod("default", "nobody", {"metadata": {}}, content_type=STRATEGIC_MERGE_PATCH, timeout=5)
    assert missing.value.status == 404
    assert "nobody" in str(missing.value.body)
    created = api.create_pod(pod_manifest("p"))
    with pytest.raises(ApiException) as conflict:
        rest.delete_pod("default", "p", {"preconditions": {"uid": "not-its-uid"}}, timeout=5)
    assert conflict.value.status == 409
    rest.delete_pod("default", "p", {"preconditions": {"uid": created["metadata"]["uid"]}}, timeout=5)
    deleting = api.get_pod("default", "p")  # on a node: kept until its kubelet is done with it
    assert deleting is not None and deleting["metadata"]["deletionTimestamp"]


AGENT_SIDE = r"""
import json, sys
from kubernetes.client import ApiClient
client_itself = {m for m in sys.modules if m.startswith("kubernetes.client.api.")}
from gpumanager.kube import cleanup
from gpumanager.kube.connection import ApiConnection
conn = ApiConnection(kubeconfig=sys.argv[1], node_name="node-1")
cache = conn.connect(lambda kind, pod: None)
assert cache is not None and cache.wait_synced(10), conn.error
pod = {"metadata": {"namespace": "default", "name": "p", "uid": sys.argv[2]}}
assert conn.patcher is not None and conn.patcher.submit("default", "p", sys.argv[2], {"a": "1"}).wait(10)
assert conn.label_node({"l": "v"}, "NVIDIA H100 80GB HBM3") == ""
assert cleanup.delete_pod(conn.api, pod)
print(json.dumps(sorted({m for m in sys.modules if m.startswith("kubernetes.client.api.")} - client_itself)))
conn.stop()
"""


def test_the_agents_api_side_loads_no_typed_api_class(api: ApiServerSimulator, tmp_path: Path) -> None:
    # CoreV1Api alone costs ~0.8 s of CPU and ~21 MiB to import (kubernetes >= 37, which loads the
    # API classes only when asked; older releases load all of them with the package).
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    pod = api.create_pod(pod_manifest("p", node="node-1"))
    done = subprocess.run(
        [sys.executable, "-c", AGENT_SIDE, str(kubeconfig), pod["metadata"]["uid"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
    patched = api.get_node("node-1")
    assert patched is not None and patched["metadata"]["labels"]["l"] == "v"
    deleting = api.get_pod("default", "p")  # on a node: kept until its kubelet is done with it
    assert deleting is not None and deleting["metadata"]["deletionTimestamp"]


class _Answering:
    """An HTTP server that answers every request with one status, content type and body."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        answer = (status, body, content_type)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                code, data, ctype = answer
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Answering:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def kubeconfig(self, directory: Path) -> str:
        return _kubeconfig(directory, self.server.server_port)


def _kubeconfig(directory: Path, port: int) -> str:
    """A kubeconfig for a plain-HTTP server on 127.0.0.1:``port``, with a token."""
    path = directory / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def test_an_answer_that_is_not_json_is_named_with_the_request_and_the_body(tmp_path: Path) -> None:
    from gpumanager.dra.claims import ClaimError
    from gpumanager.dra.prepare import api_reader
    from gpumanager.dra.publisher import SlicePublisher
    from gpumanager.kube.client import api_client

    with _Answering(200, b"<html>proxy login</html>", "text/html") as server:
        api = api_client(server.kubeconfig(tmp_path))
        with pytest.raises(ClaimError) as claim:
            api_reader(api, timeout=5)("ns", "claim-a")
        publisher = SlicePublisher(api, node="n1", driver="gpu.example.com", content=lambda gen: {})
        assert publisher._sync_logged() is False
    for text in (str(claim.value), publisher.last_error):
        assert "not JSON" in text and "<html>proxy login</html>" in text, text
    assert str(claim.value).startswith("claim ns/claim-a: ") and "/resourceclaims/claim-a" in str(claim.value)
    assert publisher.last_error.startswith("cannot publish ResourceSlice n1-gpu.example.com: GET /apis/"), (
        publisher.last_error
    )


def test_a_hanging_api_server_is_asked_once_per_call(tmp_path: Path) -> None:
    # urllib3 retried read timeouts three times by default, over new connections: a call to a
    # server that accepts and never answers took four times its timeout.
    import socket

    from gpumanager.kube.client import api_client

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(conn)  # never answered

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    config = tmp_path / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\ncurrent-context: x\n"
    )
    rest = KubeRest(api_client(str(config)))
    try:
        with pytest.raises(Exception, match=r"[Tt]imed out|timeout"):
            rest.get_object("/apis/resource.k8s.io/v1/resourceslices/x", timeout=0.3)
        assert len(accepted) == 1
    finally:
        done.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


def read_from_a_trickling_server(
    directory: Path, read: Callable[[str], object], wait: float
) -> list[BaseException | None]:
    """Run ``read(kubeconfig)`` against a server that sends a 200 header and then one byte every 0.2 s for
    ever; return what it ended with ([None]: it returned, [exc]: it raised, []: still waiting after ``wait``)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            while not stop.wait(0.2):
                try:
                    conn.sendall(b" ")
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    kubeconfig = _kubeconfig(directory, port)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            read(kubeconfig)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=run, daemon=True)
    reader.start()
    reader.join(wait)
    stop.set()
    listener.close()
    return outcome


def test_a_claim_answer_trickled_a_byte_at_a_time_is_bounded_as_a_whole(tmp_path: Path) -> None:
    """Each read of the answer comes within the timeout, the whole never does: the claim gets its error."""
    from gpumanager.dra.claims import ClaimError
    from gpumanager.dra.prepare import api_reader
    from gpumanager.kube.client import api_client

    outcome = read_from_a_trickling_server(
        tmp_path, lambda kubeconfig: api_reader(api_client(kubeconfig), timeout=1.0)("ns", "claim-a"), 20
    )
    assert outcome, "the read still waits on an answer that never ends"
    assert isinstance(outcome[0], ClaimError) and "claim ns/claim-a" in str(outcome[0]), outcome


@pytest.mark.parametrize("wait_as_told", [True, False])
def test_a_throttled_request_waits_only_where_the_caller_has_no_deadline(
    tmp_path: Path, api: ApiServerSimulator, wait_as_told: bool
) -> None:
    """The agent's own calls wait a 429's Retry-After (urllib3 retries it); the extender's bind, which
    must answer the scheduler within its deadline, gets the 429 at once and retries on its own terms."""
    from gpumanager.kube.client import api_client

    api.create_pod(pod_manifest("a"))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    client = KubeRest(api_client(str(kubeconfig), wait_as_told=wait_as_told))
    api.fail_next("GET", r"/pods/a$", status=429, count=1, retry_after=1, message="too many requests")
    api.clear_requests()
    if wait_as_told:
        assert client.read_pod("default", "a", timeout=10)["metadata"]["name"] == "a"
    else:
        with pytest.raises(ApiException) as throttled:
            client.read_pod("default", "a", timeout=10)
        assert throttled.value.status == 429
    gets = [r for r in api.requests if r.method == "GET" and r.path.endswith("/pods/a")]
    assert len(gets) == (2 if wait_as_told else 1)
