"""The pod cache through the real kubernetes client: list, watch, resume, relist on 410, survive outages."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import urllib3

from gpumanager.kube import pods as podcache
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


def uid_named(cache: PodCache, name: str) -> str:
    return next(p["metadata"]["uid"] for p in cache.pods() if p["metadata"]["name"] == name)


def test_changes_name_the_pods_changed_since_a_generation(api: ApiServerSimulator, cache: PodCache) -> None:
    start, everything = cache.changes(-1)
    assert everything is None, "a reader's first look must be at every pod"
    api.create_pod(pod_manifest("a"))
    api.create_pod(pod_manifest("b"))
    eventually(lambda: names(cache) == {"a", "b"})
    a, b = uid_named(cache, "a"), uid_named(cache, "b")
    created, changed = cache.changes(start)
    assert changed == {a, b} and created > start
    assert cache.changes(created) == (created, frozenset())
    api.update_pod("default", "a", lambda p: p["metadata"].setdefault("labels", {}).update({"k": "v"}))
    eventually(lambda: cache.changes(created)[1] == {a})
    updated, _ = cache.changes(created)
    api.delete_pod("default", "b")
    eventually(lambda: cache.changes(updated)[1] == {b})
    assert cache.changes(created)[1] == {a, b}, "every change after the reader's generation, not only the last"


def test_a_relist_tells_readers_to_look_at_every_pod(api: ApiServerSimulator, cache: PodCache) -> None:
    api.create_pod(pod_manifest("before"))
    eventually(lambda: names(cache) == {"before"})
    seen, _ = cache.changes(-1)
    api.wait_for_watches(1)
    lists = cache.lists
    api.set_down(True)
    api.close_watches()
    api.delete_pod("default", "before")  # its DELETED event is compacted away: only the relist shows it
    for i in range(60):
        api.create_pod(pod_manifest(f"p{i}", node="node-2"))
    api.compact()
    api.set_down(False)
    eventually(lambda: cache.lists > lists and names(cache) == set(), timeout=20)
    assert cache.changes(seen)[1] is None


def test_a_reader_further_behind_than_the_changes_kept_looks_at_every_pod(
    api: ApiServerSimulator, cache: PodCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podcache, "CHANGES_KEPT", 2)
    start, _ = cache.changes(-1)
    for name in ("a", "b", "c"):
        api.create_pod(pod_manifest(name))
    eventually(lambda: names(cache) == {"a", "b", "c"})
    now, changed = cache.changes(start)
    assert changed is None, "the change of pod a is no longer known: the reader must not miss it"
    assert cache.changes(now - 2)[1] == {uid_named(cache, "b"), uid_named(cache, "c")}


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
        c = PodCache(sim.component_client("device-plugin"), "node-1")
        c.start()
        assert c.wait_synced(10) and sim.wait_for_watches(1)
        stopped = threading.Event()
        threading.Thread(target=lambda: (c.stop(), stopped.set()), daemon=True).start()
        assert stopped.wait(30), "PodCache.stop() hangs while its watch is idle"


def test_cached_pods_drop_managed_fields_and_share_their_strings() -> None:
    def api_pod(name: str) -> dict[str, object]:
        pod = pod_manifest(name)
        pod["metadata"]["uid"] = f"uid-{name}"
        pod["metadata"]["managedFields"] = [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}]
        pod["metadata"]["annotations"] = {"note": "x" * 300}
        return json.loads(json.dumps(pod))  # decoded apart, as two watch events are

    a, b = podcache.compact(api_pod("a")), podcache.compact(api_pod("b"))
    expected = api_pod("a")
    del expected["metadata"]["managedFields"]  # type: ignore[attr-defined]
    assert a == expected
    image_a, image_b = (p["spec"]["containers"][0]["image"] for p in (a, b))
    assert image_a == image_b and image_a is image_b
    key_a = next(k for k in a["spec"]["containers"][0] if k == "image")
    key_b = next(k for k in b["spec"]["containers"][0] if k == "image")
    assert key_a is key_b
    assert a["metadata"]["annotations"]["note"] == "x" * 300


def test_the_cache_keeps_compacted_pods(api: ApiServerSimulator, cache: PodCache) -> None:
    api.create_pod(pod_manifest("one"))
    api.create_pod(pod_manifest("two"))
    eventually(lambda: names(cache) == {"one", "two"})
    one, two = sorted(cache.pods(), key=lambda p: p["metadata"]["name"])
    assert one["metadata"]["namespace"] is two["metadata"]["namespace"]
    assert one["spec"]["containers"][0]["image"] is two["spec"]["containers"][0]["image"]


def test_a_list_keeps_compacted_pods_too(api: ApiServerSimulator) -> None:
    api.create_pod(pod_manifest("one"))
    api.create_pod(pod_manifest("two"))
    listed = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, watch_timeout=30)
    listed.start()
    try:
        assert listed.wait_synced(10) and listed.lists == 1
        one, two = sorted(listed.pods(), key=lambda p: p["metadata"]["name"])
        assert one["spec"]["containers"][0]["image"] is two["spec"]["containers"][0]["image"]
    finally:
        listed.stop()


def test_find_by_name_follows_every_change(api: ApiServerSimulator) -> None:
    cache = PodCache(api.client(retries=False), "node-1")  # fed events directly

    def event(kind: str, uid: str, name: str, namespace: str = "default") -> dict[str, object]:
        return {"type": kind, "object": {"metadata": {"uid": uid, "name": name, "namespace": namespace}}}

    def found(namespace: str, name: str) -> str | None:
        pod = cache.find(namespace, name)
        return None if pod is None else str(pod["metadata"]["uid"])

    cache._apply(event("ADDED", "u1", "web-0"))
    cache._apply(event("ADDED", "u2", "web-0", "other"))
    assert (found("default", "web-0"), found("other", "web-0"), found("default", "web-1")) == ("u1", "u2", None)
    # A StatefulSet's pod replaced: the old one (terminating) and the new one share the name for a while.
    cache._apply(event("ADDED", "u3", "web-0"))
    cache._apply(event("MODIFIED", "u1", "web-0"))
    assert found("default", "web-0") == "u1"
    cache._apply(event("DELETED", "u1", "web-0"))
    assert found("default", "web-0") == "u3"
    cache._apply(event("DELETED", "u3", "web-0"))
    cache._apply(event("DELETED", "u3", "web-0"))  # told twice: nothing more to forget
    assert found("default", "web-0") is None
    cache._apply(event("MODIFIED", "u4", "web-1"))  # first seen as a change
    assert found("default", "web-1") == "u4"


def test_find_by_name_after_a_relist(api: ApiServerSimulator, cache: PodCache) -> None:
    api.create_pod(pod_manifest("before"))
    eventually(lambda: cache.find("default", "before") is not None)
    cache._relist()
    assert cache.find("default", "before") is not None
    api.delete_pod("default", "before")
    eventually(lambda: cache.find("default", "before") is None)


class _SlowFirstList:
    """PodCache._list whose first answer waits for ``release``; ``taken`` counts each list's pods."""

    def __init__(self, cache: PodCache) -> None:
        self._real = cache._list
        self.release = threading.Event()
        self.taken: list[int] = []
        cache._list = self  # type: ignore[method-assign]

    def __call__(self) -> tuple[list[dict[str, object]], str]:
        answer = self._real()
        self.taken.append(len(answer[0]))
        if len(self.taken) == 1:
            self.release.wait(10)  # the first list's answer is slow to arrive
        return answer


