"""Follow-ups: the wait for room on a smaller replacement GPU counts from the first refusal across agent
restarts; per-container usage follows a restarted container's new cgroup before its status names it; the
locks on --virtual-manager-path and --dra-plugin-path follow a directory removed and made again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpumanager.allocation.records import ContainerAllocation
from gpumanager.device.types import GPUInfo
from gpumanager.deviceplugin.replaced import ReplacedGPUs, ReplacedRefusal
from tests.test_vmanager_restart_review12 import LAYOUTS, SANDBOX, UID, Layout, Node, cid

MIB = 1 << 20
OLD = GPUInfo(0, "GPU-old", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
NEW = GPUInfo(0, "GPU-new", "Tesla T4", 0, 8192 * MIB, "00000000:10:00.0", 0)  # the same device node


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _held(*pods: str) -> list[ContainerAllocation]:
    return [
        ContainerAllocation(pod, "c", (0,), 40, 6144 * MIB, namespace="default", pod_name=pod, started=True)
        for pod in pods
    ]


def _waiting_guard(state: Path, clock: Clock, held: list[ContainerAllocation], was: GPUInfo) -> ReplacedGPUs:
    guard = ReplacedGPUs({0: was}, [NEW], [], lambda: held, state_path=state, clock=clock, wait_limit=300)
    guard.note_held(held)
    return guard


def test_the_wait_for_room_on_a_replacement_goes_on_across_agent_restarts(tmp_path: Path) -> None:
    state = tmp_path / "gpumanager_replaced_gpus"
    held = _held("a", "b")
    clock = Clock()
    first = _waiting_guard(state, clock, held, OLD)
    assert first.check(held[0])
    first.note_started(held[0])  # a runs on the 8 GiB replacement: 6 GiB of it
    with pytest.raises(ReplacedRefusal) as waits:
        first.check(held[1])
    assert not waits.value.lasting
    saved = json.loads(state.read_text())
    assert saved["waiting"] == [["b", "c", clock.now]], saved
    clock.now += 200
    again = _waiting_guard(state, clock, held, NEW)  # the agent restarted (its inventory saved with NEW)
    with pytest.raises(ReplacedRefusal) as still:
        again.check(held[1])
    assert not still.value.lasting
    clock.now += 101  # 301 s since the first refusal, 101 s since the restart
    with pytest.raises(ReplacedRefusal) as refused:
        again.check(held[1])
    assert refused.value.lasting and "waited 5m1s" in str(refused.value), str(refused.value)


def test_a_start_that_found_room_forgets_its_wait_and_old_files_read_as_before(tmp_path: Path) -> None:
    state = tmp_path / "gpumanager_replaced_gpus"
    held = _held("a", "b")
    clock = Clock()
    first = _waiting_guard(state, clock, held, OLD)
    assert first.check(held[0])
    first.note_started(held[0])
    with pytest.raises(ReplacedRefusal):
        first.check(held[1])
    del held[0]  # a's pod ended: room for b
    assert first.check(held[0])
    first.note_started(held[0])
    assert json.loads(state.read_text())["waiting"] == []
    # A file written before the field existed: the wait starts at this start's first refusal.
    held = _held("a", "b")
    doc = json.loads(state.read_text())
    del doc["waiting"]
    doc["started"] = [["a", "c"]]
    doc["containers"] = [["a", "c"], ["b", "c"]]
    doc["answered"] = [["a", "c", [0]], ["b", "c", [0]]]
    state.write_text(json.dumps(doc))
    clock.now += 1000
    old = _waiting_guard(state, clock, held, NEW)
    with pytest.raises(ReplacedRefusal) as waits:
        old.check(held[1])
    assert not waits.value.lasting
    # A damaged entry is named and the rest of the file kept.
    doc["waiting"] = [["b", "c", "soon"]]
    state.write_text(json.dumps(doc))
    damaged = _waiting_guard(state, clock, held, NEW)
    with pytest.raises(ReplacedRefusal) as waits:
        damaged.check(held[1])
    assert not waits.value.lasting


# -- per-container usage of a restarted container ------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_usage_of_a_restarted_container_goes_to_it_before_its_status_names_the_new_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: Layout
) -> None:
    """NVML shows the restarted container's new process on its GPU while the status still names the old
    container ID (gone): the usage is the container's, found in its new cgroup as the pids refresh finds it
    (the pod's sandbox cgroup is not taken for it); and still once the status names the new ID."""
    from gpumanager.metrics import usage

    gpu0 = GPUInfo(0, "GPU-0", "Tesla T4", 0, 16384 * MIB, "00000000:10:00.0", 0)
    n = Node(layout, tmp_path / "cgroup", tmp_path / "vm")
    n._make(SANDBOX, [n.next_pid()])
    main = n.start("main", cid("m0"))
    n.start("aux", cid("a0"))
    n.start("side", cid("s0"))
    allocs = [
        ContainerAllocation(UID, name, (0,), 30, 1 << 30, namespace="ns", pod_name="p", started=True)
        for name in ("main", "aux")
    ]
    procs: dict[int, int] = {main: 100 * MIB}
    monkeypatch.setattr(usage, "_sample_gpu", lambda index, since: usage._GPUSample(dict(procs), {}, {}))
    now = [1000.0]
    sampler = usage.UsageSampler(
        gpus=[gpu0],
        allocations=lambda: list(allocs),
        pod=lambda uid: n.pod() if uid == UID else None,
        cgroup_root=n.root,
        sample_period=1.0,
        clock=lambda: now[0],
    )

    def used() -> dict[str, tuple[int, tuple[int, ...]]]:
        return {
            u.container: (u.devices[0].used_bytes, u.devices[0].pids)
            for u in sampler.sample()
            if u.devices[0].used_bytes
        }

    assert used() == {"main": (100 * MIB, (main,))}
    new = n.restart("main", cid("m1"))
    procs.clear()
    procs[new] = 200 * MIB
    now[0] += 1
    assert used() == {"main": (200 * MIB, (new,))}
    n.publish()
    now[0] += 1
    assert used() == {"main": (200 * MIB, (new,))}
