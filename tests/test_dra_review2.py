"""DRA mode against what the real API server and kubelet do: device taints a server drops,
API errors that name their cause, and claims the scheduler allocated against other nodes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import devices
from gpumanager.dra.publisher import SlicePublisher
from simnode.apiserver import ApiServerSimulator
from simnode.dra_scheduler import Allocator, Selectors
from tests.dra_slice_fixtures import DRIVER, settle, slice_content, stored_slices

CLASS = {
    "metadata": {"name": "vcuda"},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
}


def _settle(pub: SlicePublisher) -> int:
    """Sync until a pass writes nothing; the number of passes that wrote."""
    return settle(pub, passes=6)


def _placed(sim: ApiServerSimulator) -> list[str]:
    """Where the scheduler (which sees only what the server stored) puts a claim for a 30-core share."""
    claim = {
        "metadata": {"name": "c", "namespace": "ml"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "vcuda",
                            "allocationMode": "ExactCount",
                            "count": 1,
                            "capacity": {"requests": {"cores": "30", "memory": "4Gi"}},
                        },
                    }
                ]
            }
        },
    }
    alloc = Allocator(stored_slices(sim), {"vcuda": CLASS}, [], Selectors())
    results = alloc.allocate(claim, "node-a") or []
    return [str(r["device"]) for r in results]


@pytest.mark.parametrize("disabled", [[], ["DRADeviceTaints"]])
def test_an_unhealthy_gpu_takes_no_new_claim_whether_or_not_the_server_keeps_taints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, disabled: list[str]
) -> None:
    # Kubernetes 1.35 (DRADeviceTaints alpha, off) drops device taints from a ResourceSlice without
    # an error, and its scheduler ignores them: a GPU published as tainted is then offered like any
    # other, and every claim placed there is refused at Prepare (the pod never starts). Where the
    # server drops taints, an unhealthy GPU must not be offered at all.
    taints = {0: devices.Taint("XID 79", "2026-11-23T00:00:00Z")}
    with ApiServerSimulator(disabled_features=disabled) as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=slice_content(tmp_path, taints))
        with caplog.at_level(logging.WARNING, logger="gpumanager.dra.publisher"):
            _settle(pub)
        assert _placed(sim) == ["gpu-1"], "a claim went to the unhealthy GPU"
        [stored] = stored_slices(sim)
        names = [d["name"] for d in stored["spec"]["devices"]]
        if disabled:
            assert names == ["gpu-1"]
            said = [r.getMessage() for r in caplog.records if "gpu-0" in r.getMessage()]
            assert said and "node-a-vcuda.tencent.com" in said[0] and "DRADeviceTaints" in said[0], said
        else:
            assert names == ["gpu-0", "gpu-1"] and stored["spec"]["devices"][0]["taints"][0]["value"] == "xid-79"
        assert _settle(pub) == 0, "settled: no more writes"
        # The GPU comes back: it is offered again.
        taints.clear()
        assert _settle(pub) == 1
        [stored] = stored_slices(sim)
        assert [d["name"] for d in stored["spec"]["devices"]] == ["gpu-0", "gpu-1"]
        assert not any(d.get("taints") for d in stored["spec"]["devices"])
        assert _placed(sim) == ["gpu-0"]


FORBIDDEN = (
    'resourceslices.resource.k8s.io is forbidden: User "system:serviceaccount:kube-system:gpu-manager" '
    'cannot create resource "resourceslices" in API group "resource.k8s.io" at the cluster scope'
)


def test_a_slice_the_server_refuses_is_reported_with_the_servers_reason(tmp_path: Path) -> None:
    # The API server says why in the Status it answers (the RBAC rule missing, the field it refuses);
    # "403 Forbidden" or "422 Unprocessable Entity" alone tells an operator nothing to fix.
    with ApiServerSimulator() as sim:
        content = slice_content(tmp_path, {})
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=content)
        sim.fail_next("POST", "resourceslices", 403, 1, message=FORBIDDEN)
        assert not pub._sync_logged()
        assert "403" in pub.last_error and 'cannot create resource "resourceslices"' in pub.last_error, pub.last_error

        def bad(generation: int) -> dict[str, Any]:
            spec: dict[str, Any] = content(generation)
            spec["devices"][1]["attributes"]["productName"] = {"string": "x" * 65}
            return spec

        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=bad)
        assert not pub._sync_logged()
        assert "422" in pub.last_error and "spec.devices[1].attributes[productName]" in pub.last_error, pub.last_error


def test_a_claim_the_server_will_not_give_is_refused_with_the_servers_reason() -> None:
    from gpumanager.dra.claims import ClaimError
    from gpumanager.dra.prepare import api_reader

    message = (
        'resourceclaims.resource.k8s.io "train" is forbidden: User "system:serviceaccount:kube-system:gpu-manager" '
        'cannot get resource "resourceclaims" in API group "resource.k8s.io" in the namespace "ml"'
    )
    with ApiServerSimulator() as sim:
        read = api_reader(sim.client())
        sim.fail_next("GET", "resourceclaims/train", 403, 1, message=message)
        with pytest.raises(ClaimError) as caught:
            read("ml", "train")
        text = str(caught.value)
        assert "ml/train" in text and 'cannot get resource "resourceclaims"' in text, text


def test_a_product_name_is_cut_to_the_64_bytes_the_api_server_allows(tmp_path: Path) -> None:
    # The API server limits a string attribute to 64 bytes (Go's len), not 64 characters: a name of
    # 64 characters with one outside ASCII was cut to 64 characters, 65 bytes, and the server refused
    # the node's whole slice, so none of its GPUs was published.
    name = "NVIDIA H100 80GB HBM3 \u00e9dition " + "x" * 40
    assert len(name) > 64
    gpus = [GPUInfo(0, "GPU-0", name, 0, 81559 << 20, "00000000:07:00.0", 0)]

    def content(generation: int) -> dict[str, Any]:
        return devices.slice_spec(
            node="node-a",
            driver=DRIVER,
            gpus=gpus,
            topology=NodeTopology(levels=((0,),)),
            taints={},
            generation=generation,
            sysfs_root=tmp_path,
        )

    product = content(1)["devices"][0]["attributes"]["productName"]["string"]
    assert len(product.encode()) <= 64 and name.startswith(product), product
    with ApiServerSimulator() as sim:
        pub = SlicePublisher(sim.client(), node="node-a", driver=DRIVER, content=content)
        assert pub._sync_logged(), pub.last_error
        [stored] = stored_slices(sim)
        assert stored["spec"]["devices"][0]["attributes"]["productName"]["string"] == product


def test_the_simulated_api_server_counts_string_attributes_in_bytes() -> None:
    from simnode.apiserver_errors import ApiError
    from simnode.apiserver_resource import validate_resource_slice

    spec = {
        "driver": DRIVER,
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0", "attributes": {"productName": {"string": "\u00e9" * 33}}}],
    }
    with pytest.raises(ApiError) as caught:
        validate_resource_slice({"metadata": {"name": "s"}, "spec": spec})
    assert "spec.devices[0].attributes[productName].string" in str(caught.value)
