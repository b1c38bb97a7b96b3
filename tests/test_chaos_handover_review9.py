"""An allocation asked for again while the API server could not be asked, then freed with its pod.

The kubelet failed pod a's admission (a restart between our answer and its record) and gave a's IDs to b;
b's Allocate came while the API server could not be asked, so it was taken as a's repeated. Once a is gone
its allocation goes to the pod that waits with the same request; when none waits with a's memory (b asks
for another), it must stay remembered for the start of the pod the kubelet gave the IDs to, not vanish
(b's start was refused 'no allocation' for ever)."""

from __future__ import annotations

from pathlib import Path

from gpumanager import names
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def test_a_repeat_freed_with_its_pod_and_no_pod_waiting_with_its_memory_is_taken_over_at_the_start(
    tmp_path: Path,
) -> None:
    a = make_pod("a", [("main", 25, 2)])
    b = make_pod("b", [("main", 25, 8)], created="2026-11-21T10:00:01Z")
    pods = FakePods([a, b])
    alloc = make_allocator(tmp_path, pods)
    ids = core_ids(2, 25)
    first = alloc.allocate(ids)
    assert alloc.get(uid_of("a"), "main") is not None
    pods.refresh_error = ConnectionError("refused")
    assert alloc.allocate(ids) == first  # b's Allocate, taken as a's repeated
    pods.refresh_error = None
    pods.items.remove(a)
    alloc.release_pod(uid_of("a"))
    started = alloc.pre_start(ids, (uid_of("b"), "main"))
    assert (started.pod_uid, started.container) == (uid_of("b"), "main")
    assert started.memory == 8 * names.MEMORY_BLOCK_BYTES
    assert [(x.pod_uid, x.started) for x in alloc.allocations()] == [(uid_of("b"), True)]
