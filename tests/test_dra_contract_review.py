"""DRA mode against the contract of the real components: what the API server accepts in a
ResourceSlice, how the publisher copes with other writers, and which containers use a claim."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumanager.device.types import GPUInfo, NodeTopology
from gpumanager.dra import consumers, devices
from gpumanager.dra.publisher import SlicePublisher
from gpumanager.kube.rest import ApiException
from simnode.apiserver import ApiServerSimulator
from simnode.apiserver_errors import ApiError
from simnode.apiserver_resource import validate_resource_slice
from simnode.dra_cluster import DRIVER, NODE
from tests.dra_claim_fixtures import DRAClient, dra_node, result

__all__ = ["dra_node"]

JSON = dict[str, Any]

GiB = 1 << 30


def _gpu(index: int, memory: int = 16 * GiB, **kw: Any) -> GPUInfo:
    fields: JSON = {
        "index": index,
        "uuid": f"GPU-{index:08d}-0000-0000-0000-000000000000",
        "name": "Tesla T4",
        "minor": index,
        "memory_total": memory,
        "pci_bus_id": f"00000000:{index + 1:02x}:00.0",
    }
    fields.update(kw)
    return GPUInfo(**fields)


def _spec(gpus: list[GPUInfo], generation: int = 1, tmp: Path | None = None) -> JSON:
    return devices.slice_spec(
        node=NODE,
        driver=DRIVER,
        gpus=gpus,
        topology=NodeTopology(levels=()),
        taints={},
        generation=generation,
        sysfs_root=tmp or Path("/nonexistent"),
    )


def _as_stored(spec: JSON, name: str = "x") -> JSON:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


# -- what the API server accepts -------------------------------------------------------------------


def test_slice_of_a_gpu_lost_at_first_start_is_accepted(tmp_path: Path) -> None:
    """A GPU lost at start and never seen whole (a one-GPU node) is described with 0 bytes of
    memory: its device must still pass the API server's capacity rules, or the node's whole slice
    (its other GPUs too) is refused."""
    spec = _spec([_gpu(0, memory=0), _gpu(1)], tmp=tmp_path)
    try:
        validate_resource_slice(_as_stored(json.loads(json.dumps(spec))))
    except ApiError as exc:
        pytest.fail(f"the API server would refuse the slice: {exc}")
    small = _spec([_gpu(0, memory=100 << 20)], tmp=tmp_path)
    try:
        validate_resource_slice(_as_stored(json.loads(json.dumps(small))))
    except ApiError as exc:
        pytest.fail(f"the API server would refuse the slice: {exc}")


# -- the publisher and other writers ---------------------------------------------------------------


@pytest.fixture
def api() -> Iterator[ApiServerSimulator]:
    server = ApiServerSimulator()
    server.start()
    server.add_node(NODE)
    try:
        yield server
    finally:
        server.stop()


def _slices(api: ApiServerSimulator) -> dict[str, JSON]:
    client = api.client()
    from kubernetes import client as k8s

    data = json.loads(k8s.ResourceV1Api(client).list_resource_slice(_preload_content=False).data)
    return {s["metadata"]["name"]: s for s in data["items"]}


def _create_slice(api: ApiServerSimulator, name: str, spec: JSON) -> None:
    from kubernetes import client as k8s

    k8s.ResourceV1Api(api.client()).create_resource_slice(_as_stored(spec, name), _preload_content=False)


def test_stale_slice_that_cannot_be_deleted_does_not_keep_ours_unpublished(api: ApiServerSimulator) -> None:
    """A slice of this node and driver under another name (an earlier version's) that the server
    refuses to delete must not keep the node's own slice from being published: ours goes above it."""
    gpus = [_gpu(0)]
    stale = _spec(gpus, generation=4)
    _create_slice(api, "old-name-of-the-slice", stale)
    api.fail_next("DELETE", r"/resourceslices/old-name-of-the-slice$", status=403, count=1000)
    pub = SlicePublisher(api.component_client("dra"), node=NODE, driver=DRIVER, content=lambda g: _spec(gpus, g))
    for _ in range(2):
        try:
            pub.sync()
        except ApiException:
            pass
    found = _slices(api)
    assert pub.name in found, f"our slice was never published: {sorted(found)}"
    assert found[pub.name]["spec"]["pool"]["generation"] > 4


# -- which containers use a claim --------------------------------------------------------------------


def _pod_with_sidecar() -> JSON:
    return {
        "metadata": {"name": "p", "namespace": "default", "uid": "u-1"},
        "spec": {
            "resourceClaims": [{"name": "a", "resourceClaimName": "claim-a"}],
            "initContainers": [
                {"name": "side", "restartPolicy": "Always", "resources": {"claims": [{"name": "a"}]}},
                {"name": "setup", "resources": {"claims": [{"name": "a"}]}},
            ],
            "containers": [{"name": "main"}],
        },
        "status": {"phase": "Running"},
    }


def test_init_and_sidecar_containers_count_as_users_of_a_claim() -> None:
    """An init container (a sidecar too) that names a claim uses it: its processes belong in
    pids.config, and /usage and the container metrics show it."""
    assert consumers.containers_using(_pod_with_sidecar(), "claim-a") == ["side", "setup"]


def _claim_with_pod(node: DRAClient, name: str, results: list[JSON], pod: JSON) -> JSON:
    api = node.cluster.resource
    body: JSON = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    created: JSON = json.loads(api.create_namespaced_resource_claim("default", body, _preload_content=False).data)
    created["status"] = {
        "allocation": {"devices": {"results": results}},
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
    }
    out: JSON = json.loads(
        api.replace_namespaced_resource_claim_status(name, "default", created, _preload_content=False).data
    )
    return out


def test_sidecar_with_a_share_and_another_claim_is_refused(dra_node: DRAClient) -> None:
    """The rule "a container with a share uses no other claim of the driver" holds for init and
    sidecar containers too: the runtime merges their claims' CDI edits the same way."""
    manifest: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "side-pod", "namespace": "default"},
        "spec": {
            "resourceClaims": [
                {"name": "share", "resourceClaimName": "share-claim"},
                {"name": "other", "resourceClaimName": "other-claim"},
            ],
            "initContainers": [
                {
                    "name": "side",
                    "image": "cuda:12",
                    "restartPolicy": "Always",
                    "resources": {"claims": [{"name": "share"}, {"name": "other"}]},
                }
            ],
            "containers": [{"name": "main", "image": "cuda:12"}],
        },
    }
    pod = dra_node.cluster.create_pod(manifest)
    share = _claim_with_pod(dra_node, "share-claim", [result(cores="30", memory="1Gi", share="s-1")], pod)
    other = _claim_with_pod(dra_node, "other-claim", [result(cores="20", memory="1Gi", share="s-2")], pod)
    answers = dra_node.prepare(DRAClient.ref(share), DRAClient.ref(other))
    for claim in (share, other):
        error = answers[claim["metadata"]["uid"]].error
        assert "side" in error and "share" in error, answers


