"""The committed gpumanager/api modules match proto/ (fails when someone edits one without the other)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto").glob("*.proto"))


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(out)], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_descriptor_matches_proto(proto: Path, regenerated: Path) -> None:
    """Compare file descriptors, which do not depend on the grpcio-tools version that wrote the code."""
    module = importlib.import_module(f"gpumanager.api.{proto.stem}_pb2")
    committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
    source = (regenerated / f"{proto.stem}_pb2.py").read_text()
    marker = "AddSerializedFile("
    start = source.index(marker) + len(marker)
    end = source.index(")\n", start)
    fresh = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(source[start:end]))
    assert fresh == committed, f"gpumanager/api/{proto.stem}_pb2.py is stale: run scripts/gen_proto.py"


@pytest.mark.parametrize("proto", PROTOS, ids=lambda p: p.name)
def test_grpc_module_serves_every_rpc(proto: Path) -> None:
    pb2 = importlib.import_module(f"gpumanager.api.{proto.stem}_pb2")
    grpc_mod = importlib.import_module(f"gpumanager.api.{proto.stem}_pb2_grpc")
    for service in pb2.DESCRIPTOR.services_by_name.values():
        servicer = getattr(grpc_mod, f"{service.name}Servicer")
        for method in service.methods:
            assert hasattr(servicer, method.name), f"{service.full_name}/{method.name} missing from the gRPC module"


def test_wire_names_are_upstreams() -> None:
    from gpumanager.api import deviceplugin_v1beta1_pb2, display_pb2, podresources_v1_pb2, vcuda_pb2

    assert deviceplugin_v1beta1_pb2.DESCRIPTOR.package == "v1beta1"
    assert set(deviceplugin_v1beta1_pb2.DESCRIPTOR.services_by_name) == {"Registration", "DevicePlugin"}
    assert podresources_v1_pb2.DESCRIPTOR.package == "v1"
    assert vcuda_pb2.DESCRIPTOR.services_by_name["VCUDAService"].full_name == "vcuda.VCUDAService"
    assert display_pb2.DESCRIPTOR.services_by_name["GPUDisplay"].full_name == "display.GPUDisplay"
    dev = deviceplugin_v1beta1_pb2.ContainerAllocateResponse.DESCRIPTOR
    assert {f.name: f.number for f in dev.fields} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }


def test_dra_wire_names_are_the_kubelets() -> None:
    """Service and message names, packages and field numbers as k8s.io/kubelet's DRA protos."""
    from gpumanager.api import dra_v1_pb2, dra_v1beta1_pb2, drahealth_v1_pb2, pluginregistration_v1_pb2

    reg = pluginregistration_v1_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert reg.full_name == "pluginregistration.Registration"
    assert {m.name for m in reg.methods} == {"GetInfo", "NotifyRegistrationStatus"}
    info = pluginregistration_v1_pb2.PluginInfo.DESCRIPTOR
    assert {f.name: f.number for f in info.fields} == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    status = pluginregistration_v1_pb2.RegistrationStatus.DESCRIPTOR
    assert {f.name: f.number for f in status.fields} == {"plugin_registered": 1, "error": 2}

    for module, version in ((dra_v1_pb2, "v1"), (dra_v1beta1_pb2, "v1beta1")):
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert service.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.DRAPlugin"
        assert {m.name for m in service.methods} == {"NodePrepareResources", "NodeUnprepareResources"}
        claim = module.Claim.DESCRIPTOR
        assert {f.name: f.number for f in claim.fields} == {"namespace": 1, "uid": 2, "name": 3}
        assert {f.name: f.number for f in module.NodePrepareResourceResponse.DESCRIPTOR.fields} == {
            "devices": 1,
            "error": 2,
        }
        assert {f.name: f.number for f in module.NodeUnprepareResourceResponse.DESCRIPTOR.fields} == {"error": 1}
    device_fields = {f.name: f.number for f in dra_v1_pb2.Device.DESCRIPTOR.fields}
    assert device_fields == {"request_names": 1, "pool_name": 2, "device_name": 3, "cdi_device_ids": 4, "share_id": 5}
    assert dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence

    health = drahealth_v1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert health.full_name == "v1.DRAResourceHealth"
    method = health.methods_by_name["NodeWatchResources"]
    assert method.server_streaming and not method.client_streaming
    dh = drahealth_v1_pb2.DeviceHealth.DESCRIPTOR
    assert {f.name: f.number for f in dh.fields} == {
        "device": 1,
        "health": 2,
        "last_updated_time": 3,
        "health_check_timeout_seconds": 4,
        "message": 5,
    }
    assert dict(drahealth_v1_pb2.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
