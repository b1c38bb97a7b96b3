"""The vcuda-memory Allocate's look for containers asking for memory without cores: a pod whose status changed
(started, annotated) is not parsed again, its containers and limits being those it was created with."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager.allocation import memory_only
from gpumanager.allocation import pods as podinfo
from gpumanager.allocation.pods import Pod
from tests.alloc_fixtures import FakePods, make_allocator, make_pod


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
