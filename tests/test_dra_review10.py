"""DRA mode driven as the kubelet and the API server would: opaque configuration addressed to the driver,
and the reads a Prepare makes bounded as a whole."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gpumanager.dra import cdi
from gpumanager.dra.claims import ClaimError, ClaimRef
from gpumanager.dra.prepare import ClaimPreparer
from tests.test_dra_checkpoint import DRIVER, GPUS, Node, api_claim
from tests.test_kube_rest import read_from_a_trickling_server


def _with_config(claim: dict[str, Any], *entries: dict[str, Any]) -> dict[str, Any]:
    claim["status"]["allocation"]["devices"]["config"] = list(entries)
    return claim


def _opaque(driver: str, parameters: Any, requests: list[str] | None = None, source: str = "FromClaim") -> Any:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return entry


def _node(tmp_path: Path) -> Node:
    node = Node(tmp_path, {})
    node.allocator.probe_checkpoint()
    return node


@pytest.mark.parametrize(
    "entry",
    [
        _opaque(DRIVER, {"apiVersion": "gpu.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}),
        _opaque(DRIVER, {"cores": 30}, requests=["gpu"], source="FromClass"),
        _opaque(DRIVER, "not an object"),
    ],
)
def test_opaque_configuration_for_the_driver_is_refused_naming_the_claim_and_the_value(
    tmp_path: Path, entry: dict[str, Any]
) -> None:
    # The driver takes no configuration: parameters meant for it (a user copying another driver's
    # GpuConfig, expecting MPS or time-slicing) were dropped without a word, and the container ran
    # with something else than asked for.
    node = _node(tmp_path)
    node.api["one"] = _with_config(api_claim("u1", "one"), entry)
    outcome = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert outcome.error and not outcome.devices
    assert "claim ml/one (u1)" in outcome.error and DRIVER in outcome.error, outcome.error
    shown = entry["opaque"]["parameters"]
    first = next(iter(shown)) if isinstance(shown, dict) else shown
    assert repr(first) in outcome.error, outcome.error
    assert "Traceback" not in outcome.error
    assert node.allocator.claims() == [] and not list((tmp_path / "cdi").glob("*.json")), "nothing is left behind"


@pytest.mark.parametrize(
    "entry",
    [
        _opaque("gpu.nvidia.com", {"kind": "GpuConfig", "sharing": {"strategy": "MPS"}}),  # another driver's
        _opaque(DRIVER, {}),  # nothing asked
        _opaque(DRIVER, None),
        _opaque(DRIVER, {"cores": 30}, requests=["other-request"]),  # for a request of no result of ours
    ],
)
def test_configuration_that_asks_nothing_of_the_driver_is_prepared(tmp_path: Path, entry: dict[str, Any]) -> None:
    node = _node(tmp_path)
    node.api["one"] = _with_config(api_claim("u1", "one"), entry)
    outcome = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert not outcome.error and outcome.devices


def test_a_claim_prepared_before_is_answered_again_without_its_configuration_read(tmp_path: Path) -> None:
    # The kubelet's retry of a prepared claim gets the same answer: the check is made once, at the first Prepare.
    node = _node(tmp_path)
    node.api["one"] = api_claim("u1", "one")
    first = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    node.api["one"] = _with_config(api_claim("u1", "one"), _opaque(DRIVER, {"cores": 30}))
    again = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert not first.error and again == first


def test_a_pod_answer_trickled_a_byte_at_a_time_is_bounded_as_a_whole(tmp_path: Path) -> None:
    """The check of the containers that use a share reads their pods: each read of the answer came within
    the timeout, the whole never did, and the Prepare waited as long as the server liked."""
    from gpumanager.dra.sharing import api_pod_reader
    from gpumanager.kube.client import api_client

    outcome = read_from_a_trickling_server(
        tmp_path, lambda kubeconfig: api_pod_reader(api_client(kubeconfig), timeout=1.0)("ns", "pod-a"), 10
    )
    assert outcome, "the pod read still waits on an answer that never ends"
    assert isinstance(outcome[0], ClaimError) and "pod ns/pod-a" in str(outcome[0]), outcome


def _crash_in_unprepare(node: Node, uid: str) -> None:
    """The agent killed in an Unprepare after its checkpoint record, before its files went (the
    ``unprepare-after-checkpoint`` crash point): the record is gone, the CDI spec and directory stay."""
    assert node.allocator.unprepare_claim(uid) is not None
    assert node.files(uid)


@pytest.mark.parametrize("left", ["not allocated", "no device of the driver"])
def test_files_of_a_claim_unprepared_by_a_crash_and_deallocated_since_are_removed_at_the_restart(
    tmp_path: Path, left: str
) -> None:
    # The kubelet got no answer to the Unprepare; the pod ended and the resourceclaim controller cleared
    # the claim's allocation (a standalone claim outlives its pod). Nothing can prepare that claim on this
    # node again, yet its CDI spec and directory were kept forever ("cannot be recorded again"), the
    # error logged at every start.
    node = _node(tmp_path)
    node.api["one"] = api_claim("u1", "one")
    assert not node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"].error
    _crash_in_unprepare(node, "u1")
    claim = api_claim("u1", "one", reserved=False)
    if left == "not allocated":
        del claim["status"]["allocation"]
    else:  # allocated again since, to another driver's device
        claim["status"]["allocation"]["devices"]["results"][0]["driver"] = "gpu.nvidia.com"

    after = Node(tmp_path, {"one": claim})
    after.allocator.load()
    removed = after.preparer.restore_files()
    assert removed == ["u1"]
    assert not cdi.spec_path(after.cdi, "u1").exists() and not (after.vm / "u1").exists()
    assert after.allocator.claims() == [] and after.preparer.unreadable() == {}


def test_files_of_a_claim_unprepared_by_a_crash_but_still_allocated_are_rebuilt(tmp_path: Path) -> None:
    # Still allocated: the kubelet may still hold it prepared (it retries the Unprepare it got no answer
    # to), so it is recorded again and its GPU held until that Unprepare comes.
    node = _node(tmp_path)
    node.api["one"] = api_claim("u1", "one")
    assert not node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"].error
    _crash_in_unprepare(node, "u1")
    after = Node(tmp_path, {"one": api_claim("u1", "one")})
    after.allocator.load()
    assert after.preparer.restore_files() == []
    assert [c.uid for c in after.allocator.claims()] == ["u1"] and after.files("u1")
    assert after.preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    assert not cdi.spec_path(after.cdi, "u1").exists() and not (after.vm / "u1").exists()


class _SlowReads:
    """A reader whose every GET takes ``seconds`` (an API server that is slow, or hangs up to the read's
    own deadline)."""

    def __init__(self, api: dict[str, dict[str, Any]], seconds: float) -> None:
        self.api, self.seconds = api, seconds

    def __call__(self, namespace: str, name: str) -> dict[str, Any]:
        time.sleep(self.seconds)
        return self.api[name]


def _preparer(node: Node, read: Any, answer_within: float) -> ClaimPreparer:
    return ClaimPreparer(
        read_claim=read,
        allocator=node.allocator,
        gpus=GPUS,
        driver=DRIVER,
        pool="node-a",
        cdi_settings=node.cdi,
        vm_path=node.vm,
        driver_version="550.54.15",
        answer_within=answer_within,
    )


def test_a_prepare_of_several_claims_on_a_slow_api_server_answers_every_claim_in_time(tmp_path: Path) -> None:
    # The kubelet gives each NodePrepareResources 45 s; it sends every claim of a pod of the driver in one
    # call. Each claim's GET may take up to its own deadline (10 s), one after the other: five claims on
    # a hung API server were answered after the kubelet had given up, which then saw DeadlineExceeded
    # and none of the claims' errors.
    node = _node(tmp_path)
    api = {f"c{i}": api_claim(f"u{i}", f"c{i}", cores=10) for i in range(4)}
    preparer = _preparer(node, _SlowReads(api, 3.0), answer_within=1.0)
    start = time.monotonic()
    outcomes = preparer.prepare([ClaimRef("ml", f"c{i}", f"u{i}") for i in range(4)])
    took = time.monotonic() - start
    assert took < 2.0, f"answered after {took:.1f} s"
    assert sorted(outcomes) == [f"u{i}" for i in range(4)]
    for i in range(4):
        error = outcomes[f"u{i}"].error
        assert f"claim ml/c{i} (u{i})" in error and "1 s" in error, error
    time.sleep(3.5)  # the GETs end: a claim already answered with an error is not prepared behind its back
    assert node.allocator.claims() == [] and not list((tmp_path / "cdi").glob("*.json"))
    # The kubelet's retry, on an API server that answers again, prepares them.
    again = _preparer(node, _SlowReads(api, 0.0), answer_within=1.0).prepare(
        [ClaimRef("ml", f"c{i}", f"u{i}") for i in range(4)]
    )
    assert all(not o.error and o.devices for o in again.values()), again


def test_the_claims_of_one_prepare_are_read_side_by_side(tmp_path: Path) -> None:
    # Four GETs of 0.6 s each fit in 1.5 s only when they do not wait for one another.
    node = _node(tmp_path)
    api = {f"c{i}": api_claim(f"u{i}", f"c{i}", cores=10) for i in range(4)}
    outcomes = _preparer(node, _SlowReads(api, 0.6), answer_within=1.5).prepare(
        [ClaimRef("ml", f"c{i}", f"u{i}") for i in range(4)]
    )
    assert all(not o.error and o.devices for o in outcomes.values()), outcomes
    assert sorted(c.uid for c in node.allocator.claims()) == [f"u{i}" for i in range(4)]


def test_claims_of_one_prepare_are_recorded_in_the_request_order(tmp_path: Path) -> None:
    # Two claims the scheduler wrongly placed on one GPU beyond its capacity (60 + 60 cores): the first
    # of the request is prepared, the second refused naming the amounts, however fast each was read.
    node = _node(tmp_path)
    api = {"first": api_claim("u1", "first", cores=60), "second": api_claim("u2", "second", cores=60)}
    delays = {"first": 0.5, "second": 0.0}

    def read(namespace: str, name: str) -> dict[str, Any]:
        time.sleep(delays[name])
        return api[name]

    outcomes = _preparer(node, read, answer_within=5.0).prepare(
        [ClaimRef("ml", "first", "u1"), ClaimRef("ml", "second", "u2")]
    )
    assert not outcomes["u1"].error and outcomes["u1"].devices
    assert "claim ml/second (u2)" in outcomes["u2"].error and "cores=60" in outcomes["u2"].error, outcomes["u2"]
    assert [c.uid for c in node.allocator.claims()] == ["u1"]


@pytest.mark.parametrize("deleted", [True, False])
def test_a_claim_directory_left_by_an_unprepare_cut_short_after_its_cdi_spec_went_is_looked_at_again(
    tmp_path: Path, deleted: bool
) -> None:
    # Killed between removing the CDI spec and the directory: no record, no spec, so nothing looked at
    # the directory again and it stayed forever. It is a claim's files like a spec: rebuilt when the API
    # server still allocates the claim (the kubelet retries the Unprepare it got no answer to), removed
    # when it no longer has it.
    node = _node(tmp_path)
    node.api["one"] = api_claim("u1", "one")
    node.api["two"] = api_claim("u2", "two")
    for uid, name in (("u1", "one"), ("u2", "two")):
        assert not node.preparer.prepare([ClaimRef("ml", name, uid)])[uid].error
    _crash_in_unprepare(node, "u1")
    cdi.remove_spec(node.cdi, "u1")
    pod_dir = node.vm / "0b1e-pod-uid" / "main"  # a device-plugin pod's directory: not a claim's
    pod_dir.mkdir(parents=True)
    (pod_dir / "vcuda.config").write_bytes(b"x")
    api = dict(node.api)
    if deleted:
        del api["one"]

    after = Node(tmp_path, api)
    after.allocator.load()
    after.preparer.restore_local()
    assert set(after.preparer.unreadable()) == {"u1"}, "its GPUs may be held until the API server says"
    removed = after.preparer.reconcile()
    assert after.files("u2") and (pod_dir / "vcuda.config").exists()
    if deleted:
        assert removed == ["u1"] and not (after.vm / "u1").exists()
        assert [c.uid for c in after.allocator.claims()] == ["u2"]
    else:
        assert removed == [] and after.files("u1")
        assert [c.uid for c in after.allocator.claims()] == ["u1", "u2"]
    assert after.preparer.unreadable() == {}


def test_a_prepare_whose_files_and_then_its_undo_record_cannot_be_written_leaves_no_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The spec cannot be written (a full disk), and undoing the record fails too: the claim's directory,
    # already written, was left behind with no record, and the kubelet was told the checkpoint's error
    # instead of why the claim was not prepared.
    from gpumanager.allocation.allocator import AllocationError

    node = _node(tmp_path)
    node.api["one"] = api_claim("u1", "one")

    def no_space(*_args: Any) -> Path:
        raise OSError(28, "No space left on device")

    real_unprepare = node.allocator.unprepare_claim

    def unprepare_fails(uid: str) -> Any:
        real_unprepare(uid)  # freed in memory all the same, as the allocator does
        raise AllocationError(f"claim ml/one ({uid}): cannot write checkpoint: No space left on device")

    monkeypatch.setattr(cdi, "write_spec", no_space)
    monkeypatch.setattr(node.allocator, "unprepare_claim", unprepare_fails)
    outcome = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert "claim ml/one (u1): cannot write its files" in outcome.error and "No space" in outcome.error, outcome
    assert not (node.vm / "u1").exists() and not cdi.spec_path(node.cdi, "u1").exists()
    assert node.allocator.claims() == []


def test_an_unprepare_while_the_prepare_reads_its_claim_wins(tmp_path: Path) -> None:
    # The kubelet gave up on a Prepare (its pod went) and sent the Unprepare while the claim's GET was still
    # in flight: the Prepare must not record the claim after the Unprepare succeeded.
    node = _node(tmp_path)
    api = {"one": api_claim("u1", "one")}
    preparer = _preparer(node, _SlowReads(api, 0.8), answer_within=5.0)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(preparer.prepare([ClaimRef("ml", "one", "u1")])))
    worker.start()
    time.sleep(0.3)
    assert preparer.unprepare([ClaimRef("ml", "one", "u1")]) == {"u1": ""}
    worker.join(5)
    assert "u1" in result and "unprepared while" in result["u1"].error, result
    assert node.allocator.claims() == [] and not list((tmp_path / "cdi").glob("*.json"))
    assert not (node.vm / "u1").exists()


@pytest.mark.parametrize(
    "spec",
    [
        {"devices": {"requests": [{"name": "gpu", "exactly": {"capacity": ["cores"]}}]}},
        {"devices": {"requests": [{"name": "gpu", "firstAvailable": [{"name": "a", "capacity": "cores"}]}]}},
        {"devices": {"requests": [{"name": "gpu", "exactly": {"capacity": {"requests": "cores=30"}}}]}},
        {"devices": "requests"},
    ],
)
def test_a_claim_spec_of_an_odd_shape_does_not_fail_a_claim_already_recorded(
    tmp_path: Path, spec: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The spec is read after the claim was recorded and its files written, only to tell whether the
    # scheduler honoured its capacity requests: an odd shape there raised, the kubelet was told the
    # claim failed ("AttributeError", a traceback in the log) while it stayed prepared, its GPU held.
    node = _node(tmp_path)
    seen: list[str | None] = []
    node.preparer._capacity_seen = seen.append
    claim = api_claim("u1", "one")
    claim["spec"] = spec
    node.api["one"] = claim
    outcome = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert not outcome.error and outcome.devices, outcome
    assert [c.uid for c in node.allocator.claims()] == ["u1"]
    assert not [r for r in caplog.records if r.exc_info], "no traceback"


def _pod(containers_claims: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"uid": "pod-u1", "name": "pod-one", "namespace": "ml"},
        "spec": {
            "resourceClaims": [{"name": n, "resourceClaimName": n} for n in containers_claims],
            "containers": [{"name": "main", "resources": {"claims": [{"name": n} for n in containers_claims]}}],
        },
    }


@pytest.mark.parametrize("odd", ["reservedFor", "pod metadata", "pod resourceClaims", "other claim metadata"])
def test_odd_shapes_met_by_the_sharing_check_get_a_clear_error_naming_the_claim(
    tmp_path: Path, odd: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The check of the containers that use a share reads the pods the claim is reserved for and the other
    # claims those containers use: a field of the wrong shape there gave "TypeError: 'int' object is not
    # iterable" and a traceback.
    from gpumanager.dra import sharing

    node = _node(tmp_path)
    pod = _pod(["one", "two"])
    claim, other = api_claim("u1", "one"), api_claim("u2", "two")
    if odd == "reservedFor":
        claim["status"]["reservedFor"] = 5
    elif odd == "pod metadata":
        pod["metadata"] = "pod-one"
    elif odd == "pod resourceClaims":
        pod["spec"]["resourceClaims"] = 7
    else:
        other["metadata"] = "two"
    node.api.update({"one": claim, "two": other})
    node.preparer._sharing = sharing.SharingCheck(
        driver=DRIVER,
        pool="node-a",
        gpus=GPUS,
        pod_by_uid=lambda uid: None,
        read_pod=lambda namespace, name: pod,
        read_claim=node.read,
        prepared=lambda *args: None,
    )
    outcome = node.preparer.prepare([ClaimRef("ml", "one", "u1")])["u1"]
    assert outcome.error.startswith("claim ml/one (u1): not prepared"), outcome.error
    assert "shape" in outcome.error and "Error:" not in outcome.error, outcome.error
    assert node.allocator.claims() == []
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
