"""Lists in pages (``limit``/``continue``) for the reflector, the pod cache and the REST helper.

A list of a large cluster is asked for in pages of ``LIST_PAGE_SIZE``; the state is replaced only
once every page is in; a continue token that expired (410, after a compaction) starts the list
again; the watch starts from the resourceVersion of the last page.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from gpumanager.kube import pager
from gpumanager.kube.pods import PodCache
from gpumanager.kube.reflector import Reflector
from gpumanager.kube.rest import KubeRest
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest
from tests.extender_fixtures import wait_for


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator(history=200, bookmark_interval=3600) as sim:
        sim.add_node("node-1")
        yield sim


def _list_requests(api: ApiServerSimulator) -> list[Mapping[str, str]]:
    return [
        r.query for r in api.requests if r.method == "GET" and r.path == "/api/v1/pods" and not r.query.get("watch")
    ]


def _names(objs: list[Any]) -> set[str]:
    return {o["metadata"]["name"] for o in objs}


# -- the reflector (the extender's pod and node watches) ---------------------------------------------


def test_the_reflector_lists_in_pages_of_the_default_size(api: ApiServerSimulator) -> None:
    api.create_pod(pod_manifest("a"))
    r = Reflector("pods", client.CoreV1Api(api.client()).list_pod_for_all_namespaces)
    r.start()
    try:
        assert r.wait_synced(10)
        queries = _list_requests(api)
        assert queries and all(q.get("limit") == str(pager.LIST_PAGE_SIZE) for q in queries), queries
        assert pager.LIST_PAGE_SIZE == 500
    finally:
        r.stop()


def test_the_reflector_takes_every_page_before_showing_the_list(api: ApiServerSimulator) -> None:
    for i in range(7):
        api.create_pod(pod_manifest(f"p{i}"))
    list_pods = client.CoreV1Api(api.client()).list_pod_for_all_namespaces
    second_page, release = threading.Event(), threading.Event()
    timeouts: list[Any] = []

    def call(**kw: Any) -> Any:
        if not kw.get("watch"):
            timeouts.append(kw.get("_request_timeout"))
        if kw.get("_continue") and not second_page.is_set():
            second_page.set()
            release.wait(10)
        return list_pods(**kw)

    events: list[tuple[str, str]] = []
    r = Reflector("pods", call, page_size=3, request_timeout=7.0)
    r.add_listener(lambda kind, obj, _prev: events.append((kind, obj["metadata"]["name"])))
    r.start()
    try:
        wait_for(second_page.is_set, what="a second page asked for")
        assert not r.synced() and r.objects() == [] and events == [], "a half-listed state was shown"
        release.set()
        assert r.wait_synced(10)
        assert _names(r.objects()) == {f"p{i}" for i in range(7)}
        assert sorted(events) == sorted(("ADDED", f"p{i}") for i in range(7))
        queries = _list_requests(api)
        assert [q.get("limit") for q in queries] == ["3", "3", "3"]
        assert [bool(q.get("continue")) for q in queries] == [False, True, True]
        assert timeouts == [7.0, 7.0, 7.0], "each page has its own timeout"
    finally:
        release.set()
        r.stop()


def test_the_reflector_lists_again_when_a_continue_token_expired(api: ApiServerSimulator) -> None:
    for i in range(5):
        api.create_pod(pod_manifest(f"p{i}"))
    list_pods = client.CoreV1Api(api.client()).list_pod_for_all_namespaces
    compacted = threading.Event()

    def call(**kw: Any) -> Any:
        if kw.get("_continue") and not compacted.is_set():
            compacted.set()  # history moves on and is compacted between two pages
            api.create_pod(pod_manifest("late"))
            api.delete_pod("default", "p0")
            api.compact()
        return list_pods(**kw)

    r = Reflector("pods", call, page_size=2)
    r.start()
    try:
        assert r.wait_synced(10)
        assert _names(r.objects()) == {"p1", "p2", "p3", "p4", "late"}
        assert r.lists == 1
        statuses = [x.status for x in api.requests if x.path == "/api/v1/pods" and not x.query.get("watch")]
        assert 410 in statuses and statuses[-1] == 200
        api.create_pod(pod_manifest("watched"))
        wait_for(lambda: "watched" in _names(r.objects()), what="the watch after the list")
    finally:
        r.stop()


class _FakePages:
    """A ``list_call`` answering pages of fake pods, each page with its own resourceVersion."""

    def __init__(self, pages: int, *, expire: int = 0) -> None:
        self.pages = pages
        self.expire = expire  # continue tokens answered 410 so many times
        self.calls: list[dict[str, Any]] = []
        self.watched = threading.Event()

    def __call__(self, **kw: Any) -> Any:
        self.calls.append(kw)
        if kw.get("watch"):
            self.watched.set()
            raise ConnectionError("no watch here")
        if kw.get("_continue") and self.expire > 0:
            self.expire -= 1
            raise ApiException(status=410, reason="Gone")
        if not kw.get("limit"):  # one list of everything
            items = [_fake_pod(i) for i in range(self.pages)]
            return SimpleNamespace(data=json.dumps({"metadata": {"resourceVersion": "99"}, "items": items}).encode())
        index = int(kw.get("_continue") or 0)
        meta: dict[str, str] = {"resourceVersion": str(100 + index)}
        if index + 1 < self.pages:
            meta["continue"] = str(index + 1)
        body = {"metadata": meta, "items": [_fake_pod(index)]}
        return SimpleNamespace(data=json.dumps(body).encode())


def _fake_pod(i: int) -> dict[str, Any]:
    return {"metadata": {"name": f"f{i}", "uid": f"u{i}", "resourceVersion": "1"}}


def test_the_watch_starts_from_the_last_pages_resource_version() -> None:
    fake = _FakePages(3)
    r = Reflector("pods", fake, page_size=1)
    r.start()
    try:
        assert r.wait_synced(10)
        assert fake.watched.wait(10)
        watch = next(c for c in fake.calls if c.get("watch"))
        assert watch["resource_version"] == "102"
        assert _names(r.objects()) == {"f0", "f1", "f2"}
    finally:
        r.stop()


def test_a_list_whose_tokens_keep_expiring_ends_in_one_full_list() -> None:
    fake = _FakePages(3, expire=100)
    r = Reflector("pods", fake, page_size=1)
    r.start()
    try:
        assert r.wait_synced(10)
        lists = [c for c in fake.calls if not c.get("watch")]
        restarts = [c for c in lists if c.get("limit") and not c.get("_continue")]
        assert len(restarts) == pager.EXPIRED_RESTARTS + 1
        assert not lists[-1].get("limit"), "after so many expired tokens, one list without a limit (as client-go)"
        assert _names(r.objects()) == {"f0", "f1", "f2"}
        assert fake.watched.wait(10)
        assert next(c for c in fake.calls if c.get("watch"))["resource_version"] == "99"
    finally:
        r.stop()


def test_a_410_on_the_first_page_is_not_taken_for_an_expired_token() -> None:
    def fetch(limit: int | None, token: str) -> Mapping[str, Any]:
        raise ApiException(status=410, reason="Gone")

    with pytest.raises(ApiException):
        pager.list_pages(fetch, what="pods")


# -- the agent's pod cache and the REST helper ------------------------------------------------------


def test_the_pod_cache_lists_in_pages_and_shows_only_complete_lists(api: ApiServerSimulator) -> None:
    for i in range(5):
        api.create_pod(pod_manifest(f"p{i}"))
    api.create_pod(pod_manifest("elsewhere", node="node-2"))
    cache = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, page_size=2)
    real = cache._rest.request
    second_page, release = threading.Event(), threading.Event()

    def request(method: str, path: str, **kw: Any) -> Any:
        if dict(kw.get("query") or ()).get("continue") and not second_page.is_set():
            second_page.set()
            release.wait(10)
        return real(method, path, **kw)

    cache._rest.request = request  # type: ignore[method-assign]
    cache.start()
    try:
        wait_for(second_page.is_set, what="a second page asked for")
        assert not cache.synced() and cache.pods() == []
        release.set()
        assert cache.wait_synced(10)
        assert _names(cache.pods()) == {f"p{i}" for i in range(5)}
        queries = _list_requests(api)
        assert [q.get("limit") for q in queries] == ["2", "2", "2"]
        assert all(q.get("fieldSelector") == "spec.nodeName=node-1" for q in queries)
        assert _names(cache.refresh()) == {f"p{i}" for i in range(5)}
    finally:
        release.set()
        cache.stop()


def test_the_pod_cache_lists_again_when_a_continue_token_expired(api: ApiServerSimulator) -> None:
    for i in range(5):
        api.create_pod(pod_manifest(f"p{i}"))
    cache = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, page_size=2)
    real = cache._rest.request
    compacted = threading.Event()

    def request(method: str, path: str, **kw: Any) -> Any:
        if dict(kw.get("query") or ()).get("continue") and not compacted.is_set():
            compacted.set()
            api.create_pod(pod_manifest("late"))
            api.compact()
        return real(method, path, **kw)

    cache._rest.request = request  # type: ignore[method-assign]
    cache.start()
    try:
        assert cache.wait_synced(10)
        assert _names(cache.pods()) == {"p0", "p1", "p2", "p3", "p4", "late"}
        assert cache.lists == 1
        assert 410 in [x.status for x in api.requests if x.path == "/api/v1/pods"]
    finally:
        cache.stop()


def test_rest_list_objects_joins_the_pages(api: ApiServerSimulator) -> None:
    for i in range(5):
        api.create_pod(pod_manifest(f"p{i}"))
    rest = KubeRest(api.client(retries=False))
    listed = rest.list_objects("/api/v1/pods", field_selector="", timeout=5, page_size=2)
    assert [p["metadata"]["name"] for p in listed["items"]] == [f"p{i}" for i in range(5)]
    assert listed["metadata"]["resourceVersion"] == str(api.resource_version)
    assert "continue" not in listed["metadata"]
    assert [q.get("limit") for q in _list_requests(api)] == ["2", "2", "2"]
    rest.list_objects("/api/v1/pods", field_selector="", timeout=5)
    assert _list_requests(api)[-1].get("limit") == "500"
