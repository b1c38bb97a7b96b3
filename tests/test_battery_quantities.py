"""Battery: resource quantities as a real API server answers them.

The API server stores every ``resource.Quantity`` and answers it in canonical form: a pod that
asks for ``tencent.com/vcuda-core: 1000`` (ten whole GPUs) reads back ``1k``, a node with ten
GPUs has a capacity of ``1k`` cores. The agent and the extender must read the value, not the text.
"""

from __future__ import annotations

from gpumanager import names
from simnode.apiserver import ApiServerSimulator
from simnode.cluster import gpu_pod


def test_simulated_api_server_answers_pod_quantities_in_canonical_form() -> None:
    with ApiServerSimulator() as api:
        created = api.create_pod(gpu_pod("ten", [("main", 1000, 2048)]))
        pod = api.get_pod("default", "ten")
    assert pod is not None and created is not None
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {names.VCORE_RESOURCE: "1k", names.VMEMORY_RESOURCE: "2048"}
