"""The extender's filter, prioritize and bind over HTTP, against the API-server simulator (synthetic nodes)."""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from typing import Any

from gpumanager import names
from gpumanager.kube.gpu_inventory import ANNOTATION
from tests.extender_fixtures import BLOCK, GIB, PREFIX, World, gpu_pod, held, http_error, inventory, wait_for, world

__all__ = ["world"]

A800 = [80] * 8


def test_fragmented_node_refuses_a_share_no_gpu_can_hold(world: World) -> None:
    world.add_node("frag", inventory(A800))
    world.add_node("roomy", inventory(A800))
    for i in range(8):  # 60 cores on every GPU of "frag": 40 left on each, 320 in total
        world.create(gpu_pod(f"busy-{i}", [(60, 8)], node="frag", annotations=held("frag", [[i]])))
    world.start_extender()
    world.wait_seen(8)
    pod = world.create(gpu_pod("big-share", [(60, 8)]))
    answer = world.filter(pod)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["roomy"]
    reason = answer["FailedNodes"]["frag"]
    assert "container 'c0' needs 60 cores" in reason and "no GPU has 60 free cores" in reason, reason
    assert "frag" not in answer["FailedAndUnresolvableNodes"]  # preempting the 60-core pods would help
    assert world.bind(pod, "roomy") == ""
    assert world.annotations(pod)[names.PREDICATE_NODE] == "roomy"
    # The same pod bound to the fragmented node anyway is refused, with the reason.
    other = world.create(gpu_pod("other", [(60, 8)]))
    error = world.bind(other, "frag")
    assert "no longer fits on node frag" in error and "40 cores" in error
    assert PREFIX + "0" not in world.annotations(other)


