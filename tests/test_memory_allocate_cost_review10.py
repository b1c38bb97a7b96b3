"""The vcuda-memory Allocate's look for containers asking for memory without cores: a pod whose status changed
(started, annotated) is not parsed again, its containers and limits being those it was created with."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.allocation import memory_only
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod


def test_a_pod_whose_status_changes_is_parsed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pods = FakePods([make_pod(f"wait-{i}", [("c", 30, 2)]) for i in range(5)])
    alloc = make_allocator(tmp_path, pods)
    parsed: list[str] = []
    real = podinfo.gpu_requests

    def counted(pod: Pod) -> list[podinfo.GPURequest]:
        parsed.append(pod["metadata"]["name"])
        return real(pod)

    monkeypatch.setattr(podinfo, "gpu_requests", counted)
    late = make_pod("late", [("c", 0, 6)])
    pods.items.append(late)
    assert memory_only.cached_memory_only(alloc, 6)  # the look at the cache (a refusal lists the pods anew)
    assert parsed.count("late") == 1
    for value in ("a", "b", "c"):
        late["metadata"].setdefault("annotations", {})["note"] = value
        assert memory_only.cached_memory_only(alloc, 6)
    late["status"]["phase"] = "Running"
    assert not memory_only.cached_memory_only(alloc, 6), "running: it waits for nothing"
    assert parsed.count("late") == 1, parsed
    assert alloc.memory_only_refusal(6) == ""
    pods.items = [p for p in pods.items if p is not late]
    assert alloc.memory_only_refusal(6) == ""
    again = make_pod("late", [("c", 0, 7)])  # a pod of the same name is another pod (another UID)
    pods.items.append(again)
    assert "default/late" in alloc.memory_only_refusal(7)
    assert alloc.memory_only_refusal(6) == ""


def test_a_memory_allocate_the_cache_cannot_explain_is_noted_for_its_start(tmp_path: Path) -> None:
    """The pod cache shows no pending container asking for 6 blocks (its watch lags): the Allocate is answered
    without a list, its IDs noted; their start asks whose they are once, from the pod's spec."""
    pods = FakePods()
    alloc = make_allocator(tmp_path, pods)
    hidden = make_pod("late", [("c", 0, 6)])
    pods.hidden.append(hidden)
    pods.refresh_fills_cache = False
    ids = [f"m-{i}" for i in range(6)]
    assert alloc.memory_only_refusal(6, ids) == ""
    assert pods.refreshes == 0, "the Allocate lists nothing"
    since = alloc.memory_unexplained_since(list(reversed(ids)))  # the kubelet's order need not be kept
    assert since is not None
    # Kept until a start is let through: the kubelet tries a refused start again, our watch perhaps still lagging.
    assert alloc.memory_unexplained_since(ids) == since
    alloc.settle_memory_unexplained(ids)
    assert alloc.memory_unexplained_since(ids) is None, "let through: a later start of the container is not looked at"
    uid = hidden["metadata"]["uid"]
    assert alloc.memory_only_owner((uid, "c"), since) == "pod default/late container c"
    assert pods.refreshes == 1
    assert alloc.memory_only_owner((uid, "other"), since) == "", "no such container: nothing to say"
    hidden["status"]["containerStatuses"] = [{"name": "c", "containerID": "containerd://1", "restartCount": 0}]
    assert alloc.memory_only_owner((uid, "c"), since) == "", "it ran already: it starts again as it did"


def test_a_memory_allocate_the_cache_explains_is_not_noted(tmp_path: Path) -> None:
    pods = FakePods([make_pod("share", [("c", 30, 6)])])
    alloc = make_allocator(tmp_path, pods)
    assert alloc.memory_only_refusal(6, ["m-1"] * 6) == ""
    assert alloc.memory_unexplained_since(["m-1"] * 6) is None, "the cache shows a share asking as much"
    # A pod the cache does not show, whose vcuda-core Allocate came first (matched from a list): noted all the
    # same. The memory may be another container's, of its pod or of one admitted after it, that asks for
    # memory alone and that the cache does not show either; its start tells them apart.
    pods.refresh_fills_cache = False
    first = make_pod("first", [("c", 40, 5)])
    pods.hidden.append(first)
    alloc.allocate(core_ids(0, 40))
    assert alloc.get(first["metadata"]["uid"], "c") is not None
    ids = [f"m-{i}" for i in range(5)]
    assert alloc.memory_only_refusal(5, ids) == ""
    noted = alloc.memory_unexplained_since(ids)
    assert noted is not None, "an allocation not started asks as much, but the IDs may be another container's"
    assert alloc.memory_only_owner((first["metadata"]["uid"], "c"), noted) == "", "it holds an allocation"
    # One the cache does not show whose memory comes first: noted; its start finds that it asks for cores.
    cored = make_pod("cored", [("c", 40, 7)])
    pods.hidden.append(cored)
    pods.refresh_error = RuntimeError("API server down")
    ids = [f"m-{i}" for i in range(10, 17)]
    assert alloc.memory_only_refusal(7, ids) == ""
    since = alloc.memory_unexplained_since(ids)
    assert since is not None
    assert alloc.memory_only_owner((cored["metadata"]["uid"], "c"), since) == "", "not listed: starts as before"
    pods.refresh_error = None
    assert alloc.memory_only_owner((cored["metadata"]["uid"], "c"), since) == "", "it asks for cores too"
    assert alloc.memory_only_owner((first["metadata"]["uid"], "c"), since) == "", "it holds an allocation"


def test_notes_are_kept_for_a_while_and_in_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alloc = make_allocator(tmp_path, FakePods())
    for i in range(memory_only.UNEXPLAINED_KEPT + 5):
        assert alloc.memory_only_refusal(1, [f"m-{i}"]) == ""
    assert len(alloc._memory_unexplained) == memory_only.UNEXPLAINED_KEPT
    assert alloc.memory_unexplained_since(["m-0"]) is None, "the oldest went first"
    clock = [memory_only.time.monotonic() + memory_only.UNEXPLAINED_SECONDS + 1]
    monkeypatch.setattr(memory_only.time, "monotonic", lambda: clock[0])
    assert alloc.memory_unexplained_since([f"m-{memory_only.UNEXPLAINED_KEPT}"]) is None, "too old"
