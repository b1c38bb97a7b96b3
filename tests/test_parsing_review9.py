"""Values from outside (pod limits, node capacities, quantities) read as Kubernetes reads them.

The API server takes a quantity only in its grammar: ASCII digits, an optional sign, decimal point
and exponent, one suffix (``1k``, ``1Ki``, ``1e3``), surrounding spaces trimmed. Python's ``Decimal``
(and so the client's ``parse_quantity``) also takes ``5_000``, other scripts' digits (``١٢٣``,
fullwidth ``\uff11\uff12``) and a space before the suffix: such a value never comes from the API server, only in a
request sent straight to a component, and must be refused as the API server refuses it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpumanager import names
from gpumanager.allocation import pods as podinfo
from gpumanager.dra import quantity
from gpumanager.extender.nodes import node_gpus

#: Text the API server refuses as a quantity, though Decimal() reads a number from it.
NOT_QUANTITIES = ["5_000", "1_00", "١٢٣", "\uff11\uff12", "5 k", "1_0k"]
#: Spellings the API server takes (and answers in canonical form).
QUANTITIES = [("100", 100), (" 200 ", 200), ("+300", 300), ("1e2", 100), ("1E2", 100), ("1k", 1000), ("2.", 2)]


def _pod(limit: object) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {names.VCORE_RESOURCE: limit}}}]},
    }


@pytest.mark.parametrize("text", NOT_QUANTITIES)
def test_pod_limit_the_api_server_refuses_is_refused_naming_pod_container_and_value(text: str) -> None:
    with pytest.raises(podinfo.PodSpecError) as info:
        podinfo.gpu_requests(_pod(text))
    message = str(info.value)
    assert "ns/p" in message and "main" in message and repr(text) in message


@pytest.mark.parametrize(("text", "value"), QUANTITIES)
def test_pod_limit_in_any_spelling_the_api_server_takes_is_read_by_value(text: str, value: int) -> None:
    (request,) = podinfo.gpu_requests(_pod(text))
    assert request.cores == value


def _node(cores: object) -> dict[str, Any]:
    return {
        "metadata": {"name": "n"},
        "status": {"capacity": {names.VCORE_RESOURCE: cores, names.VMEMORY_RESOURCE: "64"}},
    }


@pytest.mark.parametrize("text", ["2_00", "٢٠٠", "\uff12\uff10\uff10", "2 k"])
def test_node_capacity_the_api_server_refuses_reads_as_no_gpus(text: str) -> None:
    assert node_gpus(_node(text)) is None


def test_node_capacity_in_canonical_form_is_read() -> None:
    found = node_gpus(_node("200"))
    assert found is not None and len(found.tree.leaves) == 2


@pytest.mark.parametrize("text", NOT_QUANTITIES)
def test_shared_quantity_parser_refuses_what_the_api_server_refuses(text: str) -> None:
    with pytest.raises(quantity.QuantityError):
        quantity.parse(text)


def test_quantity_error_shows_a_long_value_cut_short() -> None:
    text = "9" * 5000 + "x"
    with pytest.raises(quantity.QuantityError) as info:
        quantity.parse(text)
    assert len(str(info.value)) < 300 and "5001 characters" in str(info.value)


def test_stale_socket_directories_named_with_a_pid_beyond_any_pid_are_left_and_the_rest_cleaned(
    tmp_path: Path,
) -> None:
    """Anyone may create a directory in /tmp: ``gpu-manager-vcuda.<PID>.x`` with a PID larger than a
    pid_t made os.kill() raise OverflowError, so the vcuda socket server never started."""
    from gpumanager.vmanager import sockets

    prefix = sockets._PRIVATE_PREFIX
    odd = [tmp_path / f"{prefix}{2**31}.a", tmp_path / f"{prefix}{'9' * 200}.b"]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    dead = tmp_path / f"{prefix}{pid_max + 1}.c"  # no process has a PID above pid_max
    for d in [*odd, dead]:
        d.mkdir()
    sockets._remove_stale(str(tmp_path))
    assert all(d.is_dir() for d in odd) and not dead.exists()


def _flags(*argv: str) -> Any:
    from gpumanager import cli

    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    return cli.config_from_args(args, {})


@pytest.mark.parametrize(
    "argv",
    [
        "--query-port=\u0661\u0662\u0663",  # Arabic-Indic 123: int() reads it, Go's strconv.ParseInt does not
        "--v=\uff15",  # fullwidth 5
        "--v=99999999999999999999",  # beyond an int64: Go's "value out of range"
        "--log-file-max-size=-99999999999999999999",
    ],
)
def test_integer_flag_go_refuses_is_refused_naming_flag_and_value(
    argv: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _flags(argv)
    err = capsys.readouterr().err
    assert argv.split("=")[0] in err and repr(argv.split("=", 1)[1]) in err


def test_integer_flag_of_5000_digits_is_refused_with_the_value_cut_short(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _flags("--sample-period=" + "9" * 5000)
    err = capsys.readouterr().err
    assert "--sample-period" in err and "5000 characters" in err and len(err) < 600


@pytest.mark.parametrize(
    "argv",
    [
        "--wait-timeout=1e300",  # more than Go's longest duration (2^63-1 ns, about 292 years)
        "--kubelet-watch-period=9999999999s",
        "--health-probe-period=3000000h",
        "--allocation-check-period=99999999999",  # seconds: Event.wait() raised OverflowError in the check
        "--sample-period=99999999999999",
    ],
)
def test_period_longer_than_any_go_duration_is_refused_naming_the_flag(argv: str) -> None:
    from gpumanager.config import ConfigError

    try:
        _flags(argv)
    except ConfigError as exc:
        assert argv.split("=")[0] in str(exc)
    except SystemExit:
        pass  # refused by the parser, naming the flag on stderr
    else:
        raise AssertionError(f"{argv} was accepted")


def test_longest_go_duration_is_still_accepted() -> None:
    config = _flags("--wait-timeout=2562047h", "--allocation-check-period=9223372036")
    assert config.wait_timeout == 2562047 * 3600 and config.allocation_check_period == 9223372036


def _annotated(annotations: dict[str, str]) -> dict[str, Any]:
    pod = _pod("100")
    pod["metadata"]["annotations"] = annotations
    pod["metadata"]["creationTimestamp"] = "2026-01-02T03:04:05Z"
    return pod


def test_predicate_time_of_5000_digits_orders_the_pod_by_its_creation_time(caplog: pytest.LogCaptureFixture) -> None:
    """int() raised ValueError for it (not the warning and creation time of any other odd value), so the
    allocator skipped the pod as unreadable: it was never given its GPUs."""
    created = podinfo.predicate_time(_annotated({}))
    assert podinfo.predicate_time(_annotated({names.PREDICATE_TIME: "1" * 5000})) == created
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


def test_predicate_time_with_leading_zeros_reads_as_go_reads_it() -> None:
    assert podinfo.predicate_time(_annotated({names.PREDICATE_TIME: "0" * 5000 + "7"})) == 7


def test_core_limit_of_5000_digits_is_refused_naming_the_pod_and_the_value_cut_short() -> None:
    with pytest.raises(podinfo.PodSpecError) as info:
        podinfo.core_limit(_annotated({names.VCORE_LIMIT_ANNOTATION: "1" * 5000}))
    assert "ns/p" in str(info.value) and "5000 characters" in str(info.value) and len(str(info.value)) < 400


def test_go_integers_beyond_64_bits_read_as_errors_as_in_go() -> None:
    assert podinfo.go_atoi("9" * 5000) is None and podinfo.go_parse_uint("9" * 5000) is None
    assert podinfo.go_atoi("-" + "0" * 5000 + "12") == -12 and podinfo.go_parse_uint("0" * 5000 + "12") == 12
    assert podinfo.go_atoi(str(2**63)) is None and podinfo.go_parse_uint(str(2**64 - 1)) == 2**64 - 1


#: A GPU's device node with other scripts' digits: Python's \d and int() read a minor from them.
NOT_DEVICE_NODES = ["/dev/nvidia\u0661", "/dev/nvidia\uff11", "/dev/nvidia1\u0660"]


@pytest.mark.parametrize("device", NOT_DEVICE_NODES)
def test_checkpoint_entry_with_a_device_node_of_non_ascii_digits_is_untrusted(device: str) -> None:
    from gpumanager.allocation import records

    uid = "0b5e1c2a-3d4f-4a6b-8c9d-0e1f2a3b4c5d"
    entry = {"Devices": [device], "Cores": 10, "Memory": 268435456}
    parsed = records.from_json({"PodGPUMapping": {uid: {"main": entry}}})
    assert parsed.allocations == [] and parsed.untrusted == [(uid, "main")]
    assert parsed.salvaged == {} and any(repr(device) in p for p in parsed.problems)


@pytest.mark.parametrize("device", [*NOT_DEVICE_NODES, "/dev/nvidia" + "1" * 5000])
def test_kubelet_answer_naming_a_device_node_of_non_ascii_or_5000_digits_is_not_recovered(
    device: str, caplog: pytest.LogCaptureFixture
) -> None:
    from gpumanager import recovery
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
    from gpumanager.kube.kubelet_checkpoint import KubeletEntry

    resp = pb.ContainerAllocateResponse(
        annotations={names.VDEVICE_ANNOTATION: device, names.VCORE_RESOURCE: "10", names.VMEMORY_RESOURCE: "0"}
    )
    entry = KubeletEntry("uid-1", "main", names.VCORE_RESOURCE, ("a",) * 10, resp.SerializeToString())
    assert recovery.from_kubelet_checkpoint([entry]) == []
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


@pytest.mark.parametrize("cores", ["\u0661\u0660", "1_0", " 10 ", "1" * 5000])
def test_kubelet_answer_with_cores_not_written_as_ours_is_not_recovered(
    cores: str, caplog: pytest.LogCaptureFixture
) -> None:
    from gpumanager import recovery
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
    from gpumanager.kube.kubelet_checkpoint import KubeletEntry

    resp = pb.ContainerAllocateResponse(
        annotations={
            names.VDEVICE_ANNOTATION: "/dev/nvidia0",
            names.VCORE_RESOURCE: cores,
            names.VMEMORY_RESOURCE: "0",
        }
    )
    entry = KubeletEntry("uid-1", "main", names.VCORE_RESOURCE, (), resp.SerializeToString())
    assert recovery.from_kubelet_checkpoint([entry]) == []
    assert all(len(r.getMessage()) < 1000 for r in caplog.records)


def test_device_id_numbered_with_5000_digits_is_no_device_of_the_node() -> None:
    """int() raised ValueError for it: the kubelet's request failed INTERNAL with a traceback logged."""
    from gpumanager.allocation import ids
    from gpumanager.device.types import GPUInfo
    from gpumanager.deviceplugin.devices import DeviceLayout, UnknownDeviceError

    layout = DeviceLayout(
        [GPUInfo(index=0, uuid="GPU-0", name="", minor=0, memory_total=1 << 34, pci_bus_id="0000:00:01.0")]
    )
    for resource in (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE):
        odd = layout.prefix(resource) + "1" * 5000
        assert ids.number(odd) == -1
        with pytest.raises(UnknownDeviceError) as info:
            layout.gpu_of(resource, odd)
        assert len(str(info.value)) < 400


