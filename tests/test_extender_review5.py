"""The scheduler extender and the kube-scheduler stand-in that calls it: as unkind as the real ones."""

from __future__ import annotations

import json
import select
import socket
import threading
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from simnode.apiserver import ApiServerSimulator
from simnode.multinode import pending_pod
from simnode.scheduler import (
    ExtenderCallError,
    ExtenderClient,
    ExtenderConfig,
    SchedulerStandIn,
    load_configuration,
    node_fit_failure,
    pod_requests,
    profile_names,
)
from tests import extender_fixtures
from tests.extender_fixtures import World, gpu_pod, inventory, wait_for

world = extender_fixtures.world

CORE = names.VCORE_RESOURCE
MEMORY = names.VMEMORY_RESOURCE


def _container(name: str, cores: int, *, sidecar: bool = False) -> dict[str, Any]:
    limits = {CORE: str(cores)}
    spec: dict[str, Any] = {"name": name, "resources": {"limits": limits, "requests": limits}}
    if sidecar:
        spec["restartPolicy"] = "Always"
    return spec


def _pod(containers: list[dict[str, Any]], inits: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": containers, "initContainers": list(inits)},
    }


def _node(cores: int) -> dict[str, Any]:
    return {
        "metadata": {"name": "n"},
        "status": {
            "allocatable": {CORE: str(cores), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


# -- the stand-in's node-total check --------------------------------------------------------------


def test_sidecars_add_to_the_pods_requests_as_kube_scheduler_counts_them() -> None:
    """A sidecar (restartPolicy: Always) runs beside the app containers: kube-scheduler adds its requests
    to theirs, and an ordinary init container after it runs beside it too. The stand-in took the
    largest init container against the sum of the app containers, so a pod the real scheduler finds
    Insufficient on a node was passed to the extender there."""
    pod = _pod([_container("app", 60)], [_container("proxy", 50, sidecar=True), _container("setup", 70)])
    # max(app 60 + proxy 50, setup 70 + proxy 50) = 120
    assert pod_requests(pod)[CORE] == Decimal(120)
    assert node_fit_failure(pod, _node(110), {}) == f"Insufficient {CORE}"
    assert node_fit_failure(pod, _node(120), {}) == ""


def test_pod_overhead_counts_in_the_requests() -> None:
    pod = _pod([_container("app", 60)])
    pod["spec"]["overhead"] = {"cpu": "250m"}
    assert pod_requests(pod)["cpu"] == Decimal("0.25")


def test_resources_ignored_by_the_scheduler_are_left_to_the_extender() -> None:
    """``managedResources[].ignoredByScheduler: true``: NodeResourcesFit does not check that resource."""
    pod = _pod([_container("app", 60)])
    assert node_fit_failure(pod, _node(0), {}) == f"Insufficient {CORE}"
    assert node_fit_failure(pod, _node(0), {}, ignored=frozenset({CORE})) == ""
    config = ExtenderConfig.from_dict(
        {
            "urlPrefix": "http://127.0.0.1:1/scheduler",
            "managedResources": [{"name": CORE, "ignoredByScheduler": True}, {"name": MEMORY}],
        }
    )
    assert config.ignored_by_scheduler == (CORE,)
    assert config.managed_resources == (CORE, MEMORY)


# -- the stand-in's HTTP client -------------------------------------------------------------------


@contextmanager
def _raw_server(answer: bytes | None) -> Iterator[tuple[int, list[bytes]]]:
    """A one-shot-per-connection HTTP server: reads each request and answers ``answer`` (None: closes
    the connection without a word). Yields (port, the requests it read)."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(body) < length:
                    body += conn.recv(65536)
                seen.append(head)
                if answer is not None:
                    conn.sendall(answer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], seen
    finally:
        stop.set()
        thread.join()
        listener.close()


def _client(port: int) -> ExtenderClient:
    return ExtenderClient(ExtenderConfig(url_prefix=f"http://127.0.0.1:{port}/scheduler", http_timeout=5.0))


def test_a_posted_verb_is_not_sent_again_when_the_connection_drops_after_it() -> None:
    """Go's transport never sends a POST again once it was written (it is not idempotent): a bind the
    extender received and then dropped the connection of fails the attempt; the stand-in sent it again."""
    with _raw_server(None) as (port, seen), pytest.raises(ExtenderCallError):
        _client(port).call("bind", {"PodName": "p"})
    assert len(seen) == 1, seen


def test_a_status_other_than_200_is_reported_without_the_body() -> None:
    """kube-scheduler reports 'failed <verb> with extender at URL <url>, code <status>' and never reads
    the body: the extender's reason for a 400 reaches only the extender's own log."""
    body = b'{"Error":"the reason"}'
    answer = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )
    with _raw_server(answer) as (port, _seen), pytest.raises(ExtenderCallError) as caught:
        _client(port).call("filter", {})
    assert str(caught.value) == f"failed filter with extender at URL http://127.0.0.1:{port}/scheduler, code 400"


def test_an_answer_that_is_not_json_is_an_extender_error() -> None:
    body = b"<html>proxy error</html>"
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with _raw_server(answer) as (port, _seen), pytest.raises(ExtenderCallError, match="filter"):
        _client(port).call("filter", {})


# -- the extender's HTTP server -------------------------------------------------------------------


def _exchange(port: int, data: bytes, *, answers: int) -> list[tuple[int, bytes]]:
    """Send ``data`` on one connection; read ``answers`` HTTP answers (status, body) off it (fewer when the
    server closes the connection or stays silent for 5 s)."""
    out: list[tuple[int, bytes]] = []
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(data)
        buffer = b""
        try:
            while len(out) < answers:
                while b"\r\n\r\n" not in buffer:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return out
                    buffer += chunk
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(
                    (int(x.split(b":", 1)[1]) for x in lines[1:] if x.lower().startswith(b"content-length:")), 0
                )
                if lines[0].split()[1] != b"204" and not data.startswith(b"HEAD"):
                    while len(buffer) < length:
                        chunk = sock.recv(65536)
                        if not chunk:
                            return out
                        buffer += chunk
                else:
                    length = 0
                out.append((int(lines[0].split()[1]), buffer[:length]))
                buffer = buffer[length:]
        except TimeoutError:
            pass
    return out


def test_a_get_with_a_body_keeps_the_connection_in_step(world: World) -> None:
    """A GET's body is read and dropped (as Go's server does), not parsed as the next request."""
    world.start_extender()
    port = world.extender.server.port
    data = b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhelloGET /version HTTP/1.1\r\nHost: x\r\n\r\n"
    answers = _exchange(port, data, answers=2)
    assert [code for code, _ in answers] == [200, 200], answers
    assert b"version" in answers[1][1].lower() or answers[1][1].startswith(b"{"), answers


def test_head_answers_the_headers_of_get(world: World) -> None:
    """Load balancers and probes may ask HEAD; Go's server answers it for every GET route."""
    world.start_extender()
    port = world.extender.server.port
    answers = _exchange(port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n", answers=1)
    assert answers == [(200, b"")], answers


def test_conflicting_content_lengths_are_refused(world: World) -> None:
    """Two Content-Length headers that differ (a request smuggled past a proxy) answer 400 and close the
    connection; the server read the first and waited for bytes that would never come."""
    world.start_extender()
    port = world.extender.server.port
    data = b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\nContent-Length: 2\r\n\r\n{}"
    answers = _exchange(port, data, answers=1)
    assert len(answers) == 1 and answers[0][0] == 400, answers
    assert b"Content-Length" in answers[0][1], answers


# -- bind -----------------------------------------------------------------------------------------


def test_a_pod_deleted_between_filter_and_bind_is_refused_as_deleted(world: World) -> None:
    """The watch still shows the pod (it lags) when the scheduler binds it: the annotation patch finds it
    gone (404). That is a refusal naming the deletion, not an API error of the extender's."""
    world.add_node("n", inventory([80]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    wait_for(lambda: world.extender.pods.get(pod["metadata"]["uid"]) is not None, what="the pod in the watch cache")
    world.api.hold_watches(True)
    world.api.delete_pod("default", "p")
    error = world.bind(pod, "n")
    world.api.hold_watches(False)
    assert error == "pod default/p (UID uid-p) was deleted before it could be bound", error
    assert world.extender.state.assumed_count() == 0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{world.extender.server.port}/metrics", timeout=10).read()
    assert b'gpu_extender_decisions_total{outcome="refused",verb="bind"} 1.0' in metrics
    assert b'outcome="error",verb="bind"' not in metrics


# -- the stand-in's queue -------------------------------------------------------------------------


def _ready(node: dict[str, Any], status: str) -> None:
    for condition in node["status"]["conditions"]:
        if condition["type"] == "Ready":
            condition["status"] = status


def test_a_node_turning_ready_moves_unschedulable_pods_back_to_the_queue() -> None:
    """kube-scheduler requeues unschedulable pods when a node's conditions, labels, taints or
    schedulability change, not only its allocatable or annotations: the stand-in left them waiting
    for its 5-minute flush."""
    api = ApiServerSimulator()
    api.start()
    scheduler = SchedulerStandIn(api.client(), initial_backoff=0.05, max_backoff=0.05, unschedulable_timeout=300)
    try:
        api.add_node("n", capacity={CORE: "100", MEMORY: "320"})
        api.update_node("n", lambda node: _ready(node, "False"))
        scheduler.start()
        api.create_pod(pending_pod("p", [(50, 4)]))
        wait_for(lambda: scheduler.stats.unschedulable >= 1, what="the pod found unschedulable")
        api.update_node("n", lambda node: _ready(node, "True"))
        wait_for(lambda: scheduler.stats.scheduled == 1, timeout=15, what="the pod scheduled once the node is Ready")
    finally:
        scheduler.stop()
        api.stop()


def test_a_pod_annotated_but_not_bound_when_the_extender_restarts_keeps_its_gpus(world: World) -> None:
    """The Binding got no answer, then the extender restarted: the new one, rebuilt from the API server
    alone, holds the pod's share from its annotations before and after the late Binding lands."""
    world.add_node("n", inventory([80]))
    world.start_extender(bind_timeout=1.0)
    pod = world.create(gpu_pod("p", [(60, 4)]))
    world.api.delay(r"/pods/p/binding$", 4.0, count=1)
    assert "the binding may still be made" in world.bind(pod, "n")
    world.stop_extender()
    world.start_extender()
    other = world.create(gpu_pod("q", [(60, 4)]))
    assert "no GPU has 60 free cores" in world.filter(other)["FailedNodes"]["n"]
    wait_for(lambda: (world.api.get_pod("default", "p") or {}).get("spec", {}).get("nodeName") == "n", timeout=10)
    wait_for(lambda: world.extender.state.pod_count() == 1, what="the extender counting the bound pod")
    assert "no longer fits" in world.bind(other, "n")


def test_a_client_dripping_its_request_is_dropped(world: World) -> None:
    """A client that sends its request a byte at a time, each within the idle timeout, held a thread for as
    long as it liked (the timeout was per read); a request must now arrive whole within the idle timeout
    of its first byte, or its connection is closed."""
    world.add_node("n", inventory([80]))
    ext = world.start_extender(idle_timeout=1.0)
    request = (
        b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 40 + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    dropped = False
    with socket.create_connection(("127.0.0.1", ext.server.port), timeout=10) as sock:
        try:
            for i in range(len(request)):
                sock.sendall(request[i : i + 1])
                ready, _, _ = select.select([sock], [], [], 0.25)  # 0.25 s between bytes
                if ready:  # the server answered or closed before the request was whole
                    dropped = sock.recv(65536) == b""
                    break
            else:
                answer = sock.recv(65536)
                dropped = answer == b""
        except (BrokenPipeError, ConnectionResetError):
            dropped = True
    assert dropped
    filtered = world.filter(world.create(gpu_pod("p", [(50, 4)])))
    assert [n["metadata"]["name"] for n in filtered["Nodes"]["items"]] == ["n"], filtered  # the others are served


def test_binds_run_as_many_at_once_as_pods_are_scheduled() -> None:
    """kube-scheduler binds each pod in a goroutine of its own, however many there are: a burst of pods
    reaches the extender's bind all at once. The stand-in bound 16 at a time."""
    pods = 24
    barrier = threading.Barrier(pods, timeout=10)
    most = [0]
    inside = [0]
    guard = threading.Lock()

    class FakeExtender(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path.endswith("/filter"):
                answer: object = {"NodeNames": args["NodeNames"], "FailedNodes": {}, "Error": ""}
            else:
                with guard:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                try:
                    barrier.wait()
                    answer = {"Error": ""}
                except threading.BrokenBarrierError:
                    answer = {"Error": "fewer binds at once than pods"}
                with guard:
                    inside[0] -= 1
            body = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    fake = ThreadingHTTPServer(("127.0.0.1", 0), FakeExtender)
    fake.daemon_threads = True
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    api = ApiServerSimulator()
    api.start()
    config = ExtenderConfig(
        url_prefix=f"http://127.0.0.1:{fake.server_address[1]}/scheduler",
        filter_verb="filter",
        bind_verb="bind",
        node_cache_capable=True,
        http_timeout=30,
        managed_resources=(CORE, MEMORY),
    )
    scheduler = SchedulerStandIn(api.client(), [config], initial_backoff=0.05, max_backoff=0.05)
    try:
        api.add_node("n", capacity={CORE: "10000", MEMORY: "100000"})
        scheduler.start()
        for i in range(pods):
            api.create_pod(pending_pod(f"p{i}", [(10, 4)]))
        wait_for(lambda: scheduler.stats.scheduled + scheduler.stats.bind_failures >= pods, timeout=30, what="binds")
        assert most[0] == pods, (most[0], scheduler.stats)
        assert scheduler.stats.bind_failures == 0
    finally:
        scheduler.stop()
        api.stop()
        fake.shutdown()
        fake.server_close()


def test_the_unschedulable_message_is_kube_schedulers_histogram() -> None:
    """kube-scheduler's FitError counts each reason over the nodes and names no node: the stand-in added
    every node's reason by name, which no one reading a real pod's condition gets."""
    api = ApiServerSimulator()
    api.start()
    scheduler = SchedulerStandIn(api.client(), initial_backoff=0.05, max_backoff=0.05)
    try:
        api.add_node("a", capacity={CORE: "100", MEMORY: "320"})
        api.add_node("b", capacity={CORE: "100", MEMORY: "320"})
        api.add_node("c", capacity={CORE: "0", MEMORY: "0"})
        scheduler.start()
        api.create_pod(pending_pod("p", [(200, 0)]))
        wait_for(lambda: "default/p" in scheduler.stats.messages, what="the pod found unschedulable")
        assert scheduler.stats.messages["default/p"] == f"0/3 nodes are available: 3 Insufficient {CORE}."
    finally:
        scheduler.stop()
        api.stop()


def test_two_schedulers_racing_for_the_last_share_bind_one_pod(world: World) -> None:
    """Two scheduler processes (the cluster's and a second one for GPU pods) call one extender: each
    filters its pod onto the GPU's last 60 cores, each asks the extender to bind; one pod is bound and
    the other is refused by bind, naming why, then found unschedulable."""
    world.add_node("n", inventory([80]), gpus=1)
    world.start_extender()
    config = ExtenderConfig(
        url_prefix=world.url,
        filter_verb="filter",
        prioritize_verb="prioritize",
        bind_verb="bind",
        http_timeout=10,
        managed_resources=(CORE, MEMORY),
    )
    schedulers = [
        SchedulerStandIn(world.api.client(), [config], scheduler_name=name, initial_backoff=0.05, max_backoff=0.05)
        for name in ("default-scheduler", "gpu-scheduler")
    ]
    try:
        for scheduler in schedulers:
            scheduler.start()
        for scheduler in schedulers:
            pod = pending_pod(f"for-{scheduler.scheduler_name}", [(60, 4)])
            pod["spec"]["schedulerName"] = scheduler.scheduler_name
            world.api.create_pod(pod)
        wait_for(lambda: sum(s.stats.scheduled for s in schedulers) == 1, what="one pod bound")
        wait_for(lambda: sum(s.stats.unschedulable for s in schedulers) >= 1, what="the other found unschedulable")
        bound = [p for p in world.api.pods() if p["spec"].get("nodeName")]
        assert len(bound) == 1, bound
        assert world.extender.state.over_committed() == {}
        messages = [m for s in schedulers for m in s.stats.messages.values()]
        # Whichever way the race went: the loser's node total was taken already, the extender's filter saw
        # the share held, or its bind found it gone ("no longer fits"); at last it is unschedulable.
        reasons = ("Insufficient", "no GPU has 60 free cores", "no longer fits")
        assert messages and all(any(r in m for r in reasons) for m in messages), messages
    finally:
        for scheduler in schedulers:
            scheduler.stop()


def test_every_profile_of_the_configuration_schedules_its_pods(tmp_path: Path) -> None:
    """kube-scheduler schedules the pods of each of its profiles (the extenders serve them all); the
    stand-in took the first profile's name only, and pods naming another stayed Pending for ever."""
    path = tmp_path / "config.yaml"
    path.write_text(
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        "profiles:\n  - schedulerName: default-scheduler\n  - schedulerName: gpu-scheduler\n"
    )
    names_, extenders = load_configuration(path)
    assert names_ == "default-scheduler" and extenders == []
    assert profile_names(path) == ("default-scheduler", "gpu-scheduler")
    api = ApiServerSimulator()
    api.start()
    scheduler = SchedulerStandIn(api.client(), scheduler_name=profile_names(path))
    try:
        api.add_node("n", capacity={CORE: "1000", MEMORY: "3200"})
        scheduler.start()
        for name in profile_names(path):
            pod = pending_pod(f"for-{name}", [(10, 4)])
            pod["spec"]["schedulerName"] = name
            api.create_pod(pod)
        wait_for(lambda: scheduler.stats.scheduled == 2, what="a pod of each profile bound")
    finally:
        scheduler.stop()
        api.stop()
