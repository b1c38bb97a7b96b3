"""Odd values inside our checkpoint (snapshot entries, journal records, the snapshot's JournalSegment):
each is refused with a message naming the file, the entry and the value, the rest is recovered, and no
start ends in a traceback."""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import Any

import pytest

from gpumanager.allocation.journal import CheckpointStore
from gpumanager.allocation.records import ContainerAllocation
from tests.alloc_fixtures import FakePods, make_allocator

NAME = "gpumanager_internal_checkpoint"
POD = "0b1e0c2a-0000-4000-8000-000000000001"
NEIGHBOUR = "0b1e0c2a-0000-4000-8000-000000000002"
GOOD: dict[str, Any] = {"Devices": ["/dev/nvidia0"], "Cores": 50, "Memory": 1 << 30}
MISSING = object()


def _path(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint" / NAME
    path.parent.mkdir(exist_ok=True)
    return path


def _record(change: Any) -> bytes:
    body = change if isinstance(change, bytes) else json.dumps(change).encode()
    return b"%08x %08x " % (len(body), zlib.crc32(body)) + body + b"\n"


def _object(*pairs: tuple[str, str]) -> str:
    """A JSON object from (key, JSON text) pairs, a key given twice as it is."""
    return "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in pairs) + "}"


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if r.exc_info], "a traceback in the log"


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("Devices", ["/dev/nvidia1", "/dev/nvidia1"], "more than once"),
        ("Cores", 10**30, "Cores 1000000000000000000000000000000"),
        ("Cores", 0, "Cores 0"),
        ("Cores", MISSING, "Cores is missing"),
        ("Cores", 150, "Cores 150 for 1 GPU"),
        ("Memory", 10**30, "Memory 1000000000000000000000000000000"),
        ("Memory", MISSING, "Memory is missing"),
        ("DeviceIDs", "tencent.com/vcuda-core-100", "DeviceIDs 'tencent.com/vcuda-core-100'"),
        ("DeviceIDs", [1, 2], "DeviceIDs [1, 2]"),
        ("Namespace", {"x": 1}, "Namespace {'x': 1}"),
        ("Pod", ["a"], "Pod ['a']"),
        ("Index", "2", "Index '2'"),
        ("Index", -7, "Index -7"),
        ("AnsweredAs", ["../../etc", "c"], "'../../etc'"),
        ("AnsweredAs", "x", "AnsweredAs 'x'"),
        ("AnsweredAs", [1, 2], "AnsweredAs [1, 2]"),
        ("Started", "yes", "Started 'yes'"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None,
)
def test_an_odd_field_makes_its_entry_untrusted_and_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, key: str, value: Any, shown: str
) -> None:
    entry = {**GOOD, "Devices": ["/dev/nvidia1"]}
    if value is MISSING:
        del entry[key]
    else:
        entry[key] = value
    path = _path(tmp_path)
    path.write_text(json.dumps({"PodGPUMapping": {POD: {"c": entry}, NEIGHBOUR: {"c": GOOD}}, "JournalSegment": 1}))
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        parsed = allocator.load()
        assert [a.pod_uid for a in parsed.allocations] == [NEIGHBOUR], "the odd entry taken, or its neighbour lost"
        assert parsed.untrusted == [(POD, "c")], "the odd entry is not rebuilt from the kubelet's records"
        assert len(parsed.problems) == 1
        assert f"pod {POD} container c" in parsed.problems[0] and shown in parsed.problems[0], parsed.problems
        assert parsed.salvaged.get((POD, "c"), (1,)) == (1,), "the GPU it names is what stays reserved"
    finally:
        allocator.close()
    _no_traceback(caplog)


def test_upstreams_entries_are_still_taken_as_they_are(tmp_path: Path) -> None:
    """Upstream writes only Devices, Cores and Memory: a share of one GPU, or 100 cores per whole GPU."""
    whole = {"Devices": ["/dev/nvidia2", "/dev/nvidia3"], "Cores": 200, "Memory": 0}
    _path(tmp_path).write_text(json.dumps({"PodGPUMapping": {POD: {"c": GOOD, "d": whole}}}))
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        parsed = allocator.load()
        assert parsed.problems == []
        assert sorted((a.container, a.minors, a.cores) for a in parsed.allocations) == [
            ("c", (0,), 50),
            ("d", (2, 3), 200),
        ]
    finally:
        allocator.close()


