"""The vcuda-core Allocate handler alone, in this process: no gRPC, no kubelet simulator, no other process.

For each node spec (8 x H100 and 16 x H200 by default) it fills the node with --pods shared pods, one
Allocate each, through the agent's own ``Handlers.allocate_core`` (validation, matching, placement, the
journal record made durable, the answer in protobuf), each with the IDs that GetPreferredAllocation steers
to (asked just before, as the kubelet does), and prints the median and p99 of:

  the same for pods that each take one whole GPU (100 vcuda-core IDs), --whole-rounds rounds of one per GPU
      on the empty node, before the fill
  the handler, back to back: what its code costs with every cache warm
  the handler, --gap ms after the previous call, the process asleep meanwhile: what a kubelet call meets
      (on a virtual machine the same code can take several times as long after a pause: caches and branch
      predictors have served other work meanwhile)
  the durable journal write inside it (the allocator's own measure), written in --journal-dir

The pod source is a list in memory (the agent's cache answers the same questions). With ``--before REF``
the handler of git revision REF is measured too, in a process of its own, the two alternating round by round.

    python bench/bench_allocate_handler.py [--pods 200] [--rounds 3] [--gap 5] [--whole-rounds 4] [--spec ...]
                                           [--journal-dir DIR] [--before REF]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from figures import Variant, add_before_arguments, percentile, spec_arg, variants

from simnode.agent_process import SPEC_DIR

MIB = 1 << 20


class _Pods:
    """The pod source: pods in memory, each change counted as the agent's pod cache counts it."""

    def __init__(self) -> None:
        self.by_uid: dict[str, dict[str, Any]] = {}
        self.generation = 0
        self.changed_at: dict[str, int] = {}

    def put(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        self.by_uid[uid] = pod
        self.generation += 1
        self.changed_at[uid] = self.generation

    def synced(self) -> bool:
        return True

    def wait_synced(self, timeout: float) -> bool:
        return True

    def pods(self) -> list[dict[str, Any]]:
        return list(self.by_uid.values())

    def get(self, uid: str) -> dict[str, Any] | None:
        return self.by_uid.get(uid)

    def changes(self, since: int) -> tuple[int, frozenset[str] | None]:
        if since < 0:
            return self.generation, None
        return self.generation, frozenset(uid for uid, at in self.changed_at.items() if at > since)

    def find(self, namespace: str, name: str) -> dict[str, Any] | None:
        for pod in self.by_uid.values():
            if pod["metadata"]["namespace"] == namespace and pod["metadata"]["name"] == name:
                return pod
        return None

    def lookup(self, namespace: str, name: str, since: float | None = None) -> dict[str, Any] | None:
        return self.find(namespace, name)

    def refresh(self) -> list[dict[str, Any]]:
        return self.pods()

    def recent(self, within: float, since: float) -> list[dict[str, Any]] | None:
        return None


def _pod(i: int, *, whole: bool = False) -> dict[str, Any]:
    """A pending pod asking for a share (3 cores, 2 memory blocks), or for one whole GPU (100 cores)."""
    limits = (
        {"tencent.com/vcuda-core": "100"} if whole else {"tencent.com/vcuda-core": "3", "tencent.com/vcuda-memory": "2"}
    )
    return {
        "metadata": {
            "name": f"bench-{i:03d}",
            "namespace": "default",
            "uid": f"00000000-0000-4000-8000-{i:012d}",
            "annotations": {},
            "creationTimestamp": "2026-12-01T10:00:00Z",
        },
        "spec": {
            "nodeName": "sim-node",
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits, "requests": limits}}],
        },
        "status": {"phase": "Pending"},
    }


