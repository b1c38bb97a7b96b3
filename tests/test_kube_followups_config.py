"""Names checked whole: a ``$``-anchored pattern also matches before a trailing newline, so
``gpu.example.com\\n`` passed as a DNS subdomain, a label key, a device path or a library name."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpumanager import names
from gpumanager.allocation import records
from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.config import Config, ConfigError, parse_node_labels
from gpumanager.kube.kubelet_checkpoint import KubeletEntry
from gpumanager.recovery import from_kubelet_checkpoint
from gpumanager.volume.blacklist import blacklist_reason
from gpumanager.volume.elffacts import ElfFacts
from gpumanager.volume.settle import driver_version_of
from gpumanager.volume.version import version_from_libcuda


@pytest.mark.parametrize("mode", ["", "dra"])
def test_a_driver_name_ending_in_a_newline_is_refused(mode: str) -> None:
    kw = {"mode": mode} if mode else {}
    with pytest.raises(ConfigError, match="--dra-driver-name"):
        Config(dra_driver_name="gpu.example.com\n", **kw).validate()  # type: ignore[arg-type]
    Config(dra_driver_name="gpu.example.com", **kw).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "labels",
    ["zone\n=a", "example.com\n/zone=a", "gaia.tencent.com/zone\n=a"],
)
def test_a_node_label_ending_in_a_newline_is_refused(labels: str) -> None:
    with pytest.raises(ConfigError, match="--node-labels"):
        parse_node_labels(labels)


def test_node_labels_without_a_newline_still_parse() -> None:
    assert parse_node_labels("example.com/zone=a,b=c-d") == {"example.com/zone": "a", "b": "c-d"}
    # Each pair is trimmed before it is checked: a newline ending a pair is no part of its value.
    assert parse_node_labels("zone=a\n") == {"zone": "a"}


def test_a_device_path_ending_in_a_newline_is_no_nvidia_device() -> None:
    with pytest.raises(records.RecordError, match="is not /dev/nvidia"):
        records._minor("/dev/nvidia0\n", "entry")
    assert records._minor("/dev/nvidia0", "entry") == 0


def test_the_kubelets_answer_naming_a_device_with_a_newline_is_not_taken() -> None:
    def entry(device: str) -> KubeletEntry:
        resp = pb.ContainerAllocateResponse(
            annotations={names.VCORE_RESOURCE: "50", names.VMEMORY_RESOURCE: "4", names.VDEVICE_ANNOTATION: device}
        )
        return KubeletEntry("uid", "c", names.VCORE_RESOURCE, ("id",), resp.SerializeToString())

    assert from_kubelet_checkpoint([entry("/dev/nvidia1\n")]) == []
    assert [a.container for a in from_kubelet_checkpoint([entry("/dev/nvidia1")])] == ["c"]


def test_library_names_ending_in_a_newline_carry_no_driver_version() -> None:
    assert version_from_libcuda("libcuda.so.550.54.15\n") is None
    assert str(version_from_libcuda("libcuda.so.550.54.15")) == "550.54.15"
    assert driver_version_of("libnvidia-ml.so.550.54.15\n") is None
    assert driver_version_of("libnvidia-ml.so.550.54.15") == "550.54.15"


def test_a_file_whose_name_ends_in_a_newline_is_no_gl_library() -> None:
    facts = ElfFacts(Path("/x"), 64, "x86_64", None, (), None, False)
    assert blacklist_reason("/usr/lib/libGL.so.1\n", facts) is None
    assert blacklist_reason("/usr/lib/libGL.so.1", facts) is not None
