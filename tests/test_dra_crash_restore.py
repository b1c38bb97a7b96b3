"""An agent killed in the middle of a Prepare loses nothing and leaves nothing: the claim recorded
in the checkpoint gets its files at the next start (or at the kubelet's retry), and the temp file of
a spec write that did not finish is removed."""

from __future__ import annotations

import json

import pytest

from gpumanager.allocation.journal import read_document
from simnode.dra_cluster import DRIVER
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]


def test_a_kill_between_the_checkpoint_and_the_files_loses_nothing(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    share = dra_node.claim("share", [result(cores="30", memory="4Gi", share="s-1")])
    ref = dra_node.ref(share)
    dra_node.prepare_killed_after_checkpoint(ref)
    # At start, the claim recorded before the kill has its files.
    spec = dra_node.spec_path(ref[2])
    assert spec.exists() and (c.vm_path / ref[2] / "vcuda.config").exists()
    devices = [d["name"] for d in json.loads(spec.read_text())["devices"]]
    # The kubelet's retry answers what a Prepare that was not interrupted would have.
    answer = dra_node.prepare(ref)[ref[2]]
    assert answer.error == "" and answer.cdi_ids == [f"{DRIVER}/gpu={d}" for d in devices]
    # Its capacity is held once: a whole GPU does not fit beside it, and does once it is gone.
    whole = dra_node.claim("whole", [result()])
    assert "whole" in dra_node.prepare(dra_node.ref(whole))[whole["metadata"]["uid"]].error
    assert dra_node.unprepare(ref) == {ref[2]: ""}
    assert dra_node.prepare(dra_node.ref(whole))[whole["metadata"]["uid"]].error == ""
    assert not spec.exists()


def test_a_spec_write_cut_short_leaves_no_temp_file(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    share = dra_node.claim("share", [result(cores="30", memory="4Gi", share="s-1")])
    ref = dra_node.ref(share)
    assert dra_node.prepare(ref)[ref[2]].error == ""
    # What atomic_write leaves when the agent is killed before its rename.
    leftover = c.cdi_root / f".{DRIVER}-{ref[2]}.json.k9x2ab"
    leftover.write_text('{"cdiVersion": "0.5.0", "kind": "')
    other = c.cdi_root / ".someone-else.json.k9x2ab"
    other.write_text("{}")
    assert c.agent is not None
    c.agent.stop()
    c.start_agent()
    assert not leftover.exists()
    assert other.exists(), "a file that is not the driver's was removed"
    assert dra_node.spec_path(ref[2]).exists()


CHECKPOINT = "gpumanager_internal_checkpoint"


@pytest.mark.parametrize("damage", ["bad-field", "entry-lost"])
def test_a_claim_whose_checkpoint_entry_cannot_be_trusted_is_rebuilt_not_dropped(
    dra_node: DRAClient, damage: str
) -> None:
    c = dra_node.cluster
    share = dra_node.claim("share", [result(cores="30", memory="4Gi", share="s-1")])
    ref = dra_node.ref(share)
    first = dra_node.prepare(ref)[ref[2]]
    assert first.error == ""
    assert c.agent is not None
    c.agent.stop()  # a clean stop: the snapshot holds everything
    path = c.checkpoint_dir / CHECKPOINT
    doc = read_document(path)
    assert doc is not None and ref[2] in doc["Claims"]
    if damage == "bad-field":
        doc["Claims"][ref[2]]["Devices"][0]["Cores"] = "thirty"
    else:
        del doc["Claims"][ref[2]]
    path.write_text(json.dumps(doc))
    c.start_agent()
    # The running container's files are still there, and the claim is prepared as before.
    assert dra_node.spec_path(ref[2]).exists() and (c.vm_path / ref[2] / "vcuda.config").exists()
    assert dra_node.prepare(ref)[ref[2]] == first
    # Its capacity is held: a whole GPU does not fit beside it.
    whole = dra_node.claim("whole", [result()])
    assert "whole" in dra_node.prepare(dra_node.ref(whole))[whole["metadata"]["uid"]].error
    assert dra_node.unprepare(ref) == {ref[2]: ""}
    assert not dra_node.spec_path(ref[2]).exists()


def test_files_of_a_claim_the_api_server_no_longer_has_are_removed_at_start(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    share = dra_node.claim("gone", [result(cores="30", memory="4Gi", share="s-1")])
    ref = dra_node.ref(share)
    assert dra_node.prepare(ref)[ref[2]].error == ""
    assert c.agent is not None
    c.agent.stop()
    path = c.checkpoint_dir / CHECKPOINT
    doc = read_document(path)
    assert doc is not None
    del doc["Claims"][ref[2]]
    path.write_text(json.dumps(doc))
    c.resource.delete_namespaced_resource_claim("gone", "default", _preload_content=False)
    c.start_agent()
    assert not dra_node.spec_path(ref[2]).exists()
    assert not (c.vm_path / ref[2]).exists()
