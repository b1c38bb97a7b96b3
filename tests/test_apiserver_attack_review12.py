"""The agent's API-server side against an API server that misbehaves as real ones (and the proxies in
front of them) do: long Retry-After answers, objects of unexpected shape, streams that stop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

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
