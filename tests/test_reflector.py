"""The generic list+watch cache: events with the previous object, filters, relist on 410, quiet stop."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from gpumanager.kube.reflector import Reflector
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_objects import pod_manifest
from tests.extender_fixtures import wait_for


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    with ApiServerSimulator(history=20, bookmark_interval=3600) as sim:
        yield sim


def start(api: ApiServerSimulator, **kw: Any) -> tuple[Reflector, list[tuple[str, str, str | None]]]:
    events: list[tuple[str, str, str | None]] = []
    r = Reflector("pods", client.CoreV1Api(api.client()).list_pod_for_all_namespaces, **kw)
    r.add_listener(
        lambda kind, obj, prev: events.append(
            (kind, obj["metadata"]["name"], (prev or {}).get("metadata", {}).get("resourceVersion"))
        )
    )
    r.start()
    assert r.wait_synced(10)
    return r, events


def test_events_carry_the_previous_object_and_keep_filters(api: ApiServerSimulator) -> None:
    api.create_pod(pod_manifest("before"))
    r, events = start(api, keep=lambda p: "drop" not in (p["metadata"].get("labels") or {}))
    try:
        assert events == [("ADDED", "before", None)]
        rv = api.get_pod("default", "before")["metadata"]["resourceVersion"]  # type: ignore[index]
        api.update_pod("default", "before", lambda p: p["metadata"].setdefault("labels", {}).update(a="1"))
        wait_for(lambda: len(events) == 2)
        assert events[1] == ("MODIFIED", "before", rv)
        api.update_pod("default", "before", lambda p: p["metadata"]["labels"].update(drop="yes"))
        wait_for(lambda: len(events) == 3)
        assert events[2][:2] == ("DELETED", "before") and len(r) == 0
    finally:
        r.stop()


def test_relist_after_410_delivers_the_difference(api: ApiServerSimulator) -> None:
    api.create_pod(pod_manifest("stays"))
    api.create_pod(pod_manifest("goes"))
    r, events = start(api)
    try:
        api.wait_for_watches(1)
        lists = r.lists
        api.set_down(True)  # the watch ends; meanwhile history moves on and is compacted
        api.delete_pod("default", "goes")
        api.create_pod(pod_manifest("new"))
        api.compact()
        api.set_down(False)
        wait_for(lambda: r.lists > lists, what="a relist", timeout=30)
        wait_for(lambda: {p["metadata"]["name"] for p in r.objects()} == {"stays", "new"})
        assert ("DELETED", "goes") in [(k, n) for k, n, _ in events] and ("ADDED", "new") in [
            (k, n) for k, n, _ in events
        ]
    finally:
        r.stop()


def test_stop_returns_while_the_watch_is_quiet(api: ApiServerSimulator) -> None:
    r, _ = start(api)
    assert api.wait_for_watches(1)
    stopped = threading.Event()
    threading.Thread(target=lambda: (r.stop(), stopped.set()), daemon=True).start()
    assert stopped.wait(30), "Reflector.stop() hangs while its watch is idle"