def fill(spec: Path, pods: int, gap: float, journal_dir: Path, whole_rounds: int) -> dict[str, list[float]]:
    """Seconds of each Allocate (``handler``) and of each journal write inside one (``journal``); first, on the
    empty node, ``whole_rounds`` rounds of one whole-GPU pod per GPU, all pending at once and freed after
    each round (``whole``, ``whole journal``)."""
    from gpumanager import names
    from gpumanager.allocation.allocator import Allocator, AllocatorSettings
    from gpumanager.allocation.response import ResponseSettings
    from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
    from gpumanager.device.types import GPUInfo, NodeTopology
    from gpumanager.deviceplugin.devices import DeviceLayout
    from gpumanager.deviceplugin.handlers import Handlers
    from gpumanager.deviceplugin.preferred import Preference
    from gpumanager.topology import build_tree

    node = json.loads(spec.read_text())
    gpus = [
        GPUInfo(i, g["uuid"], g["name"], g["minor"], g["memory_mib"] * MIB, g["pci_bus_id"], g.get("numa_node"))
        for i, g in enumerate(node["gpus"])
    ]
    topology = NodeTopology(
        levels=tuple(tuple(row) for row in node["topology"]), nvlink=tuple(tuple(x) for x in node.get("nvlink", []))
    )
    source = _Pods()
    with tempfile.TemporaryDirectory(dir=journal_dir, prefix="bench-journal-") as where:
        allocator = Allocator(
            gpus=gpus,
            tree=build_tree(gpus, topology),
            pods=source,
            settings=AllocatorSettings(
                share_mode=True,
                response=ResponseSettings(
                    vdriver_nvidia="/etc/gpu-manager/vdriver/nvidia",
                    vdriver_origin="/etc/gpu-manager/vdriver/origin",
                    virtual_manager_path="/etc/gpu-manager/vm",
                ),
            ),
            checkpoint_path=Path(where) / names.OWN_CHECKPOINT,
        )
        writes: list[float] = []
        inside = [False]
        allocator.observe_checkpoint_writes(
            lambda kind, s: writes.append(s) if inside[0] and kind == "journal" else None
        )
        layout = DeviceLayout(gpus)
        handlers = Handlers(allocator=allocator, layout=layout, owner=lambda *_: None, prepared=lambda _a: None)
        preference = Preference(allocator.clone_tree, layout, preview=allocator.preview)
        every = {f"{names.VCORE_ID_PREFIX}{n}" for n in range(names.HUNDRED_CORES * len(gpus))}
        took: list[float] = []
        whole: list[float] = []
        whole_writes: list[float] = []

        def allocate(pod: dict[str, Any], cores: int, free: set[str], into: list[float]) -> None:
            if gap:
                time.sleep(gap)
            chosen = preference.choose(names.VCORE_RESOURCE, sorted(free), [], cores)
            request = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)])
            inside[0] = True
            started = time.perf_counter()
            handlers.allocate_core(request)
            into.append(time.perf_counter() - started)
            inside[0] = False
            free.difference_update(chosen)
            pod["status"] = {"phase": "Running"}
            source.put(pod)
            alloc = allocator.get(pod["metadata"]["uid"], "main")
            assert alloc is not None
            allocator.mark_started(alloc)

        try:
            for r in range(whole_rounds):
                round_pods = [_pod(pods + r * len(gpus) + i, whole=True) for i in range(len(gpus))]
                for pod in round_pods:
                    source.put(pod)
                free = set(every)
                for pod in round_pods:
                    allocate(pod, names.HUNDRED_CORES, free, whole)
                for pod in round_pods:
                    pod["status"] = {"phase": "Succeeded"}
                    source.put(pod)
                    allocator.release_pod(pod["metadata"]["uid"])
            whole_writes, writes[:] = list(writes), []
            free = set(every)
            for i in range(pods):
                pod = _pod(i)
                source.put(pod)
                allocate(pod, 3, free, took)
        finally:
            allocator.close()
    return {"handler": took, "journal": writes, "whole": whole, "whole journal": whole_writes}


def _child(args: argparse.Namespace) -> int:
    out = fill(args.child_spec, args.pods, args.child_gap, args.journal_dir, args.whole_rounds)
    print(json.dumps(out))
    return 0


def _measure(variant: Variant, spec: Path, gap: float, args: argparse.Namespace) -> dict[str, list[float]]:
    command = [
        variant.python,
        str(Path(__file__).resolve()),
        "--child-spec",
        str(spec),
        "--child-gap",
        str(gap),
        "--pods",
        str(args.pods),
        "--journal-dir",
        str(args.journal_dir),
        "--whole-rounds",
        str(args.whole_rounds),
    ]
    env = {**os.environ, **variant.env}
    # The variant's gpumanager first; this checkout's simnode and bench helpers after it (PYTHONSAFEPATH
    # leaves the script's own directory out of the path).
    here = Path(__file__).resolve().parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (variant.env.get("PYTHONPATH"), str(here.parent), str(here)) if p)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{variant.label}: {' '.join(command)} failed:\n{done.stderr}")
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _merged(runs: Iterable[dict[str, list[float]]], key: str) -> list[float]:
    return [s for run in runs for s in run[key]]


def _figure(name: str, seconds: list[float]) -> str:
    """One line in microseconds (the handler alone is tens of them): n, median, p99."""
    if not seconds:
        return f"{name:50s} no samples"
    us = [s * 1e6 for s in seconds]
    return f"{name:50s} n={len(us):5d} median={statistics.median(us):7.0f} us p99={percentile(us, 99):7.0f} us"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=spec_arg, action="append", default=None, help="node spec (repeatable)")
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="fills per agent, spec and pause")
    parser.add_argument(
        "--whole-rounds", type=int, default=4, help="rounds of whole-GPU pods (one per GPU) before each fill"
    )
    parser.add_argument("--gap", type=float, default=5.0, help="milliseconds between calls for the paused figure")
    parser.add_argument(
        "--journal-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the journal is written (default: the temporary directory; /dev/shm leaves the disk out)",
    )
    parser.add_argument("--child-spec", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-gap", type=float, default=0.0, help=argparse.SUPPRESS)
    add_before_arguments(parser)
    args = parser.parse_args()
    if args.child_spec is not None:
        return _child(args)
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json", SPEC_DIR / "h200-x16.json"]
    with variants(args.before, args.before_python) as agents:
        for spec in specs:
            got: dict[tuple[str, float], list[dict[str, list[float]]]] = {}
            for r in range(args.rounds):
                for variant in agents if r % 2 == 0 else agents[::-1]:
                    for gap in (0.0, args.gap / 1000):
                        got.setdefault((variant.label, gap), []).append(_measure(variant, spec, gap, args))
            print(f"\n{spec.stem}: {args.pods} pods x {args.rounds} rounds, journal in {args.journal_dir}")
            for variant in agents:
                print(f"  {variant.label}:")
                for gap, title in ((0.0, "back to back"), (args.gap / 1000, f"{args.gap:g} ms after the last call")):
                    runs = got[(variant.label, gap)]
                    print(_figure(f"    Allocate handler, {title}:", _merged(runs, "handler")))
                    print(_figure("      of which the journal write:", _merged(runs, "journal")))
                    print(_figure(f"    Allocate of a whole GPU, {title}:", _merged(runs, "whole")))
                    print(_figure("      of which the journal write:", _merged(runs, "whole journal")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
