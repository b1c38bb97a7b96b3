"""The CDI specs the agent writes load in a CDI runtime: the rules of the CDI specification
(container-device-interface, SPEC.md and its parser) checked on specs of every claim shape."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation.claims import ClaimAllocation, ClaimDevice
from gpumanager.device.types import GPUInfo
from gpumanager.dra import cdi

JSON = dict[str, Any]
GPUS = [
    GPUInfo(
        index=i,
        uuid=f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000",
        name="Sim",
        minor=i,
        memory_total=16 << 30,
        pci_bus_id=f"00000000:{i + 10:02x}:00.0",
        numa_node=0,
    )
    for i in range(4)
]
UID = "0c9d2f4e-1111-2222-3333-444455556666"

VERSIONS = ["0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0"]
SPEC_KEYS = {"cdiVersion", "kind", "annotations", "devices", "containerEdits"}
DEVICE_KEYS = {"name", "annotations", "containerEdits"}
EDIT_KEYS = {"env", "deviceNodes", "mounts", "hooks", "additionalGIDs", "intelRdt", "netDevices"}
NODE_KEYS = {"path", "hostPath", "type", "major", "minor", "fileMode", "permissions", "uid", "gid"}
MOUNT_KEYS = {"hostPath", "containerPath", "type", "options"}
VENDOR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
DEVICE_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def _minimum_version(spec: JSON) -> str:
    """What the CDI parser requires for the fields used (specs-go/version.go)."""
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec["devices"]]
    need = "0.3.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        need = "0.4.0"
    if any(n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []) or any(
        not d["name"][:1].isalpha() for d in spec["devices"]
    ):
        need = "0.5.0"
    if spec.get("annotations") or any(d.get("annotations") for d in spec["devices"]):
        need = "0.6.0"
    return need


def check_spec(spec: JSON) -> None:
    """Raise AssertionError where a CDI runtime would refuse the spec."""
    assert set(spec) <= SPEC_KEYS, set(spec) - SPEC_KEYS
    assert spec["cdiVersion"] in VERSIONS
    assert _version_tuple(spec["cdiVersion"]) >= _version_tuple(_minimum_version(spec))
    vendor, _, klass = spec["kind"].partition("/")
    assert VENDOR_CLASS.match(vendor) and VENDOR_CLASS.match(klass), spec["kind"]
    names = [d["name"] for d in spec["devices"]]
    assert names and len(set(names)) == len(names), names
    for dev in spec["devices"]:
        assert set(dev) <= DEVICE_KEYS
        assert DEVICE_NAME.match(dev["name"]), dev["name"]
        assert dev.get("containerEdits"), f"device {dev['name']} has no edits (the whole file would be refused)"
    for edits in [spec.get("containerEdits") or {}] + [d["containerEdits"] for d in spec["devices"]]:
        assert set(edits) <= EDIT_KEYS, set(edits) - EDIT_KEYS
        for item in edits.get("env") or []:
            assert isinstance(item, str) and "=" in item and item.split("=", 1)[0], item
        for node in edits.get("deviceNodes") or []:
            assert set(node) <= NODE_KEYS and node["path"].startswith("/"), node
            assert set(node.get("permissions", "rwm")) <= set("rwm")
        for m in edits.get("mounts") or []:
            assert set(m) <= MOUNT_KEYS and m["containerPath"].startswith("/") and m["hostPath"].startswith("/"), m
            assert "bind" in (m.get("options") or []), m
    env = [e.split("=", 1)[0] for e in (spec.get("containerEdits") or {}).get("env") or []]
    assert env.count("NVIDIA_VISIBLE_DEVICES") == 1


def _dev(device: int, *, request: str = "gpu", share: str = "", cores: int = 100, whole: bool = True) -> ClaimDevice:
    return ClaimDevice(request, "node-a", f"gpu-{device}", device, share, cores, 16 << 30 if whole else 4 << 30, whole)


CLAIMS = {
    "share": [_dev(0, share="5f8e1c2a-0000-4000-8000-000000000001", cores=30, whole=False)],
    "whole": [_dev(1)],
    "two-whole": [_dev(0), _dev(1)],
    "subrequest": [_dev(2, request="gpu/large")],
    "odd-share-id": [_dev(3, share="share id/with_odd:chars_", cores=10, whole=False)],
    "two-requests": [_dev(0, request="a"), _dev(1, request="b")],
}


@pytest.mark.parametrize("shape", sorted(CLAIMS))
def test_specs_of_every_claim_shape_load(tmp_path: Path, shape: str) -> None:
    settings = cdi.CDISettings(
        root=tmp_path, driver="vcuda.tencent.com", vdriver_nvidia="/n", vdriver_origin="/o", virtual_manager_path="/vm"
    )
    claim = ClaimAllocation(UID, "ns", "c", tuple(CLAIMS[shape]))
    spec = cdi.build_spec(settings, claim, GPUS)
    check_spec(spec)
    ids = [cdi.device_id(settings, UID, d) for d in claim.devices]
    assert ids == [f"{spec['kind']}={d['name']}" for d in spec["devices"]]
