"""NodePrepareResources while the API server misbehaves: one claim's trouble is that claim's alone.

The kubelet calls Prepare and Unprepare for different pods at the same time; a claim whose GET
hangs must not hold the others (nor an Unprepare, which needs no API server at all), an error
answer names the claim and the status, and nothing is left behind by a claim that failed.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent import futures
from pathlib import Path

from gpumanager.allocation.journal import read_document
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]

HANG_SECONDS = 6.0


def _wait_until_sent(node: DRAClient, pending: futures.Future[object]) -> None:
    """Give the agent time to send its GET (the API server logs a request only once it answers it)."""
    time.sleep(1.0)
    assert not pending.done(), "the held GET was answered already"


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


def test_a_claim_whose_get_hangs_does_not_hold_other_calls(dra_node: DRAClient) -> None:
    held = dra_node.claim("held", [result(cores="10", memory="1Gi", share="s-held")])
    other = dra_node.claim("other", [result(cores="10", memory="1Gi", share="s-other")])
    fresh = dra_node.claim("fresh", [result(cores="10", memory="1Gi", share="s-fresh")])
    ref_held, ref_other, ref_fresh = dra_node.ref(held), dra_node.ref(other), dra_node.ref(fresh)
    assert dra_node.prepare(ref_held)[ref_held[2]].error == ""
    dra_node.cluster.api.delay(r"/resourceclaims/other$", HANG_SECONDS, method="GET", count=1)
    with futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(dra_node.prepare, ref_other)
        _wait_until_sent(dra_node, slow)
        # Meanwhile: an Unprepare (no API call) and a Prepare of another claim (its GET is answered).
        assert dra_node.unprepare(ref_held) == {ref_held[2]: ""}
        assert not slow.done(), "the Unprepare waited for the hanging GET of another claim"
        assert dra_node.prepare(ref_fresh)[ref_fresh[2]].error == ""
        assert not slow.done(), "the Prepare of another claim waited for the hanging GET"
        assert slow.result(timeout=60)[ref_other[2]].error == ""
    assert not dra_node.spec_path(ref_held[2]).exists()
    assert dra_node.spec_path(ref_other[2]).exists() and dra_node.spec_path(ref_fresh[2]).exists()


def test_api_errors_name_the_claim_and_status_and_leave_nothing(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    claim = dra_node.claim("flaky", [result(cores="10", memory="1Gi", share="s-flaky")])
    ref = dra_node.ref(claim)
    before = _listing(c.cdi_root), _listing(c.vm_path)
    for status in (500, 410, 409, 429, 403):
        c.api.fail_next("GET", r"/resourceclaims/flaky$", status, count=10)
        error = dra_node.prepare(ref)[ref[2]].error
        c.api.clear_faults()
        assert "default/flaky" in error and str(status) in error, error
        assert (_listing(c.cdi_root), _listing(c.vm_path)) == before
    # Once the API server answers, the kubelet's retry prepares it.
    assert dra_node.prepare(ref)[ref[2]].error == ""


def test_a_claim_unprepared_while_its_get_is_in_flight_is_not_prepared_after(dra_node: DRAClient) -> None:
    claim = dra_node.claim("raced", [result(cores="10", memory="1Gi", share="s-raced")])
    ref = dra_node.ref(claim)
    dra_node.cluster.api.delay(r"/resourceclaims/raced$", 3.0, method="GET", count=1)
    with futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(dra_node.prepare, ref)
        _wait_until_sent(dra_node, pending)
        assert dra_node.unprepare(ref) == {ref[2]: ""}
        answer = pending.result(timeout=60)[ref[2]]
    # Either order is a valid outcome for the kubelet, but never a claim prepared after its Unprepare.
    if answer.error == "":
        assert dra_node.unprepare(ref) == {ref[2]: ""}, "the Unprepare came first: the claim must not stay"
    assert not dra_node.spec_path(ref[2]).exists()
    assert not (dra_node.cluster.vm_path / ref[2]).exists()
    # Nothing of its capacity is held: a whole-GPU claim fits.
    whole = dra_node.claim("whole", [result()])
    assert dra_node.prepare(dra_node.ref(whole))[whole["metadata"]["uid"]].error == ""


def test_a_restart_that_must_ask_the_api_server_serves_the_kubelet_without_waiting(dra_node: DRAClient) -> None:
    """The checkpoint is lost while a claim's CDI spec stays: the restarted agent rebuilds that claim
    from the API server. Its GET hangs; the kubelet is served meanwhile (a new claim on the GPU the lost
    one may hold is refused at once, for the kubelet to retry), and the claim comes back when the API
    server answers."""
    c = dra_node.cluster
    lost = dra_node.claim("lost", [result(cores="10", memory="1Gi", share="s-lost")])
    ref_lost = dra_node.ref(lost)
    first = dra_node.prepare(ref_lost)[ref_lost[2]]
    assert first.error == ""
    assert c.agent is not None and c.agent.stop() == 0
    shutil.rmtree(c.checkpoint_dir)  # the record is gone; the spec and vcuda.config stay
    c.api.delay(r"/resourceclaims/lost$", HANG_SECONDS, method="GET", count=1)
    c.api.clear_requests()
    dra_node.close()
    c.start_agent()  # registered, and the slice published
    client = DRAClient(c)
    try:
        answered = [r for r in c.api.requests if r.method == "GET" and r.path.endswith("/resourceclaims/lost")]
        assert answered == [], "the agent registered with the kubelet only after the hanging GET"
        fresh = dra_node.claim("fresh", [result(cores="10", memory="1Gi", share="s-fresh")])
        ref_fresh = dra_node.ref(fresh)
        t0 = time.monotonic()
        waiting = client.prepare(ref_fresh)[ref_fresh[2]].error
        assert time.monotonic() - t0 < HANG_SECONDS / 2, "the Prepare waited for the hanging GET"
        # Answered at once, but refused: gpu-0 may be held by the lost claim until it is rebuilt.
        assert ref_lost[2] in waiting and "GPU 0" in waiting, waiting
        # Once the API server answers, the lost claim is recorded again: prepared, it answers as before.
        deadline = time.monotonic() + HANG_SECONDS + 30
        while not (c.checkpoint_dir / "gpumanager_internal_checkpoint").exists() or ref_lost[2] not in (
            (read_document(c.checkpoint_dir / "gpumanager_internal_checkpoint") or {}).get("Claims") or {}
        ):
            assert time.monotonic() < deadline, "the lost claim was never rebuilt"
            time.sleep(0.1)
        again = client.prepare(ref_lost)[ref_lost[2]]
        assert (again.error, again.cdi_ids, again.share_ids) == ("", first.cdi_ids, first.share_ids)
        assert client.prepare(ref_fresh)[ref_fresh[2]].error == "", "the kubelet's retry prepares it"
        assert dra_node.spec_path(ref_lost[2]).exists()
    finally:
        client.close()


def test_a_claim_prepared_again_after_its_unprepare_is_prepared_while_the_first_get_still_hangs(
    dra_node: DRAClient,
) -> None:
    """Prepare (its GET hangs), Unprepare, Prepare again: the second Prepare started after the
    Unprepare, so it is answered as any Prepare is; only the first, older than the Unprepare, is not."""
    claim = dra_node.claim("again", [result(cores="10", memory="1Gi", share="s-again")])
    ref = dra_node.ref(claim)
    dra_node.cluster.api.delay(r"/resourceclaims/again$", HANG_SECONDS, method="GET", count=1)
    with futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(dra_node.prepare, ref)
        _wait_until_sent(dra_node, first)
        assert dra_node.unprepare(ref) == {ref[2]: ""}
        second = dra_node.prepare(ref)[ref[2]]
        assert second.error == "", second.error
        assert not first.done(), "the first GET was answered before the second Prepare"
        older = first.result(timeout=60)[ref[2]]
    # The older Prepare may be refused or answered with the same devices; the claim stays prepared.
    if older.error == "":
        assert older == second
    assert dra_node.spec_path(ref[2]).exists()
    assert (dra_node.cluster.vm_path / ref[2]).exists()
    assert dra_node.unprepare(ref) == {ref[2]: ""}
    assert not dra_node.spec_path(ref[2]).exists()