# -- names the kubelet and the container runtime parse ---------------------------------------------


@pytest.mark.parametrize("name", ["0gpu.example.com", "9.example.com"])
def test_driver_name_that_is_no_cdi_vendor_is_refused_at_start(name: str) -> None:
    """The driver name is the CDI vendor of every spec (``<driver>/gpu=<device>``): CDI wants a
    vendor that starts with a letter, and a runtime refuses every device of a spec whose kind does
    not parse. A DNS subdomain may start with a digit, so the flag is checked at start."""
    from gpumanager.config import Config, ConfigError

    with pytest.raises(ConfigError, match="--dra-driver-name"):
        Config(mode="dra", dra_driver_name=name).validate()
    Config(mode="dra", dra_driver_name="gpu0.example.com").validate()


# -- the kubelet's health stream ----------------------------------------------------------------------


def test_registration_advertises_the_health_service(dra_node: DRAClient) -> None:
    """A kubelet that speaks dra-health v1 opens the health stream only for a driver whose
    registration lists the health service among its supported versions (it picks
    ``v1.DRAResourceHealth`` over ``v1alpha1.DRAResourceHealth``); one without it never hears of
    an unhealthy GPU. The DRA plugin services stay listed, newest first."""
    import grpc

    from gpumanager.api import pluginregistration_v1_pb2 as reg_pb
    from gpumanager.api import pluginregistration_v1_pb2_grpc as reg_grpc

    sock = dra_node.cluster.registry_dir / f"{DRIVER}-reg.sock"
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=30)
    versions = list(info.supported_versions)
    assert "v1.DRAResourceHealth" in versions, versions
    assert "v1alpha1.DRAResourceHealth" in versions, versions
    plugin = [v for v in versions if v.endswith(".DRAPlugin")]
    assert plugin == ["v1.DRAPlugin", "v1beta1.DRAPlugin"], versions


