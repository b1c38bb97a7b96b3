"""Identical pods the kubelet admits in the other order than their predicate times: the first Allocate
(q's) is matched to p and placed on p's predicated GPU, and q's start swaps the records, so q runs
there. p's own Allocate must then find room: its predicated GPU is q's now."""

from __future__ import annotations

from pathlib import Path

from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod, uid_of


def test_a_pod_whose_predicated_gpu_went_to_the_identical_pod_admitted_first_is_placed_elsewhere(
    tmp_path: Path,
) -> None:
    p = make_pod(
        "p",
        [("c0", 60, 8)],
        annotations={"tencent.com/predicate-gpu-idx-0": "1", "tencent.com/predicate-time": "100"},
    )
    q = make_pod(
        "q",
        [("c0", 60, 8)],
        annotations={"tencent.com/predicate-gpu-idx-0": "3", "tencent.com/predicate-time": "200"},
    )
    alloc = make_allocator(tmp_path, FakePods([p, q]))
    q_ids = core_ids(0, 60)
    assert alloc.allocate(q_ids).annotations["tencent.com/vcuda-device"] == "/dev/nvidia1"  # matched to p
    started = alloc.pre_start(q_ids, (uid_of("q"), "c0"))  # the kubelet: q holds them
    assert (started.pod_uid, started.minors) == (uid_of("q"), (1,))
    p_ids = core_ids(2, 60)
    answer = alloc.allocate(p_ids)  # refused: 'predicated GPU 1 cannot hold 60 cores'
    assert answer.annotations["tencent.com/vcuda-device"] != "/dev/nvidia1"
    assert alloc.pre_start(p_ids, (uid_of("p"), "c0")).pod_uid == uid_of("p")
