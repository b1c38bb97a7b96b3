"""Battery: resource quantities as a real API server answers them.

The API server stores every ``resource.Quantity`` and answers it in canonical form: a pod that
asks for ``tencent.com/vcuda-core: 1000`` (ten whole GPUs) reads back ``1k``, a node with ten
GPUs has a capacity of ``1k`` cores. The agent and the extender must read the value, not the text.
"""

from __future__ import annotations

from pathlib import Path

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.extender.nodes import node_gpus
from simnode.apiserver import ApiServerSimulator
from simnode.cluster import SimCluster, gpu_pod
from tests.battery_fixtures import answered, gpu, write_spec


def test_simulated_api_server_answers_pod_quantities_in_canonical_form() -> None:
    with ApiServerSimulator() as api:
        created = api.create_pod(gpu_pod("ten", [("main", 1000, 2048)]))
        pod = api.get_pod("default", "ten")
    assert pod is not None and created is not None
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {names.VCORE_RESOURCE: "1k", names.VMEMORY_RESOURCE: "2048"}


def test_canonical_quantities_are_read_by_value() -> None:
    pod = gpu_pod("p", [("main", 100, 0)])
    pod["metadata"]["uid"] = "u"
    pod["spec"]["containers"][0]["resources"]["limits"] = {names.VCORE_RESOURCE: "1k", names.VMEMORY_RESOURCE: "1Ki"}
    (request,) = podinfo.gpu_requests(pod)
    assert (request.cores, request.memory_blocks) == (1000, 1024)


def test_fractional_quantity_is_refused_naming_pod_and_value() -> None:
    pod = gpu_pod("frac", [("main", 100, 0)])
    pod["spec"]["containers"][0]["resources"]["limits"] = {names.VCORE_RESOURCE: "500m"}
    try:
        podinfo.gpu_requests(pod)
    except podinfo.PodSpecError as exc:
        assert "default/frac" in str(exc) and "500m" in str(exc)
    else:
        raise AssertionError("a fractional vcuda-core was accepted")


def test_extender_reads_ten_gpus_from_a_capacity_of_1k() -> None:
    node = {
        "metadata": {"name": "ten-gpus"},
        "status": {"capacity": {names.VCORE_RESOURCE: "1k", names.VMEMORY_RESOURCE: "3200"}},
    }
    found = node_gpus(node)
    assert found is not None
    assert len(found.tree.leaves) == 10


def test_pod_asking_ten_whole_gpus_is_allocated(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path / "ten.json",
        [gpu(i, name="NVIDIA L4", memory_mib=23034, numa=i // 5) for i in range(10)],
        lambda i, j: "NODE" if i // 5 == j // 5 else "SYS",
    )
    with SimCluster(tmp_path / "node", spec) as cluster:
        run = cluster.run_pod(gpu_pod("ten", [("main", 1000, 0)]))
        minors, cores, _ = answered(run)["main"]
        assert sorted(minors) == list(range(10)) and cores == 1000


def test_plain_and_odd_spellings_read_as_the_api_server_means_them() -> None:
    from kubernetes.utils.quantity import parse_quantity

    for text in ("0", "3", "007", "100", "1000", "1k", "2Ki", "1e3", "+5"):
        pod = gpu_pod("p", [("main", 100, 0)])
        pod["spec"]["containers"][0]["resources"]["limits"] = {names.VCORE_RESOURCE: text}
        (request,) = podinfo.gpu_requests(pod) or [None]
        assert request is not None and request.cores == int(parse_quantity(text)), text
    pod = gpu_pod("odd", [("main", 100, 0)])
    pod["spec"]["containers"][0]["resources"]["limits"] = {names.VCORE_RESOURCE: "\u00b3"}  # a superscript three
    try:
        podinfo.gpu_requests(pod)
    except podinfo.PodSpecError as exc:
        assert "default/odd" in str(exc)
    else:
        raise AssertionError("a superscript digit was read as a quantity")