def test_smaller_gpu_of_an_a800_node_is_known(world: World) -> None:
    world.add_node("a800", inventory([80, 80, 80, 80, 80, 80, 80, 40]))
    for i in range(7):  # every 80 GiB GPU taken whole
        world.create(gpu_pod(f"whole-{i}", [(100, 0)], node="a800", annotations=held("a800", [[i]])))
    world.start_extender()
    world.wait_seen(7)
    big = world.create(gpu_pod("big", [(50, 60 * GIB // BLOCK)]))
    answer = world.filter(big)
    reason = answer["FailedNodes"]["a800"]
    assert reason.endswith("needs 50 cores and 61440 MiB on one GPU: no GPU has 61440 MiB free"), reason
    small = world.create(gpu_pod("small", [(50, 30 * GIB // BLOCK)]))
    assert world.passed(small) == ["a800"]
    assert world.bind(small, "a800") == ""
    assert world.annotations(small)[PREFIX + "0"] == "7"


def test_equal_division_when_a_node_has_no_inventory(world: World) -> None:
    # 7 x 80 GiB + 1 x 40 GiB announced only as totals: gpu-admission's rule sees 8 x 75 GiB.
    world.add_node("plain", None, gpus=8, memory_gib=75)
    world.start_extender()
    pod = world.create(gpu_pod("p", [(50, 76 * GIB // BLOCK)]))
    answer = world.filter(pod)
    reason = answer["FailedAndUnresolvableNodes"]["plain"]
    assert "node capacity divided evenly" in reason and "no tencent.com/gpu-inventory annotation" in reason


def test_whole_gpus_go_to_an_nvlink_pair(world: World) -> None:
    # Four GPUs on one PCIe switch level, NVLink between 0-1 and 2-3; GPU 0 holds a share.
    world.add_node("nvl", inventory([80] * 4, nvlink=[(0, 1), (2, 3)], level=20))
    world.add_node("pcie", inventory([80] * 4, level=20))
    world.create(gpu_pod("share", [(10, 4)], node="nvl", annotations=held("nvl", [[0]])))
    world.create(gpu_pod("share2", [(10, 4)], node="pcie", annotations=held("pcie", [[0]])))
    world.start_extender()
    world.wait_seen(2)
    pod = world.create(gpu_pod("pair", [(200, 0)]))
    scores = world.scores(pod)
    assert scores["nvl"] > scores["pcie"], scores
    assert world.bind(pod, "nvl") == ""
    assert world.annotations(pod)[PREFIX + "0"] == "2,3"


def test_unhealthy_gpus_are_skipped(world: World) -> None:
    world.add_node("sick", inventory([80] * 4, unhealthy=[0, 1, 2]))
    world.start_extender()
    share = world.create(gpu_pod("share", [(30, 4)]))
    assert world.bind(share, "sick") == ""
    assert world.annotations(share)[PREFIX + "0"] == "3"
    two = world.create(gpu_pod("two", [(200, 0)]))
    answer = world.filter(two)
    assert "fewer than 2 GPUs of the node are healthy" in answer["FailedAndUnresolvableNodes"]["sick"]
    # The agent says GPUs 0 and 1 are healthy again: the watch of nodes brings it back.
    world.api.update_node(
        "sick", lambda n: n["metadata"]["annotations"].__setitem__(ANNOTATION, inventory([80] * 4, unhealthy=[2]))
    )
    wait_for(lambda: world.passed(two) == ["sick"])
    assert world.bind(two, "sick") == ""
    assert world.annotations(two)[PREFIX + "0"] == "0,1"


def test_concurrent_binds_never_over_commit(world: World) -> None:
    world.add_node("n", inventory([80] * 4))
    world.start_extender()
    pods = [world.create(gpu_pod(f"p{i}", [(30, 40)])) for i in range(24)]  # 30 cores / 10 GiB each
    errors: dict[str, str] = {}

    def bind(pod: dict[str, object]) -> None:
        errors[pod["metadata"]["name"]] = world.bind(pod, "n")  # type: ignore[index]

    threads = [threading.Thread(target=bind, args=(p,)) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cores: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    for pod in pods:
        ann = world.annotations(pod)
        if PREFIX + "0" in ann:
            cores[ann[PREFIX + "0"]] += 30
            memory[ann[PREFIX + "0"]] += 40 * BLOCK
    bound = sum(1 for e in errors.values() if e == "")
    assert bound == 12, errors  # 3 per GPU
    assert all(c <= 100 for c in cores.values()) and all(m <= 80 * GIB for m in memory.values()), cores
    assert all("no longer fits" in e for e in errors.values() if e)
    assert world.extender.state.over_committed() == {}


def test_bind_conflict_is_retried(world: World) -> None:
    world.add_node("n", inventory([80] * 2))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(50, 4)]))
    wait_for(lambda: world.extender.pods.get(pod["metadata"]["uid"]) is not None, what="the pod in the watch cache")
    world.api.fail_next("PATCH", r"/pods/p$", 409)
    world.api.clear_requests()
    assert world.bind(pod, "n") == ""
    methods = [(r.method, r.status) for r in world.api.requests if r.path.endswith("/pods/p")]
    # The pod comes from the watch cache; after the conflict it is read again.
    assert methods == [("PATCH", 409), ("GET", 200), ("PATCH", 200)], methods
    assert world.annotations(pod)[PREFIX + "0"] in ("0", "1")
    assert world.api.get_pod("default", "p")["spec"]["nodeName"] == "n"  # type: ignore[index]


def test_bind_conflict_from_a_real_change_is_retried(world: World) -> None:
    world.add_node("n", inventory([80] * 2))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(50, 4)]))
    # Hold the first annotation patch while someone else changes the pod: its resourceVersion is stale.
    world.api.delay(r"/pods/p$", 0.5, method="PATCH", count=1)
    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(world.bind(pod, "n")))
    t.start()
    threading.Event().wait(0.2)
    world.api.update_pod("default", "p", lambda p: p["metadata"].setdefault("labels", {}).update(touched="yes"))
    t.join()
    assert result == [""]
    stored = world.api.get_pod("default", "p")
    assert stored is not None and stored["metadata"]["labels"]["touched"] == "yes"
    assert stored["spec"]["nodeName"] == "n" and stored["metadata"]["annotations"][names.PREDICATE_NODE] == "n"
    patches = [r.status for r in world.api.requests if r.method == "PATCH" and r.path.endswith("/pods/p")]
    assert patches == [409, 200], patches


def test_failed_binding_releases_and_the_requeued_pod_schedules(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(100, 0)]))
    world.api.fail_next("POST", r"/pods/p/binding$", 500, message="etcd is sad")
    error = world.bind(pod, "n")
    assert "cannot bind pod default/p to node n" in error and "etcd is sad" in error
    ann = world.annotations(pod)
    assert not any(k.startswith("tencent.com/predicate") for k in ann), ann
    assert world.extender.state.assumed_count() == 0
    # The scheduler tries again: filter and bind as for any pod.
    assert world.passed(pod) == ["n"]
    assert world.bind(pod, "n") == ""
    assert world.annotations(pod)[PREFIX + "0"] == "0"


def test_pod_with_old_predicate_annotations_is_filtered_again(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.add_node("m", inventory([80]))
    # Left by gpu-admission (or a bind that failed half-way): chosen for "n", never bound.
    pod = world.create(gpu_pod("p", [(100, 0), (0, 0)], annotations=held("n", [[0], [0]])))
    world.start_extender()
    world.wait_seen(1)
    assert sorted(world.passed(pod)) == ["m", "n"]
    other = world.create(gpu_pod("other", [(100, 0)]))
    assert world.passed(other) == ["m"]  # the old choice still holds n's GPU until the pod moves
    assert world.bind(pod, "m") == ""
    ann = world.annotations(pod)
    assert ann[names.PREDICATE_NODE] == "m" and ann[PREFIX + "0"] == "0" and ann[names.GPU_ASSIGNED] == "false"
    assert PREFIX + "1" not in ann  # container 1 needs no GPU: the stale index is gone
    world.wait_seen(1)
    assert world.passed(other) == ["n"]


def test_repeated_bind_is_idempotent(world: World) -> None:
    world.add_node("n", inventory([80] * 2))
    world.add_node("m", inventory([80] * 2))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(50, 4)]))
    assert world.bind(pod, "n") == ""
    first = world.annotations(pod)
    assert world.bind(pod, "n") == ""
    assert world.annotations(pod) == first
    assert "already bound to node n" in world.bind(pod, "m")
    recreated = dict(pod, metadata=dict(pod["metadata"], uid="not-the-same"))
    assert "it was recreated" in world.bind(recreated, "n")


def test_restarted_extender_rebuilds_its_view(world: World) -> None:
    world.add_node("n", inventory([80] * 2))
    world.start_extender()
    for i in range(4):
        assert world.bind(world.create(gpu_pod(f"p{i}", [(50, 4)])), "n") == ""
    world.stop_extender()
    world.start_extender()
    pod = world.create(gpu_pod("late", [(10, 4)]))
    answer = world.filter(pod)
    assert "no GPU has 10 free cores" in answer["FailedNodes"]["n"], answer


def test_unresolvable_only_where_empty_gpus_could_not_hold_it(world: World) -> None:
    world.add_node("four", inventory([80] * 4))
    world.add_node("eight", inventory([80] * 8))
    world.add_node("cpu-only", None, gpus=0)
    world.add_node("no-shares", inventory([80] * 8, share_mode=False))
    world.start_extender()
    six = world.create(gpu_pod("six", [(600, 0)]))
    answer = world.filter(six)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["eight", "no-shares"]
    assert set(answer["FailedAndUnresolvableNodes"]) == {"four", "cpu-only"} and answer["FailedNodes"] == {}
    assert "node has no tencent.com/vcuda-core" in answer["FailedAndUnresolvableNodes"]["cpu-only"]
    huge = world.create(gpu_pod("huge", [(50, 90 * GIB // BLOCK)]))
    answer = world.filter(huge)
    assert set(answer["FailedAndUnresolvableNodes"]) == {"four", "eight", "cpu-only", "no-shares"}
    assert "--share-mode" in answer["FailedAndUnresolvableNodes"]["no-shares"]
    odd = world.create(gpu_pod("odd", [(150, 0)]))
    assert "not a multiple of 100" in world.filter(odd)["FailedAndUnresolvableNodes"]["eight"]


def test_pods_without_gpus_pass_untouched(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.add_node("cpu-only", None, gpus=0)
    world.start_extender()
    pod = world.create(gpu_pod("web", [(0, 0)]))
    answer = world.filter(pod, ["n", "cpu-only"])
    assert sorted(n["metadata"]["name"] for n in answer["Nodes"]["items"]) == ["cpu-only", "n"]
    assert answer["FailedNodes"] == {} and answer["FailedAndUnresolvableNodes"] == {}
    names_only = world.post("filter", {"Pod": pod, "NodeNames": ["n", "cpu-only"]})
    assert names_only["NodeNames"] == ["n", "cpu-only"] and names_only["Nodes"] is None
    assert world.bind(pod, "cpu-only") == ""
    assert world.annotations(pod) == {}


def test_multi_container_pods_see_each_others_choice(world: World) -> None:
    world.add_node("n", inventory([80, 80]))
    world.start_extender()
    pod = world.create(gpu_pod("two", [(60, 4), (60, 4)]))
    assert world.passed(pod) == ["n"]
    three = world.create(gpu_pod("three", [(60, 4), (60, 4), (60, 4)]))
    answer = world.filter(three)
    assert "container 'c2' needs 60 cores" in answer["FailedAndUnresolvableNodes"]["n"]
    assert world.bind(pod, "n") == ""
    ann = world.annotations(pod)
    assert {ann[PREFIX + "0"], ann[PREFIX + "1"]} == {"0", "1"}


def test_spread_and_binpack_choose_differently(world: World) -> None:
    world.add_node("n", inventory([80] * 2))
    world.create(gpu_pod("old", [(20, 4)], node="n", annotations=held("n", [[1]])))
    world.start_extender(policy="spread")
    world.wait_seen(1)
    pod = world.create(gpu_pod("p", [(20, 4)]))
    assert world.bind(pod, "n") == ""
    assert world.annotations(pod)[PREFIX + "0"] == "0"
    world.stop_extender()
    world.start_extender(policy="binpack")
    world.wait_seen(2)
    pod2 = world.create(gpu_pod("p2", [(20, 4)]))
    assert world.bind(pod2, "n") == ""
    assert world.annotations(pod2)[PREFIX + "0"] in ("0", "1")
    scores_packed = world.scores(world.create(gpu_pod("q", [(20, 4)])))
    assert 0 <= scores_packed["n"] <= 10


def test_bad_requests_are_named(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender()
    status, answer = http_error(world, "filter", b"{not json")
    assert status == 400 and "not JSON" in answer["Error"]
    status, answer = http_error(world, "filter", b'{"Pod": {}}')
    assert status == 400 and "neither Nodes nor NodeNames" in answer["Error"]
    status, answer = http_error(world, "bind", b'{"PodName": "x", "PodNamespace": "default", "Node": ""}')
    assert status == 400 and "ExtenderBindingArgs" in answer["Error"] and "`PodUID`" in answer["Error"]
    status, answer = http_error(world, "bind", b'{"PodName": "x", "PodNamespace": "default", "PodUID": "", "Node": ""}')
    assert status == 400 and "ExtenderBindingArgs.Node is empty" in answer["Error"]
    status, answer = http_error(world, "filter", b'{"Pod": {}, "NodeNames": "n"}')
    assert status == 400 and "ExtenderArgs" in answer["Error"] and "NodeNames" in answer["Error"]
    status, answer = http_error(world, "nonsense", b"{}")
    assert status == 404
    bad = gpu_pod("bad", [(50, 4)])
    bad["spec"]["containers"][0]["resources"]["limits"][names.VCORE_RESOURCE] = "1.5"
    answer = world.filter(bad)
    assert "not a whole number" in answer["Error"] and "default/bad" in answer["Error"]


def test_repeated_bind_while_the_watch_lags_keeps_the_gpus_held(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender()
    pod = world.create(gpu_pod("p", [(60, 4)]))
    wait_for(lambda: world.extender.pods.get(pod["metadata"]["uid"]) is not None, what="the pod in the watch cache")
    world.api.hold_watches(True)  # the watch shows neither the annotations nor the binding yet
    try:
        assert world.bind(pod, "n") == ""
        # The scheduler's answer was lost (its timeout): it binds the pod again from its stale cache.
        assert world.bind(pod, "n") == ""
        assert world.extender.state.is_assumed(pod["metadata"]["uid"])
        other = world.create(gpu_pod("other", [(60, 4)]))
        error = world.bind(other, "n")
        assert "no longer fits" in error, error
    finally:
        world.api.hold_watches(False)
    world.wait_seen(1)
    assert world.extender.state.over_committed() == {}


#: The kube-scheduler's default ``httpTimeout`` for extenders.
SCHEDULER_TIMEOUT = 5.0


def test_bind_answers_within_its_deadline_when_the_api_server_hangs(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender(bind_timeout=2.0)
    pod = world.create(gpu_pod("p", [(60, 4)]))
    wait_for(lambda: world.extender.pods.get(pod["metadata"]["uid"]) is not None, what="the pod in the watch cache")
    world.api.set_down(True, "hang")
    try:
        error = world.bind(pod, "n", timeout=SCHEDULER_TIMEOUT)
    finally:
        world.api.set_down(False)
    # its first call, the current read of the node, gets no answer
    assert "cannot read node n" in error and "did not answer within 2 s" in error, error
    assert not world.extender.state.is_assumed(pod["metadata"]["uid"])


def test_a_binding_the_api_server_may_still_make_keeps_its_gpus(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.start_extender(bind_timeout=2.0)
    pod = world.create(gpu_pod("p", [(60, 4)]))
    other = world.create(gpu_pod("other", [(60, 4)]))
    wait_for(lambda: world.extender.pods.get(other["metadata"]["uid"]) is not None, what="the pods in the watch cache")
    world.api.hold_watches(True)
    world.api.delay(r"/pods/p/binding$", 4.0, method="POST", count=1)  # made, but answered too late
    try:
        error = world.bind(pod, "n", timeout=SCHEDULER_TIMEOUT)
        assert "cannot bind pod default/p to node n" in error and "may still be made" in error, error
        assert "no longer fits" in world.bind(other, "n", timeout=SCHEDULER_TIMEOUT)
        wait_for(lambda: (world.api.get_pod("default", "p") or {})["spec"].get("nodeName") == "n", what="the binding")
    finally:
        world.api.hold_watches(False)
    # The pod kept the annotations it is bound with, and the next bind of it is a repeat.
    assert world.annotations(pod)[PREFIX + "0"] == "0"
    assert world.bind(pod, "n") == ""
    world.wait_seen(1)
    assert world.extender.state.over_committed() == {}


def test_a_share_without_memory_is_refused_everywhere(world: World) -> None:
    world.add_node("n", inventory([80]))
    world.add_node("m", None)
    world.start_extender()
    # The agent refuses such a container at Allocate ("a share needs vcuda-memory"): no node can run it.
    pod = world.create(gpu_pod("p", [(0, 0), (50, 0)]))
    answer = world.filter(pod)
    assert answer["Nodes"]["items"] == [] and answer["FailedNodes"] == {}, answer
    assert set(answer["FailedAndUnresolvableNodes"]) == {"n", "m"}
    reason = answer["FailedAndUnresolvableNodes"]["n"]
    assert "container 'c1'" in reason and "50 tencent.com/vcuda-core" in reason and "vcuda-memory" in reason, reason
    names_only = world.post("filter", {"Pod": pod, "NodeNames": ["n"]})
    assert names_only["NodeNames"] == [] and "vcuda-memory" in names_only["FailedAndUnresolvableNodes"]["n"]
    assert "vcuda-memory" in world.bind(pod, "n")
    assert world.api.get_pod("default", "p")["spec"].get("nodeName") is None  # type: ignore[index]


def _raw_request(port: int, head: bytes, timeout: float = 10.0) -> bytes:
    """Send ``head`` on a new connection; everything the server sends until it closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        got = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return got
            got += chunk


def test_malformed_http_is_answered_and_a_stalled_client_is_dropped(world: World) -> None:
    world.add_node("n", inventory([80]))
    ext = world.start_extender(idle_timeout=1.0)
    port = ext.server.port
    answer = _raw_request(port, b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: lots\r\n\r\n{}")
    assert answer.startswith(b"HTTP/1.1 400") and b"Content-Length" in answer, answer
    answer = _raw_request(port, b"POST /scheduler/nonsense HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    # A client that promises a body and never sends it (or vanished) does not hold a thread for ever.
    stalled = b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"
    assert _raw_request(port, stalled) == b""
    assert world.passed(world.create(gpu_pod("p", [(50, 4)]))) == ["n"]


def with_init(pod: dict[str, Any], cores: int, blocks: int, name: str = "setup") -> dict[str, Any]:
    """``pod`` with one init container asking (vcuda-core, vcuda-memory blocks)."""
    limits = {names.VCORE_RESOURCE: str(cores)}
    if blocks:
        limits[names.VMEMORY_RESOURCE] = str(blocks)
    pod["spec"]["initContainers"] = [
        {"name": name, "image": "cuda", "resources": {"limits": limits, "requests": limits}}
    ]
    return pod


def test_a_gpu_init_container_must_fit_the_node_by_itself(world: World) -> None:
    """The agent gives an init container its own GPUs when the kubelet admits the pod, beside the
    others': a node where it cannot fit (its pod would fail with UnexpectedAdmissionError) is refused
    with the init container named, in filter and in bind."""
    world.add_node("frag", inventory([80, 80]))
    world.add_node("roomy", inventory([80, 80]))
    for i in range(2):  # 60 cores on each GPU of "frag": a 10-core share fits, a 50-core one does not
        world.create(gpu_pod(f"busy-{i}", [(60, 8)], node="frag", annotations=held("frag", [[i]])))
    world.start_extender()
    world.wait_seen(2)
    pod = world.create(with_init(gpu_pod("p", [(10, 4)]), 50, 8))
    answer = world.filter(pod)
    assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["roomy"]
    reason = answer["FailedNodes"]["frag"]
    assert "init container 'setup' needs 50 cores" in reason, reason
    error = world.bind(pod, "frag")
    assert "no longer fits on node frag" in error and "init container 'setup'" in error
    assert world.bind(pod, "roomy") == ""
    # The kubelet allocates the init container before the others, and the agent keeps its share while
    # they allocate: both must fit at once. A GPU left free for a whole-GPU container is not the init
    # container's to take.
    world.add_node("one-free", inventory([80, 80]))
    world.create(gpu_pod("whole", [(100, 0)], node="one-free", annotations=held("one-free", [[0]])))
    world.wait_seen(4)  # busy-0, busy-1, p (bound to roomy) and whole
    both = world.create(with_init(gpu_pod("both", [(100, 0)]), 50, 8))
    answer = world.filter(both, ["one-free"])
    assert "init container 'setup' needs 50 cores" in answer["FailedNodes"]["one-free"]
    assert world.passed(both, ["roomy"]) == ["roomy"]
    # An init container alone (no app GPU container) is judged too, and a share without memory is named.
    only_init = world.create(with_init(gpu_pod("only-init", [(0, 0)]), 50, 8))
    assert world.passed(only_init, ["frag"]) == []
    no_memory = world.create(with_init(gpu_pod("no-memory", [(10, 4)]), 30, 0))
    answer = world.filter(no_memory)
    assert "init container 'setup': a share" in answer["FailedAndUnresolvableNodes"]["roomy"]
