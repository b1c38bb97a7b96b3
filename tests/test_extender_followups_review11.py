"""The extender's flags, request bounds, filter reasons and unanswered Bindings."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from gpumanager.extender import server as server_module
from gpumanager.extender.metrics import ExtenderMetrics
from gpumanager.extender.server import ExtenderServer, Routes
from simnode.apiserver import ApiServerSimulator
from tests.extender_fixtures import World, gpu_pod, held, inventory, wait_for

CMD = [sys.executable, "-m", "gpumanager.extender.cli"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "ttl", "bind"),
    [
        (["--assume-ttl=2", "--bind-timeout=4"], "2", "4"),
        (["--assume-ttl=3"], "3", "4"),  # the default --bind-timeout
        (["--assume-ttl=10", "--bind-timeout=10.5"], "10", "10.5"),
    ],
)
def test_an_assume_ttl_below_the_bind_timeout_is_refused_at_start(args: list[str], ttl: str, bind: str) -> None:
    """An assumption could lapse while its bind still runs: refused, exit 2, one line naming both flags."""
    done = _run(*args, "--kubeconfig=/nonexistent")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"--assume-ttl={ttl}" in lines[0] and f"--bind-timeout={bind}" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_an_assume_ttl_equal_to_the_bind_timeout_is_taken() -> None:
    done = _run("--assume-ttl=4", "--bind-timeout=4", "--kubeconfig=/nonexistent")
    assert done.returncode == 2 and "--kubeconfig=/nonexistent: no such file" in done.stderr, done.stderr


# -- 2. request bodies and connections are bounded ------------------------------------------------


def _server(**kw: Any) -> ExtenderServer:
    routes = Routes(verbs={"filter": lambda body: ({"n": len(body)}, 200)}, ready=lambda: (True, {}), version={})
    server = ExtenderServer("127.0.0.1", 0, routes, ExtenderMetrics(lambda: {}), idle_timeout=30, **kw)
    server.start()
    return server


def _ask(sock: socket.socket, body: bytes = b"{}") -> tuple[int, bytes]:
    """One filter request on ``sock``; (status, body) of its answer."""
    sock.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, resp.read()


def test_a_body_larger_than_the_documented_bound_gets_413_naming_it() -> None:
    server = _server()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            n = server_module.MAX_BODY + 1
            sock.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % n)
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            answer = json.loads(resp.read())
            assert resp.status == 413, answer
            assert f"{n} bytes" in answer["Error"] and str(server_module.MAX_BODY) in answer["Error"], answer
            assert "nodeCacheCapable" in answer["Error"], answer
            assert resp.getheader("Connection") == "close"
        assert server_module.MAX_BODY == 48 << 20
    finally:
        server.stop()


def test_idle_connections_do_not_hold_a_thread_each_nor_keep_calls_out() -> None:
    """Each connection held a thread of its own, without limit (hundreds of idle connections, hundreds
    of threads); at the limit the idle ones are closed, the longest idle first, and calls are answered."""
    server = _server(max_connections=8)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(40)]
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            started = time.monotonic()
            assert _ask(sock)[0] == 200
            assert time.monotonic() - started < 2
        wait_for(lambda: threading.active_count() - before <= 8 + 1, timeout=5)
        closed = 0
        for s in idle:
            s.settimeout(0.2)
            try:
                closed += s.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:
                closed += 1
        assert closed >= 40 - 8, closed
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_connections_beyond_the_limit_while_all_are_busy_get_503_quickly() -> None:
    server = _server(max_connections=3)
    busy = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
    try:
        for s in busy:  # a request begun, its body not sent whole
            s.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        time.sleep(0.3)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            status, body = _ask(sock)
        assert status == 503, body
        assert "3 connections" in json.loads(body)["Error"], body
        assert time.monotonic() - started < 3
        busy.pop().close()  # one ends: the next connection is served
        wait_for(lambda: _try_ask(server.port) == 200, timeout=5)
    finally:
        for s in busy:
            s.close()
        server.stop()


def _try_ask(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        return _ask(sock)[0]


def test_large_bodies_are_taken_one_budget_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many large bodies at once (each under the bound) would add up past the memory limit: the bodies
    being read and answered share a budget; one that does not fit waits, then gets 503."""
    monkeypatch.setattr(server_module, "BODY_WAIT", 0.5)
    server = _server(max_body=1 << 20)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as holder:
            holder.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 800000\r\n\r\n{")
            time.sleep(0.3)
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                status, body = _ask(sock, b" " * 400_000 + b"{}")
                assert status == 503 and "being read" in json.loads(body)["Error"], body
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                assert _ask(sock) == (200, b'{"n":2}')  # a small body is never held up
            holder.sendall(b" " * (800000 - 2) + b"}")
            resp = http.client.HTTPResponse(holder)
            resp.begin()
            assert resp.status == 200 and resp.read() == b'{"n":800000}'
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            assert _ask(sock, b" " * 400_000 + b"{}")[0] == 200
    finally:
        server.stop()


# -- 3. filter reasons fold across nodes ----------------------------------------------------------


@pytest.fixture
def world() -> Iterator[World]:
    api = ApiServerSimulator()
    api.start()
    w = World(api)
    try:
        yield w
    finally:
        for ext in w.extenders:
            ext.stop()
        api.stop()


def test_equal_failures_give_equal_reasons_that_the_scheduler_folds(world: World) -> None:
    """Each reason named its node, so the scheduler's message counted every node apart ("1 node n1: ...,
    1 node n2: ...") and grew with the cluster; the node is the reason's key, not part of it."""
    nodes = [f"n{i}" for i in range(6)]
    for node in nodes:
        world.add_node(node, inventory([80]), gpus=1)
        world.create(gpu_pod(f"on-{node}", [(60, 4)], node=node, annotations=held(node, [[0]]), phase="Running"))
    world.add_node("cpu", None, gpus=0)
    world.start_extender()
    world.wait_seen(len(nodes))
    answer = world.filter(world.create(gpu_pod("a", [(60, 4)])))
    assert set(answer["FailedNodes"]) == set(nodes), answer
    assert len(set(answer["FailedNodes"].values())) == 1, answer["FailedNodes"]
    reason = answer["FailedNodes"]["n0"]
    assert "container 'c0' needs 60 cores" in reason and "no GPU has 60 free cores" in reason, reason
    assert not any(node in reason for node in nodes), reason
    assert answer["FailedAndUnresolvableNodes"]["cpu"] == "node has no tencent.com/vcuda-core", answer
    odd = world.create(gpu_pod("odd", [(150, 0)]))
    unresolvable = world.filter(odd, nodes)["FailedAndUnresolvableNodes"]
    assert len(set(unresolvable.values())) == 1 and "150 tencent.com/vcuda-core" in unresolvable["n0"], unresolvable
    unknown = world.post("filter", {"Pod": odd, "NodeNames": ["ghost-1", "ghost-2"]})["FailedAndUnresolvableNodes"]
    assert len(set(unknown.values())) == 1 and "not known to the extender" in unknown["ghost-1"], unknown
    assert "ghost" not in unknown["ghost-1"], unknown


# -- 4. a pod whose Binding got no answer ---------------------------------------------------------


def test_while_a_binding_got_no_answer_filter_passes_only_its_node(world: World) -> None:
    """filter passed the pod on every node with room while bind refused all but the node of its unanswered
    Binding (for up to --assume-ttl): the scheduler kept choosing nodes bind could only refuse."""
    for node in ("n", "m", "k"):
        world.add_node(node, inventory([80]), gpus=1)
    world.start_extender(bind_timeout=1.0)
    pod = world.create(gpu_pod("p", [(60, 4)]))
    world.api.delay(r"/pods/p/binding$", 4.0, method="POST", count=1)  # made, but answered too late
    assert "may still be made" in world.bind(pod, "n")
    answer = world.filter(pod)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["n"], answer
    others = answer["FailedAndUnresolvableNodes"]
    assert set(others) == {"m", "k"} and others["m"] == others["k"], answer
    assert "Binding of the pod to node n got no answer" in others["m"], others
    assert answer["FailedNodes"] == {}, answer
    assert "an earlier Binding to node n got no answer" in world.bind(pod, "m")  # as bind says
    wait_for(lambda: (world.api.get_pod("default", "p") or {})["spec"].get("nodeName") == "n", what="the binding")