def test_health_stream_is_served_under_the_alpha_name_too(dra_node: DRAClient) -> None:
    """Kubelets with the alpha health API (1.34, 1.35) call ``v1alpha1.DRAResourceHealth``; its
    messages are the v1 ones field for field, so the same stream is served under that name."""
    import grpc

    from gpumanager.api import drahealth_v1_pb2 as health_pb

    sock = dra_node.cluster.plugin_dir / "dra.sock"
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        call = channel.unary_stream(
            "/v1alpha1.DRAResourceHealth/NodeWatchResources",
            request_serializer=health_pb.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=health_pb.NodeWatchResourcesResponse.FromString,
        )(health_pb.NodeWatchResourcesRequest(), timeout=30)
        first = next(iter(call))
        call.cancel()
    assert [(d.device.pool_name, d.device.device_name, d.health) for d in first.devices] == [
        (NODE, "gpu-0", health_pb.HEALTHY)
    ]


# -- claims a container uses through an extended resource (KEP-5004) ---------------------------------


def _ext_status(claim: str, container: str = "main") -> JSON:
    return {
        "resourceClaimName": claim,
        "requestMappings": [
            {"containerName": container, "resourceName": f"{DRIVER}/gpu", "requestName": "container-0-request-0"}
        ],
    }


def test_claim_of_an_extended_resource_counts_as_used_by_its_container() -> None:
    """Where a DeviceClass of the driver names an extended resource, the scheduler makes the pod's
    claim itself and records it in ``status.extendedResourceClaimStatus``: the containers named in
    its request mappings use it, without listing it in ``resources.claims``."""
    pod: JSON = {
        "metadata": {"name": "p", "namespace": "default", "uid": "u-1"},
        "spec": {"containers": [{"name": "main"}, {"name": "other"}]},
        "status": {"phase": "Running", "extendedResourceClaimStatus": _ext_status("p-extended-resources-x")},
    }
    assert consumers.containers_using(pod, "p-extended-resources-x") == ["main"]
    assert consumers.containers_using(pod, "unrelated") == []


def test_share_and_an_extended_resource_claim_in_one_container_are_refused(dra_node: DRAClient) -> None:
    """A container with a share claim and a whole GPU of the driver through an extended resource
    gets both claims' CDI edits: the share would go unenforced, so the share claim is refused."""
    manifest: JSON = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "ext-pod", "namespace": "default"},
        "spec": {
            "resourceClaims": [{"name": "share", "resourceClaimName": "share-claim"}],
            "containers": [{"name": "main", "image": "cuda:12", "resources": {"claims": [{"name": "share"}]}}],
        },
    }
    pod = dra_node.cluster.create_pod(manifest)
    dra_node.cluster.core.patch_namespaced_pod_status(
        "ext-pod",
        "default",
        {"status": {"extendedResourceClaimStatus": _ext_status("ext-claim")}},
        _content_type="application/merge-patch+json",
    )
    stored = dra_node.cluster.pod("ext-pod")
    assert stored["status"].get("extendedResourceClaimStatus"), "the API server did not keep the status"
    share = _claim_with_pod(dra_node, "share-claim", [result(cores="30", memory="1Gi", share="s-1")], pod)
    whole = _claim_with_pod(dra_node, "ext-claim", [result(request="container-0-request-0")], pod)
    answers = dra_node.prepare(DRAClient.ref(share), DRAClient.ref(whole))
    error = answers[share["metadata"]["uid"]].error
    assert "main" in error and "ext-claim" in error, answers
