"""The one-share-per-container check fails closed: a pod (or claim) it cannot read is an error.

A container with a share and another claim of the driver runs with whichever ``/etc/vcuda`` the
runtime applies last, so such claims are refused at Prepare. The check reads the pods a claim is
reserved for (the agent's pod cache, else a GET); a GET that failed (500, a timeout) counted as
"pod not found" and the check passed. Only a 404, or a pod of that name with another UID, means
the pod is gone; any other failure is an error the kubelet retries.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simnode.dra_cluster import NODE
from tests.dra_claim_fixtures import DRAClient, result, start_dra_node, stop_dra_node

JSON = dict[str, Any]


@pytest.fixture
def v100(tmp_path: Path, sim_built: Path) -> Iterator[DRAClient]:
    client = start_dra_node(tmp_path / "node", "v100-pcie-x4")
    try:
        yield client
    finally:
        stop_dra_node(client)


def _pod(node: DRAClient, name: str, containers: dict[str, list[str]]) -> JSON:
    claims = sorted({x for v in containers.values() for x in v})
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": f"r-{x}", "resourceClaimName": x} for x in claims],
            "containers": [
                {"name": cn, "image": "x", "resources": {"claims": [{"name": f"r-{x}"} for x in cl]}}
                for cn, cl in containers.items()
            ],
        },
    }
    out: JSON = json.loads(node.cluster.core.create_namespaced_pod("default", body, _preload_content=False).data)
    return out


def _reserve(node: DRAClient, claim: JSON, pod: JSON) -> JSON:
    meta = claim["metadata"]
    claim["status"]["reservedFor"] = [
        {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
    ]
    api = node.cluster.resource
    out: JSON = json.loads(
        api.replace_namespaced_resource_claim_status(
            meta["name"], meta["namespace"], claim, _preload_content=False
        ).data
    )
    return out


@pytest.mark.parametrize("status", [500, 503, 403])
def test_a_pod_that_cannot_be_read_is_an_error_not_a_pass(v100: DRAClient, status: int) -> None:
    api = v100.cluster.api
    api.hold_watches(True)  # the agent's pod cache lags behind: the check must GET the pod
    try:
        pod = _pod(v100, "p", {"m": ["s", "w"]})
        share = _reserve(v100, v100.claim("s", [result("gpu-0", cores="30", memory="4Gi", share="s-1")]), pod)
        whole = _reserve(v100, v100.claim("w", [result("gpu-1")]), pod)
        refs = v100.ref(share), v100.ref(whole)
        api.fail_next("GET", r"/pods/p$", status, count=10)
        answers = v100.prepare(*refs)
        for ref in refs:
            error = answers[ref[2]].error
            assert error, "prepared although the pod using it could not be read"
            assert "default/p" in error and str(status) in error, error
            assert not v100.spec_path(ref[2]).exists()
        api.clear_faults()
        # The pod can be read again: the container's share and whole GPU are refused for what they are.
        again = v100.prepare(*refs)
        assert all("vcuda.config" in again[r[2]].error for r in refs), again
    finally:
        api.hold_watches(False)


def test_a_pod_that_is_gone_does_not_hold_the_claim(v100: DRAClient) -> None:
    api = v100.cluster.api
    api.hold_watches(True)
    try:
        pod = _pod(v100, "gone", {"m": ["s", "w"]})
        share = _reserve(v100, v100.claim("s", [result("gpu-0", cores="30", memory="4Gi", share="s-1")]), pod)
        v100.cluster.core.delete_namespaced_pod("gone", "default", grace_period_seconds=0)
        ref = v100.ref(share)
        assert v100.prepare(ref)[ref[2]].error == ""
    finally:
        api.hold_watches(False)