def test_gpu_inventory_annotation_with_a_5000_digit_number_is_an_inventory_error() -> None:
    """json.loads raised ValueError (not JSONDecodeError) for it, which escaped decode()."""
    from gpumanager.kube import gpu_inventory

    with pytest.raises(gpu_inventory.InventoryError) as info:
        gpu_inventory.decode('{"version": ' + "1" * 5000 + "}")
    assert len(str(info.value)) < 400


@pytest.mark.parametrize(
    "record",
    [
        '{"at": ' + "9" * 4000 + ', "gpus": []}',  # math.isfinite() raised OverflowError for it
        '{"at": 1, "gpus": [[' + "9" * 4000 + ", 1, 1]]}",
        '{"at": 1, "gpus": [[0, ' + "9" * 20 + ", 1]]}",  # beyond an int64
        '{"at": 1, "gpus": [[0, 1, ' + "9" * 20 + "]]}",
    ],
)
def test_node_claim_record_with_numbers_beyond_an_int64_is_not_read(record: str) -> None:
    from gpumanager.extender import claims

    good = '{"at": 1, "gpus": [[0, 10, 1024]]}'
    node = {"metadata": {"name": "n", "annotations": {claims.ANNOTATION: f'{{"odd": {record}, "good": {good}}}'}}}
    assert list(claims.parse_claims(node)) == ["good"]


