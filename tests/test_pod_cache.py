"""The pod cache through the real kubernetes client: list, watch, resume, relist on 410, survive outages."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import urllib3

from gpumanager.kube.pods import PodCache
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator(history=50) as sim:
        sim.add_node("node-1")
        yield sim


@pytest.fixture
def cache(api: ApiServerSimulator) -> Iterator[PodCache]:
    c = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, watch_timeout=30)
    c.start()
    assert c.wait_synced(10)
    yield c
    c.stop()


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def names(cache: PodCache) -> set[str]:
    return {p["metadata"]["name"] for p in cache.pods()}


def test_only_this_nodes_pods_and_live_updates(api: ApiServerSimulator, cache: PodCache) -> None:
    api.create_pod(pod_manifest("mine"))
    api.create_pod(pod_manifest("other", node="node-2"))
    eventually(lambda: names(cache) == {"mine"})
    uid = cache.pods()[0]["metadata"]["uid"]
    api.update_pod("default", "mine", lambda p: p["metadata"].setdefault("annotations", {}).update({"k": "v"}))
    eventually(lambda: (cache.get(uid) or {}).get("metadata", {}).get("annotations", {}).get("k") == "v")
    assert cache.find("default", "mine") is not None
    api.delete_pod("default", "mine")
    eventually(lambda: names(cache) == set())


def test_watch_resumes_after_the_stream_drops(api: ApiServerSimulator, cache: PodCache) -> None:
    api.wait_for_watches(1)
    lists = cache.lists
    api.close_watches()
    api.create_pod(pod_manifest("after-drop"))
    eventually(lambda: names(cache) == {"after-drop"})
    assert cache.lists == lists, "a dropped stream resumes from the resourceVersion without listing again"


def test_too_old_resource_version_relists(api: ApiServerSimulator, cache: PodCache) -> None:
    api.wait_for_watches(1)
    lists = cache.lists
    api.set_down(True)
    api.close_watches()
    for i in range(60):  # more changes than the server keeps
        api.create_pod(pod_manifest(f"p{i}", node="node-2"))
    api.create_pod(pod_manifest("survivor"))
    api.compact()
    api.set_down(False)
    eventually(lambda: names(cache) == {"survivor"}, timeout=20)
    assert cache.lists > lists


def test_outage_then_recovery(api: ApiServerSimulator) -> None:
    api.set_down(True, mode="refuse")
    c = PodCache(api.client(retries=False), "node-1", request_timeout=1.0)
    c.start()
    try:
        time.sleep(1.0)
        assert not c.synced()
        with pytest.raises(urllib3.exceptions.HTTPError):
            c.refresh()
        api.set_down(False)
        api.create_pod(pod_manifest("late"))
        assert c.wait_synced(15)
        eventually(lambda: names(c) == {"late"})
    finally:
        c.stop()


def test_stop_returns_while_the_watch_is_quiet() -> None:
    # No event and no bookmark for an hour: stop() must not wait for the next byte of the stream.
    with ApiServerSimulator(bookmark_interval=3600) as sim:
        c = PodCache(sim.client(), "node-1")
        c.start()
        assert c.wait_synced(10) and sim.wait_for_watches(1)
        stopped = threading.Event()
        threading.Thread(target=lambda: (c.stop(), stopped.set()), daemon=True).start()
        assert stopped.wait(30), "PodCache.stop() hangs while its watch is idle"