class _ArrivalLock:
    """PodCache's refresh lock, noting each thread that took it: a caller of refresh takes it once it
    arrived (its arrival time taken) to find the list on its way."""

    def __init__(self, cache: PodCache) -> None:
        self._lock = cache._refresh_lock
        self.takers: set[int | None] = set()
        cache._refresh_lock = self  # type: ignore[assignment]

    def __enter__(self) -> _ArrivalLock:
        self._lock.acquire()
        self.takers.add(threading.get_ident())
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def arrived(self, threads: list[threading.Thread]) -> bool:
        return {t.ident for t in threads} <= self.takers


def test_a_refresh_never_answers_with_a_list_taken_before_it_was_asked(api: ApiServerSimulator) -> None:
    # A list in flight when a caller arrives may predate pods the caller knows of: the allocator
    # frees the holders such a list lacks. The caller waits for it, then for a list of its own.
    c = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, refresh_deadline=10.0)
    slow = _SlowFirstList(c)
    first: list[list[dict[str, object]]] = []
    t = threading.Thread(target=lambda: first.append(c.refresh()))
    t.start()
    eventually(lambda: len(slow.taken) == 1)
    api.create_pod(pod_manifest("late"))
    second: list[list[dict[str, object]]] = []
    lock = _ArrivalLock(c)
    t2 = threading.Thread(target=lambda: second.append(c.refresh()))
    t2.start()
    eventually(lambda: lock.arrived([t2]))  # it found the first list on its way (a loaded machine may delay it)
    slow.release.set()
    t.join(10)
    t2.join(10)
    assert [p["metadata"]["name"] for p in first[0]] == []
    assert [p["metadata"]["name"] for p in second[0]] == ["late"], "answered with a list taken before it was asked"
    assert slow.taken == [0, 1]


