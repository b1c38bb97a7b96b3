"""Our reader of kubelet_internal_checkpoint against every shape the kubelet simulator writes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
from gpumanager.kube import kubelet_checkpoint as kc
from simnode.kubelet_checkpoint import (
    CheckpointEntry,
    CheckpointV2Writer,
    write_checkpoint_v1,
    write_checkpoint_v2,
    write_checkpoint_v2_boot_id,
)

RESP = pb.ContainerAllocateResponse(annotations={"tencent.com/vcuda-device": "/dev/nvidia1"}).SerializeToString()
ENTRIES = [
    CheckpointEntry(
        "uid-a", "main", "tencent.com/vcuda-core", {0: ["tencent.com/vcuda-core-5", "tencent.com/vcuda-core-6"]}, RESP
    ),
    CheckpointEntry("uid-a", "main", "tencent.com/vcuda-memory", {-1: ["tencent.com/vcuda-memory-268435456-0"]}),
]


def test_the_simulators_writer_writes_exactly_what_the_plain_v2_writer_does(tmp_path: Path) -> None:
    fast, plain = tmp_path / "fast", tmp_path / "plain"
    writer = CheckpointV2Writer()
    registered: dict[str, list[str]] = {"tencent.com/vcuda-memory": ["m-1"], "tencent.com/vcuda-core": ["c-5", "c-6"]}
    unicode = CheckpointEntry("uid-\u00e9", 'c"1', "tencent.com/vcuda-core", {1: ["x"], -1: ["y"], 10: ["z"]}, b"\x00")
    states = [[], ENTRIES, [*ENTRIES, unicode], [unicode], []]
    for entries in states:
        for moved_on in (False, True):
            if moved_on:  # another device list: the registered devices' JSON is made again
                registered = {**registered, "tencent.com/vcuda-core": ["c-5"]}
            writer.write(fast, entries, registered)
            write_checkpoint_v2(plain, entries, registered)
            assert fast.read_bytes() == plain.read_bytes()


@pytest.mark.parametrize("writer", ["v1", "v2", "boot"])
def test_every_shape(tmp_path: Path, writer: str) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    registered = {"tencent.com/vcuda-core": ["tencent.com/vcuda-core-5"]}
    if writer == "v1":
        write_checkpoint_v1(path, ENTRIES, registered)
    elif writer == "v2":
        write_checkpoint_v2(path, ENTRIES, registered)
    else:
        write_checkpoint_v2_boot_id(path, ENTRIES, registered, "boot-1")
    entries = kc.read(path)
    assert kc.owner_of(entries, "tencent.com/vcuda-core", ["tencent.com/vcuda-core-6", "tencent.com/vcuda-core-5"]) == (
        "uid-a",
        "main",
    )
    core = next(e for e in entries if e.resource == "tencent.com/vcuda-core")
    assert (
        pb.ContainerAllocateResponse.FromString(core.alloc_resp).annotations["tencent.com/vcuda-device"]
        == "/dev/nvidia1"
    )


def test_oldest_shape_without_data_wrapper_and_null_entries(tmp_path: Path) -> None:
    path = tmp_path / "cp"
    path.write_text(
        json.dumps(
            {
                "PodDeviceEntries": [{"PodUID": "u", "ContainerName": "c", "ResourceName": "r", "DeviceIDs": ["x"]}],
                "RegisteredDevices": {},
            }
        )
    )
    assert kc.read(path)[0].device_ids == ("x",)
    path.write_text(json.dumps({"Data": {"PodDeviceEntries": None, "RegisteredDevices": None}, "Checksum": 1}))
    assert kc.read(path) == []


def test_missing_file_is_not_an_error(tmp_path: Path) -> None:
    assert kc.read(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{broken", "not JSON"),
        ("[]", "top level is a list"),
        ('{"Data": {"PodDeviceEntries": {"a": 1}}}', "PodDeviceEntries is not a list"),
        ('{"Data": {"PodDeviceEntries": [{"DeviceIDs": 5}]}}', "DeviceIDs is neither"),
        ('{"Data": {"PodDeviceEntries": [{"AllocResp": "***"}]}}', "AllocResp is not base64"),
    ],
)
def test_corrupt_files_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    path.write_text(content)
    with pytest.raises(kc.KubeletCheckpointError, match=message):
        kc.read(path)


def test_each_version_of_the_file_is_parsed_once_however_many_read_it(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    cached = kc.CheckpointFile(path)
    assert cached.entries() == [] and cached.parses == 0  # no file yet: nothing to parse
    write_checkpoint_v2(path, ENTRIES[:1], {})
    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: cached.entries(), range(32)))
    assert all(entries == seen[0] for entries in seen) and len(seen[0]) == 1
    assert cached.parses == 1
    write_checkpoint_v2(path, ENTRIES, {})  # the kubelet replaces the file: a new version
    assert len(cached.entries()) == 2 and cached.parses == 2
    assert len(cached.entries()) == 2 and cached.parses == 2
    path.write_text("{not json")
    with pytest.raises(kc.KubeletCheckpointError, match="not JSON"):
        cached.entries()
    path.unlink()
    assert cached.entries() == []


def _fifo_read_ends(path: Path, read: object) -> str:
    """What reading a FIFO in place of the checkpoint gives: the error's text (never a wait for a writer)."""
    import os
    import threading

    os.mkfifo(path)
    outcome: list[str] = []

    def attempt() -> None:
        try:
            read()  # type: ignore[operator]
            outcome.append("read")
        except kc.KubeletCheckpointError as exc:
            outcome.append(str(exc))

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the reader so the test ends
        with open(os.open(path, os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
        t.join(5)
        return "blocked"
    return outcome[0]


def test_a_fifo_in_place_of_the_checkpoint_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    message = _fifo_read_ends(path, lambda: kc.read(path))
    assert str(path) in message and "FIFO" in message, message


def test_a_fifo_in_place_of_the_watched_checkpoint_is_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    message = _fifo_read_ends(path, kc.CheckpointFile(path).entries)
    assert str(path) in message and "FIFO" in message, message


def test_a_malformed_entry_of_another_resource_leaves_ours_readable(tmp_path: Path) -> None:
    path = tmp_path / "kubelet_internal_checkpoint"
    write_checkpoint_v2(path, ENTRIES, {"tencent.com/vcuda-core": ["tencent.com/vcuda-core-5"]})
    doc = json.loads(path.read_text())
    odd = {"PodUID": "x", "ContainerName": "c", "ResourceName": "example.com/fpga", "DeviceIDs": 7, "AllocResp": "%"}
    doc["Data"]["PodDeviceEntries"].insert(0, odd)
    path.write_text(json.dumps(doc))
    got = kc.read(path)
    assert [(e.pod_uid, e.resource) for e in got] == [
        ("uid-a", "tencent.com/vcuda-core"),
        ("uid-a", "tencent.com/vcuda-memory"),
    ]
    # One of ours malformed still makes the file unusable: it cannot tell what that container holds.
    doc["Data"]["PodDeviceEntries"][0]["ResourceName"] = "tencent.com/vcuda-core"
    path.write_text(json.dumps(doc))
    with pytest.raises(kc.KubeletCheckpointError, match=r"PodDeviceEntries\[0\]"):
        kc.read(path)