def test_a_pod_given_twice_keeps_the_containers_of_both(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other = {**GOOD, "Devices": ["/dev/nvidia1"]}
    pods = _object((POD, _object(("c", json.dumps(GOOD)))), (POD, _object(("d", json.dumps(other)))))
    _path(tmp_path).write_text(_object(("PodGPUMapping", pods)))
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        with caplog.at_level(logging.WARNING):
            parsed = allocator.load()
        assert sorted(a.container for a in parsed.allocations) == ["c", "d"], "the first copy was dropped silently"
        assert any(POD in r.getMessage() and "more than once" in r.getMessage() for r in caplog.records)
    finally:
        allocator.close()


def test_a_container_given_twice_differently_is_untrusted_naming_both_values(tmp_path: Path) -> None:
    other = {**GOOD, "Devices": ["/dev/nvidia1"]}
    containers = _object(("c", json.dumps(GOOD)), ("c", json.dumps(other)))
    _path(tmp_path).write_text(_object(("PodGPUMapping", _object((POD, containers)))))
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        parsed = allocator.load()
        assert parsed.allocations == [] and parsed.untrusted == [(POD, "c")]
        assert "/dev/nvidia0" in parsed.problems[0] and "/dev/nvidia1" in parsed.problems[0], parsed.problems
    finally:
        allocator.close()


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({"op": "putt", "pod": NEIGHBOUR, "container": "c", "entry": GOOD}, "op 'putt'"),
        ({"pod": NEIGHBOUR}, "op None"),
        ({"op": "put", "pod": None, "container": "c", "entry": GOOD}, "pod None is not a string"),
        ({"op": "del", "pod": POD, "container": ["c"]}, "container ['c'] is not a string"),
        ({"op": "put", "pod": NEIGHBOUR, "container": "c"}, "put without an entry"),
        ({"op": "claim-del", "uid": 7}, "uid 7 is not a string"),
        ({"batch": [5]}, "5 is not a change"),
        ({"batch": [{"batch": []}]}, "a batch inside a batch"),
        (b'{"batch":[' * 5000 + b"1" + b"]}" * 5000, "nested too deeply"),
        (b"[1, 2]", "a JSON list"),
    ],
    ids=[
        "unknown-op",
        "no-op",
        "pod-null",
        "container-list",
        "no-entry",
        "uid-int",
        "batch-item",
        "batch-nested",
        "deep",
        "list",
    ],
)
def test_a_whole_journal_record_of_no_known_change_is_skipped_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, record: Any, why: str
) -> None:
    path = _path(tmp_path)
    path.write_text(json.dumps({"PodGPUMapping": {POD: {"c": GOOD}}, "JournalSegment": 1}))
    segment = path.with_name(NAME + ".journal-1")
    later = {"op": "put", "pod": NEIGHBOUR, "container": "c", "entry": {**GOOD, "Devices": ["/dev/nvidia1"]}}
    odd = _record(record)
    segment.write_bytes(odd + _record(later) + b"\0" * 4096)
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        parsed = allocator.load()
        assert sorted(a.pod_uid for a in parsed.allocations) == [POD, NEIGHBOUR], "the snapshot or a later record lost"
        assert parsed.journal_damaged
        assert any(str(segment) in p and "offset 0" in p and why in p for p in parsed.problems), parsed.problems
        assert not segment.exists() and list(path.parent.glob(NAME + ".journal-1.corrupt-*")), "not set aside"
        assert path.exists(), "the snapshot was set aside for one journal record"
    finally:
        allocator.close()
    _no_traceback(caplog)


@pytest.mark.parametrize("value", ['"1"', "-1", "NaN", "true", "1e400"])
def test_a_journal_segment_key_that_is_no_number_is_named_and_its_journal_not_replayed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, value: str
) -> None:
    path = _path(tmp_path)
    pods = _object((POD, _object(("c", json.dumps(GOOD)))))
    path.write_text(_object(("PodGPUMapping", pods), ("JournalSegment", value)))
    segment = path.with_name(NAME + ".journal-1")
    segment.write_bytes(_record({"op": "del", "pod": POD, "container": "c"}) + b"\0" * 4096)
    allocator = make_allocator(tmp_path, FakePods([]))
    try:
        parsed = allocator.load()
        assert [a.pod_uid for a in parsed.allocations] == [POD]
        assert any("JournalSegment" in p and str(segment) in p for p in parsed.problems), parsed.problems
        assert not segment.exists(), "a journal no snapshot names as continuing it stays to be replayed later"
    finally:
        allocator.close()
    _no_traceback(caplog)


def test_changes_after_a_snapshot_naming_a_later_segment_survive_a_kill(tmp_path: Path) -> None:
    """The snapshot names segment 1000 (its segments were lost): new segments must not be numbered below it,
    or the next start skips them as older than the snapshot."""
    path = _path(tmp_path)
    path.write_text(json.dumps({"PodGPUMapping": {}, "JournalSegment": 1000}))
    first = make_allocator(tmp_path, FakePods([]))
    first.load()
    first.adopt([ContainerAllocation(pod_uid=POD, container="c", minors=(0,), cores=50, memory=0)], source="test")
    # Killed before its snapshot is brought up to date: no close.
    second = make_allocator(tmp_path, FakePods([]))
    try:
        second.load()
        assert second.holds((POD, "c")), "an answered allocation was lost at the restart"
    finally:
        second.close()
        first.close()


def test_a_reader_of_the_journal_sees_the_same_validated_changes(tmp_path: Path) -> None:
    path = _path(tmp_path)
    path.write_text(json.dumps({"PodGPUMapping": {}, "JournalSegment": 1}))
    path.with_name(NAME + ".journal-1").write_bytes(
        _record({"op": "put", "pod": POD, "container": "c", "entry": GOOD}) + _record({"op": "nope"}) + b"\0" * 64
    )
    loaded = CheckpointStore(path).load(quarantine=False)
    assert loaded.document is not None and list(loaded.document["PodGPUMapping"]) == [POD]
    assert loaded.replayed == 1 and len(loaded.problems) == 1
