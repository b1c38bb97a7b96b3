"""The Allocate path's prepared forms match what they stand for: the journal record made by template
(records.ContainerAllocation.to_json_text, allocator._put_text) is byte for byte the encoder's, and the
kubelet's message built in place equals the one built from the plain answer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from gpumanager.allocation import journal
from gpumanager.allocation.allocator import _put, _put_text
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.allocation.response import ContainerResponse, DeviceNode, Mount
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.deviceplugin.handlers import fill_pb, to_pb
from tests.alloc_fixtures import FakePods, core_ids, make_allocator, make_pod

UID = "8f1c7c1e-1111-2222-3333-444444444444"


def _variants() -> list[ContainerAllocation]:
    names = ["", "default", "ns-\u00fc", 'q"uote\\back', "tab\there\nline", "\U0001f600"]
    found = []
    for (ns, pod), ids, minors, (cores, memory), index, answered, started, init, mirror in itertools.product(
        [(names[1], "p-001"), (names[2], names[3]), (names[0], names[0]), (names[4], names[5])],
        [
            (),
            ("tencent.com/vcuda-core-1",),
            tuple(f"tencent.com/vcuda-core-{i}" for i in range(100, 200)),
            ("", 'q"x', "b\\y", "\x7f", "c\u00fc", "\x01", '","'),
        ],
        [(0,), (3, 1, 7)],
        [(3, 2 << 28), (100, 0), (200, (1 << 63) - 1)],
        [-1, 0, 12],
        [("", ""), (UID, "main"), ("other-uid", "side\u00e9")],
        [False, True],
        [False, True],
        ["", "0123456789abcdef0123456789abcdef"],
    ):
        found.append(
            ContainerAllocation(
                pod_uid=UID,
                container="main",
                minors=minors,
                cores=cores,
                memory=memory,
                device_ids=ids,
                namespace=ns,
                pod_name=pod,
                container_index=index,
                answered_as=answered,
                started=started,
                init=init,
                mirror=mirror,
            )
        )
    return found


def test_the_put_record_by_template_is_the_encoders_byte_for_byte() -> None:
    variants = _variants()
    assert len(variants) > 1000
    for alloc in variants:
        text = _put_text(alloc)
        assert text is not None, alloc
        assert journal._record(_put(alloc), text) == journal._record(_put(alloc)), alloc
        assert alloc.to_json_text() == json.dumps(alloc.to_json(), sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize(
    "odd",
    [
        {"cores": True},
        {"memory": 1.5},
        {"container_index": False},
        {"namespace": 5},
        {"mirror": ["x"]},
        {"device_ids": ("a", 3)},
        {"answered_as": ("uid", None)},
    ],
)
def test_a_field_of_another_type_is_left_to_the_encoder(odd: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "pod_uid": UID,
        "container": "main",
        "minors": (0,),
        "cores": 3,
        "memory": 1 << 29,
        "device_ids": ("tencent.com/vcuda-core-1",),
    }
    fields.update(odd)
    alloc = ContainerAllocation(**fields)  # type: ignore[arg-type]
    assert alloc.to_json_text() is None
    assert _put_text(alloc) is None


def test_the_kubelets_message_built_in_place_equals_the_one_built_whole() -> None:
    answer = ContainerResponse(
        envs={"LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", "NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2"},
        mounts=(Mount("/usr/local/nvidia", "/var/lib/vdriver/nvidia"), Mount("/etc/vcuda", "/var/vm/uid", False)),
        devices=(DeviceNode("/dev/nvidia0", "/dev/nvidia0"), DeviceNode("/dev/nvidiactl", "/dev/nvidiactl", "rw")),
        annotations={"tencent.com/vcuda-core": "200", "tencent.com/vcuda-memory": "0"},
    )
    whole = pb.AllocateResponse(container_responses=[to_pb(answer)])
    in_place = pb.AllocateResponse()
    fill_pb(answer, in_place.container_responses.add())
    assert in_place == whole
    assert pb.AllocateResponse.FromString(in_place.SerializeToString()) == whole


def test_a_pod_allocated_from_a_fresh_list_gets_its_compat32_answer(tmp_path: Path) -> None:
    # The kubelet asks before the pod watch has delivered the pod: the allocator finds it in a fresh
    # list of the API server. Its container's env asks for the 32-bit driver libraries all the same.
    pods = FakePods([])
    pods.refresh_fills_cache = False  # as the real cache: the watch delivers the pod later
    pods.hidden = [make_pod("a", [("main", 200, 0)], env={"compat32": "True"})]
    allocator = make_allocator(tmp_path, pods)
    fresh = allocator.allocate(core_ids(0, 100) + core_ids(1, 100))
    pods.show_hidden()
    cached = FakePods([make_pod("a", [("main", 200, 0)], env={"compat32": "True"})])
    seen = make_allocator(tmp_path / "seen", cached).allocate(core_ids(0, 100) + core_ids(1, 100))
    assert fresh.envs["LD_LIBRARY_PATH"] == seen.envs["LD_LIBRARY_PATH"]
    assert fresh == seen
