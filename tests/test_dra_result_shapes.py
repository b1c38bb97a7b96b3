"""Allocation results the kube-scheduler writes that a simple share or whole GPU does not show:
a result of a ``firstAvailable`` sub-request (``<request>/<subrequest>``), a result of an
admin-access request (the scheduler does not count it as consuming the device), and results whose
tolerations tolerate one cause of the unhealthy taint and not another."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import grpc

from gpumanager.api import dra_v1_pb2 as v1
from gpumanager.api import dra_v1_pb2_grpc as v1_grpc
from gpumanager.api import dra_v1beta1_pb2 as v1beta1
from gpumanager.api import dra_v1beta1_pb2_grpc as v1beta1_grpc
from simnode.dra_cluster import DRIVER
from simnode.gpusim_state import sim_env
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]

JSON = dict[str, Any]


def _request_names(node: DRAClient, ref: tuple[str, str, str], version: str) -> tuple[str, list[list[str]]]:
    namespace, name, uid = ref
    with grpc.insecure_channel(f"unix://{node.cluster.plugin_dir / 'dra.sock'}") as channel:
        if version == "v1":
            stub: Any = v1_grpc.DRAPluginStub(channel)
            req: Any = v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace=namespace, name=name, uid=uid)])
        else:
            stub = v1beta1_grpc.DRAPluginStub(channel)
            req = v1beta1.NodePrepareResourcesRequest(claims=[v1beta1.Claim(namespace=namespace, name=name, uid=uid)])
        entry = stub.NodePrepareResources(req, timeout=30).claims[uid]
    return entry.error, [list(d.request_names) for d in entry.devices]


def test_a_subrequest_result_is_answered_under_its_request(dra_node: DRAClient) -> None:
    # A container names the claim's request ("gpus") in resources.claims[].request; the kubelet
    # gives it the devices whose request_names hold that name. A firstAvailable result names
    # "gpus/share": answered as such, the container would get no GPU at all.
    claim = dra_node.claim("fallback", [result(cores="30", memory="4Gi", share="s-1", request="gpus/share")])
    ref = dra_node.ref(claim)
    for version in ("v1", "v1beta1"):
        error, names = _request_names(dra_node, ref, version)
        assert not error
        assert names == [["gpus"]], version
    spec = json.loads(dra_node.spec_path(ref[2]).read_text())
    assert [d["name"] for d in spec["devices"]] == [f"{ref[2]}-gpus_share-gpu-0-s-1"], "CDI names stay distinct"


def _admin(device: str = "gpu-0", **consumed: str) -> JSON:
    out = result(device, share="admin-1", **consumed)
    out["adminAccess"] = True
    return out


def test_an_admin_access_claim_consumes_nothing_and_gets_the_whole_gpu(dra_node: DRAClient) -> None:
    # The scheduler places admin-access requests on devices in use and does not count them
    # (a monitoring pod beside the shares): the agent must not count them either, or the shares the
    # scheduler placed next would be refused at prepare time.
    node = dra_node
    admin = node.claim("monitor", [_admin(cores="100", memory="15Gi")], namespace="admin")
    first = node.claim("first", [result(cores="60", memory="8Gi", share="s-1")])
    answers = node.prepare(node.ref(admin), node.ref(first))
    assert not answers[admin["metadata"]["uid"]].error
    assert not answers[first["metadata"]["uid"]].error
    second = node.claim("second", [result(cores="40", memory="7Gi", share="s-2")])
    assert not node.prepare(node.ref(second))[second["metadata"]["uid"]].error, "the GPU holds 60 + 40 cores"
    # The admin claim sees the whole GPU through the untouched driver, with no limits.
    spec = json.loads(node.spec_path(admin["metadata"]["uid"]).read_text())
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts["/usr/local/nvidia"].endswith("origin")
    # The shares still cannot go over the GPU, admin claim or not.
    third = node.claim("third", [result(cores="1", memory="256Mi", share="s-3")])
    assert "more than the device has left" in node.prepare(node.ref(third))[third["metadata"]["uid"]].error
    # Freeing the admin claim frees nothing the shares hold; the shares still fill the GPU.
    assert node.unprepare(node.ref(admin)) == {admin["metadata"]["uid"]: ""}
    assert "more than the device has left" in node.prepare(node.ref(third))[third["metadata"]["uid"]].error
    assert node.unprepare(node.ref(first), node.ref(second)) == {
        first["metadata"]["uid"]: "",
        second["metadata"]["uid"]: "",
    }
    # Prepared first on an idle GPU, an admin claim leaves it whole for a whole-GPU claim.
    admin2 = node.claim("monitor2", [_admin()], namespace="admin")
    whole = node.claim("whole", [result(cores="100", memory="15Gi", share="w-1")])
    answers = node.prepare(node.ref(admin2), node.ref(whole))
    assert not answers[admin2["metadata"]["uid"]].error
    assert not answers[whole["metadata"]["uid"]].error


def test_admin_access_survives_an_agent_restart(dra_node: DRAClient) -> None:
    node = dra_node
    admin = node.claim("monitor", [_admin(cores="100", memory="15Gi")], namespace="admin")
    assert not node.prepare(node.ref(admin))[admin["metadata"]["uid"]].error
    assert node.cluster.agent is not None
    node.cluster.agent.stop()
    node.cluster.start_agent()
    node.close()
    again = DRAClient(node.cluster)
    try:
        share = again.claim("share", [result(cores="100", memory="15Gi", share="w-1")])
        assert not again.prepare(again.ref(share))[share["metadata"]["uid"]].error, (
            "after the restart the admin claim still consumes nothing"
        )
        assert not again.prepare(again.ref(admin))[admin["metadata"]["uid"]].error, "and it is still prepared"
    finally:
        again.close()


def test_a_toleration_of_one_cause_does_not_tolerate_another(dra_node: DRAClient) -> None:
    # Tolerations as everywhere in Kubernetes: "Equal" (the default operator) tolerates the taint
    # of that key only with that value. A pod that tolerates a GPU tainted xid-48 (allocated while
    # it was) must not be started on it once it is tainted xid-79 (fallen off the bus).
    node = dra_node
    assert node.cluster.agent is not None
    done = subprocess.run(
        [sys.executable, "-m", "simnode.gpusim", "xid", "--gpu", "0", "--xid", "79"],
        env=sim_env(node.cluster.spec, node.cluster.agent.state),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert node.cluster.wait_slice(lambda s: s is not None and bool(s["spec"]["devices"][0].get("taints")))
    key = f"{DRIVER}/unhealthy"

    def tolerating(name: str, *tolerations: JSON) -> JSON:
        out = result(cores="10", memory="1Gi", share=f"s-{name}")
        out["tolerations"] = list(tolerations)
        return node.claim(name, [out])

    cases = {
        "other-cause": (tolerating("other-cause", {"key": key, "value": "xid-48", "effect": "NoSchedule"}), False),
        "other-cause-equal": (
            tolerating("other-cause-equal", {"key": key, "operator": "Equal", "value": "xid-48"}),
            False,
        ),
        "no-execute-only": (
            tolerating("no-execute-only", {"key": key, "operator": "Exists", "effect": "NoExecute"}),
            False,
        ),
        "this-cause": (tolerating("this-cause", {"key": key, "value": "xid-79", "effect": "NoSchedule"}), True),
        "any-cause": (tolerating("any-cause", {"key": key, "operator": "Exists"}), True),
        "everything": (tolerating("everything", {"operator": "Exists"}), True),
    }
    answers = node.prepare(*(node.ref(c) for c, _ in cases.values()))
    for name, (claim, ok) in cases.items():
        error = answers[claim["metadata"]["uid"]].error
        if ok:
            assert not error, (name, error)
        else:
            assert "gpu-0 is unhealthy" in error, (name, error)