@pytest.mark.parametrize("at", ["1" * 400, "[" * 50000, "NaN", "1e400", '"inf"'])
def test_saved_gpu_health_with_a_time_that_is_no_time_is_ignored(
    at: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An integer too large for a float raised OverflowError, JSON nested too deeply RecursionError, out
    of the health monitor's constructor (the agent did not start); NaN or infinity kept the GPU out."""
    from gpumanager.device.health import HealthMonitor
    from gpumanager.device.types import GPUInfo

    gpu = GPUInfo(index=0, uuid="GPU-0", name="", minor=0, memory_total=1 << 34, pci_bus_id="0000:00:01.0")
    saved = tmp_path / "saved.json"
    saved.write_text('{"gpus": {"GPU-0": {"reason": "xid-79", "last_xid_unix": ' + at + "}}}")
    monitor = HealthMonitor([gpu], saved=saved, quiet_period=300, ignored_xids=(), probe_period=1.0)
    assert monitor.state(0).healthy
    assert any(str(saved) in r.getMessage() for r in caplog.records)


def test_volume_config_holding_a_5000_digit_number_is_a_volume_error_naming_the_file(tmp_path: Path) -> None:
    """json.loads raised ValueError (not JSONDecodeError) for it: a traceback at the start."""
    from gpumanager.volume.config import load_volume_config
    from gpumanager.volume.errors import VolumeError

    path = tmp_path / "volume.conf"
    path.write_text('{"volume": [], "x": ' + "1" * 5000 + "}")
    with pytest.raises(VolumeError) as info:
        load_volume_config(path)
    assert str(path) in str(info.value) and len(str(info.value)) < 400


def test_volume_tree_manifest_nested_too_deeply_reads_as_an_incomplete_tree(tmp_path: Path) -> None:
    from gpumanager.volume.tree import manifest_path, read_manifest

    tree = tmp_path / "nvidia"
    manifest_path(tree).write_text("[" * 100_000 + "]" * 100_000)
    assert read_manifest(tree) is None
