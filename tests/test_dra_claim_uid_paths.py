"""A claim UID names a directory and a CDI spec: a UID that is not a plain name never reaches the disk.

The kubelet passes the UID it read from the API server, but the agent must not trust it with its
files: an empty UID named the whole ``--virtual-manager-path``, ``..`` walked out of it, and a
stray ``<driver>-.json`` in the CDI directory did the same at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from gpumanager.allocation import claims as claim_records
from gpumanager.dra import cdi
from gpumanager.vmanager import claims as claim_files
from simnode.dra_cluster import DRIVER
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]

BAD_UIDS = ["", ".", "..", "../outside", "a/b", "x/../..", "-leading", "with space"]


def _canary(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "keep").write_text("x")
    return directory


def test_unprepare_of_a_bad_uid_is_refused_and_removes_nothing(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    prepared = dra_node.claim("kept", [result(cores="30", memory="4Gi", share="s-1")])
    ns, name, uid = dra_node.ref(prepared)
    assert dra_node.prepare((ns, name, uid))[uid].error == ""
    pod_dir = _canary(c.vm_path / "0f9e1d2c-aaaa-bbbb-cccc-123456789abc")  # a device-plugin pod's directory
    outside = _canary(c.vm_path.parent / f"{c.vm_path.name}-outside")
    try:
        for bad in [*BAD_UIDS, f"../{outside.name}"]:
            answer = dra_node.unprepare(("default", "x", bad))
            assert bad in answer, answer
            assert "UID" in answer[bad] and repr(bad) in answer[bad], answer
        assert (pod_dir / "keep").exists()
        assert (outside / "keep").exists()
        assert (c.vm_path / uid / "vcuda.config").exists()
        assert dra_node.spec_path(uid).exists()
        # The prepared claim is still prepared: a repeat answers the same devices.
        assert dra_node.prepare((ns, name, uid))[uid].error == ""
    finally:
        for d in (outside,):
            for f in d.iterdir():
                f.unlink()
            d.rmdir()


def test_prepare_of_a_bad_uid_is_refused_before_the_api_server_is_asked(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    before_cdi = sorted(os.listdir(c.cdi_root)) if c.cdi_root.exists() else []
    before_vm = sorted(os.listdir(c.vm_path))
    for bad in BAD_UIDS:
        answer = dra_node.prepare(("default", "claim", bad))
        assert answer[bad].error and repr(bad) in answer[bad].error, answer
        assert "UID" in answer[bad].error
    assert (sorted(os.listdir(c.cdi_root)) if c.cdi_root.exists() else []) == before_cdi
    assert sorted(os.listdir(c.vm_path)) == before_vm


def test_a_stray_spec_name_in_the_cdi_directory_removes_nothing_at_start(dra_node: DRAClient) -> None:
    c = dra_node.cluster
    prepared = dra_node.claim("kept", [result(cores="30", memory="4Gi", share="s-1")])
    ns, name, uid = dra_node.ref(prepared)
    assert dra_node.prepare((ns, name, uid))[uid].error == ""
    pod_dir = _canary(c.vm_path / "0f9e1d2c-aaaa-bbbb-cccc-123456789abc")
    for stray in (f"{DRIVER}-.json", f"{DRIVER}-..json", f"{DRIVER}-..json.json"):
        (c.cdi_root / stray).write_text("{}")
    assert c.agent is not None
    c.agent.stop()
    c.start_agent()
    assert (pod_dir / "keep").exists()
    assert (c.vm_path / uid / "vcuda.config").exists()
    assert dra_node.spec_path(uid).exists()


def test_checkpoint_claims_with_bad_uids_are_reported_not_loaded() -> None:
    good = {
        "Namespace": "default",
        "Name": "c",
        "Devices": [
            {
                "Request": "gpu",
                "Pool": "n",
                "Device": "gpu-0",
                "Minor": 0,
                "ShareID": "",
                "Cores": 100,
                "Memory": 1 << 30,
                "Whole": True,
            }
        ],
    }
    doc = {"Claims": {bad: good for bad in BAD_UIDS} | {"5c1f0e4a-1111-2222-3333-444455556666": good}}
    found, problems = claim_records.from_json(doc)
    assert [c.uid for c in found] == ["5c1f0e4a-1111-2222-3333-444455556666"]
    assert len(problems) == len(BAD_UIDS)
    assert all("UID" in p for p in problems), problems


@pytest.mark.parametrize("bad", BAD_UIDS)
def test_no_path_is_built_from_a_bad_uid(tmp_path: Path, bad: str) -> None:
    settings = cdi.CDISettings(
        root=tmp_path / "cdi", driver=DRIVER, vdriver_nvidia="/n", vdriver_origin="/o", virtual_manager_path="/vm"
    )
    with pytest.raises(ValueError, match="UID"):
        cdi.spec_path(settings, bad)
    with pytest.raises(ValueError, match="UID"):
        claim_files.claim_dir(tmp_path, bad)


def test_the_gpus_a_claim_names_with_its_companions_are_checkpointed() -> None:
    claim = claim_records.ClaimAllocation(
        uid="5c1f0e4a-1111-2222-3333-444455556666",
        namespace="default",
        name="c",
        devices=(claim_records.ClaimDevice("gpu", "n", "gpu-0", 0, "", 100, 1 << 30, True),),
        visible=(2, 3),
    )
    doc = {"Claims": claim_records.to_json([claim])}
    assert claim_records.from_json(json.loads(json.dumps(doc))) == ([claim], [])
    alone = dataclasses.replace(claim, visible=())
    assert "Visible" not in alone.to_json(), "a claim alone is written as before"
    for bad in ("2", [2, "3"], [-1], [True], None):
        entry = dict(claim.to_json(), Visible=bad)
        found, problems = claim_records.from_json({"Claims": {claim.uid: entry}})
        assert found == [] and len(problems) == 1 and "Visible" in problems[0], (bad, problems)