def test_callers_arriving_while_a_list_is_on_its_way_share_the_next_one(api: ApiServerSimulator) -> None:
    c = PodCache(api.client(retries=False), "node-1", request_timeout=2.0, refresh_deadline=10.0)
    slow = _SlowFirstList(c)
    threads = [threading.Thread(target=c.refresh)]
    threads[0].start()
    eventually(lambda: len(slow.taken) == 1)
    lock = _ArrivalLock(c)
    threads += [threading.Thread(target=c.refresh) for _ in range(5)]
    for t in threads[1:]:
        t.start()
    eventually(lambda: lock.arrived(threads[1:]))  # each found the first list on its way
    slow.release.set()
    for t in threads:
        t.join(10)
    assert len(slow.taken) == 2, f"{len(slow.taken)} lists for 6 callers: the five late ones must share one"


def _pod_lists(api: ApiServerSimulator) -> int:
    return sum(
        1
        for r in api.requests
        if r.method == "GET" and r.path == "/api/v1/pods" and r.query.get("watch") not in ("true", "1")
    )


def test_a_recent_list_serves_only_while_the_cache_knows_nothing_newer(
    api: ApiServerSimulator, cache: PodCache
) -> None:
    """recent() gives the last fresh list to find a pod the watch has not shown yet: only a list sent since the
    time asked, younger than asked, and never once the cache took in a change after that list was sent (a
    pod it lists may be gone)."""
    asked = time.monotonic()
    assert cache.recent(60.0, asked) is None  # no fresh list yet
    generation = cache.changes(0)[0]
    api.hold_watches(True)
    try:
        api.create_pod(pod_manifest("late"))
        listed = cache.refresh()
        assert [p["metadata"]["name"] for p in listed] == ["late"]
        assert names(cache) == set()  # the watch lags
        recent = cache.recent(60.0, asked)
        assert recent is not None and [p["metadata"]["name"] for p in recent] == ["late"]
        assert cache.recent(0.0, asked) is None  # older than the caller takes
        assert cache.recent(60.0, time.monotonic()) is None  # sent before the caller's time
        api.delete_pod("default", "late")
    finally:
        api.hold_watches(False)
    eventually(lambda: cache.changes(0)[0] >= generation + 2)  # the cache took in the creation and the deletion
    assert cache.recent(60.0, asked) is None
    assert cache.lookup("default", "late", asked) is None  # asked again: gone


def test_a_lookup_the_cache_cannot_answer_uses_a_list_sent_since_the_time_given(
    api: ApiServerSimulator, cache: PodCache
) -> None:
    """A PreStartContainer right after the Allocate that listed the pods finds its pod in that list: one list
    for both, while the watch lags. Without a time, or with one after the list was sent, it lists again."""
    api.hold_watches(True)
    try:
        api.create_pod(pod_manifest("late"))
        began = time.monotonic()
        cache.refresh()
        api.clear_requests()
        assert (cache.lookup("default", "late", began) or {}).get("metadata", {}).get("name") == "late"
        assert _pod_lists(api) == 0
        assert cache.lookup("default", "never-made", began) is None  # not in it: the API server is asked
        assert _pod_lists(api) == 1
        assert cache.lookup("default", "late") is not None  # no time given: listed again
        assert _pod_lists(api) == 2
        assert cache.lookup("default", "late", time.monotonic()) is not None  # the last list is older
        assert _pod_lists(api) == 3
    finally:
        api.hold_watches(False)
