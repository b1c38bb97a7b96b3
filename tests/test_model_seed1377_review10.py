"""The records of a pod's IDs (its init container's, handed on, each of its containers answered with its own
directory) split between two pods, one of them that pod: the kubelet's model seed 1377
(tests/test_allocation_model_review9.py), as a deterministic case."""

from __future__ import annotations

from pathlib import Path

from tests.alloc_fixtures import FakePods, core_ids, make_allocator, uid_of
from tests.test_model_seeds_review9 import _mounted, _pod, _start


def test_the_records_of_a_pods_ids_split_between_it_and_another_pod_all_go_to_it_at_its_start(
    tmp_path: Path,
) -> None:
    """a, b, c and d ask for as much; c and d have an init container handing its IDs on. The kubelet
    admits b, c, d, a: b's IDs are matched to a, c's to b, d's to c's two containers (each its own
    answer), a's to d's init container. c's init container starts (the kubelet naming c's app
    container): c takes b's record, b one of c's records of d's IDs (the one answered to d's app
    container), the other staying with c. a starts and takes d's record, d getting a's (of b's IDs);
    b starts and takes it back, d getting b's record of d's IDs. The records of d's IDs now lie in c
    (answered to d's init container) and in d (answered to its app container). When d's init container
    starts (the kubelet naming its app container), both become d's, each its container's: the init
    container finds its vcuda.config where its answer mounts, the app container too, also once c is
    deleted."""
    pods = FakePods(
        [_pod("a", 1, init=False, cores=20, blocks=8), _pod("b", 2, init=False, cores=20, blocks=8)]
        + [_pod(n, i, init=True, cores=20, blocks=8) for i, n in ((3, "c"), (4, "d"))]
    )
    alloc = make_allocator(tmp_path, pods)
    try:
        ids_a, ids_b, ids_c, ids_d = core_ids(0, 20), core_ids(1, 20), core_ids(2, 20), core_ids(3, 20)
        answer_b = _mounted(alloc.allocate(ids_b))
        answer_c = _mounted(alloc.allocate(ids_c))
        assert _mounted(alloc.allocate(ids_c)) == answer_c  # c's app container: its init container's IDs
        answer_d_setup = _mounted(alloc.allocate(ids_d))
        answer_d_main = _mounted(alloc.allocate(ids_d))
        assert answer_d_setup != answer_d_main
        answer_a = _mounted(alloc.allocate(ids_a))

        assert answer_c in _start(alloc, ids_c, ("c", "main"))  # c's init container starts
        assert answer_a in _start(alloc, ids_a, ("a", "main"))
        assert answer_b in _start(alloc, ids_b, ("b", "main"))
        held = {a.key: a.answered for a in alloc.allocations() if frozenset(a.device_ids) == frozenset(ids_d)}
        assert held == {(uid_of("c"), "setup"): answer_d_setup, (uid_of("d"), "setup"): answer_d_main}

        assert {answer_d_setup, answer_d_main} <= _start(alloc, ids_d, ("d", "main"))  # d's init container
        held = {a.key: a.answered for a in alloc.allocations() if frozenset(a.device_ids) == frozenset(ids_d)}
        assert held == {(uid_of("d"), "setup"): answer_d_setup, (uid_of("d"), "main"): answer_d_main}
        assert {a.container for a in alloc.allocations_of(uid_of("c"))} == {"main"}
        pods.items = [p for p in pods.items if p["metadata"]["name"] != "c"]
        alloc.release_pod(uid_of("c"))
        assert {answer_d_setup, answer_d_main} <= _start(alloc, ids_d, ("d", "setup"))  # d's app container
    finally:
        alloc.close()
