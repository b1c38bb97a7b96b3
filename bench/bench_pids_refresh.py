"""pids.config refresh benchmark: what keeping every shared container's PIDs current costs each second.

The agent reads each shared container's ``cgroup.procs`` once a second and rewrites its pids.config
only when the PIDs changed. This builds the cgroup tree of ``--containers`` running containers the
way a node has it (cgroupfs: each container's directory holds the controller's 30-odd control files
beside ``cgroup.procs``), or uses a real cgroup mount (``--cgroupfs /sys/fs/cgroup/memory``: the
kernel makes the files), and times, median and p99:

  a sweep in which nothing changed (the common second)
  a sweep in which one container in ten gained a process (its pids.config rewritten)
  a sweep in which nothing changed while ``--terminating`` more pods end: their containers' cgroups are
  gone, their allocations not yet (they are asked for each second until the pods are deleted)
  a sweep in which nothing changed while ``--terminating`` of the containers wait to start again (a
  crash loop's back-off): their cgroups are gone, their pods' (with the sandbox's) are not, and their
  statuses still name the old IDs (the pod's cgroup is looked at for a new container's)

Each pod's cgroup holds its sandbox's (the pause container's) beside its container's, as on a node.

``--cpu`` times each sweep by the CPU time of its process instead of the wall clock (a machine others
use at the same time). With ``--before REF`` the same sweeps run on the code of revision REF too, on
the same tree, side by side (each variant in its own process). Each variant runs ``--rounds`` times, in
alternating order, its sweeps pooled.

    python bench/bench_pids_refresh.py [--containers 250] [--terminating 50] [--sweeps 40] [--cgroupfs DIR]
                                       [--before REF] [--cpu] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from figures import figure, load, variants

from simnode.cgroup_files import V1_MEMORY_FILES, make_cgroup

# Run in the variant's own process: its gpumanager package comes first on the path.
_SWEEPS = r"""
import json, sys, time
from pathlib import Path
from gpumanager.allocation.records import ContainerAllocation
from gpumanager.vmanager.manager import VirtualManager

spec = json.loads(sys.argv[1])
clock = time.process_time if spec["cpu"] else time.perf_counter
pods = {
    uid: {
        "metadata": {"uid": uid, "name": f"p{i}", "namespace": "default"},
        "status": {"qosClass": "Guaranteed", "containerStatuses": [{"name": "main", "containerID": f"containerd://{cid}"}]},
    }
    for i, (uid, cid) in enumerate(spec["containers"] + spec["gone"])
}
allocs = [ContainerAllocation(uid, "main", (0,), 10, 1 << 28, started=True) for uid, _ in spec["containers"]]
ending = allocs + [ContainerAllocation(uid, "main", (0,), 10, 1 << 28, started=True) for uid, _ in spec["gone"]]
vm_path = Path(spec["vm"])
for uid in pods:
    (vm_path / uid / "main").mkdir(parents=True, exist_ok=True)
vm = VirtualManager(vm_path=vm_path, cgroup_root=Path(spec["root"]), allocation=lambda u, c: None, pod=pods.get,
                    driver_version="550.54.15")
# Every directory the containers' answers read from, as the agent makes them when they start: a missing one
# would be looked for again each second.
for alloc in ending:
    for directory in vm.container_dirs(alloc) if hasattr(vm, "container_dirs") else ():
        directory.mkdir(parents=True, exist_ok=True)
vm.refresh_pids(allocs)  # the first sweep writes every file
quiet, changing = [], []
procs = [Path(p) for p in spec["procs"]]
for sweep in range(spec["sweeps"]):
    started = clock()
    vm.refresh_pids(allocs)
    quiet.append(clock() - started)
    for n, path in enumerate(procs):
        if n % 10 == sweep % 10:
            path.write_text(f"{100000 + sweep}\n" if spec["writable"] else "")
    started = clock()
    vm.refresh_pids(allocs)
    changing.append(clock() - started)
terminating = []
for sweep in range(spec["sweeps"]):
    started = clock()
    vm.refresh_pids(ending)
    terminating.append(clock() - started)
# The first containers' cgroups go (moved aside: the tree is the next variant's too), their pods' stay.
parking = Path(spec["parking"])
parking.mkdir()
waiting_dirs = [Path(p).parent for p in spec["procs"][: spec["waiting"]]]
for n, directory in enumerate(waiting_dirs):
    directory.rename(parking / str(n))
waiting = []
try:
    for sweep in range(spec["sweeps"]):
        started = clock()
        vm.refresh_pids(allocs)
        waiting.append(clock() - started)
finally:
    for n, directory in enumerate(waiting_dirs):
        (parking / str(n)).rename(directory)
print(json.dumps({"quiet": quiet, "changing": changing, "terminating": terminating, "waiting": waiting}))
"""


def build_tree(root: Path, count: int, *, cgroupfs: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """``count`` containers' cgroup directories under ``root``: (pod UID, container ID) and their cgroup.procs."""
    containers, procs = [], []
    for i in range(count):
        uid, cid = str(uuid.uuid4()), f"{i:064x}"
        directory = root / "kubepods" / f"pod{uid}" / cid
        sandbox = directory.with_name(uuid.uuid4().hex * 2)
        if cgroupfs:
            directory.mkdir(parents=True)
            sandbox.mkdir()
        else:
            make_cgroup(directory.parent, [], V1_MEMORY_FILES)
            make_cgroup(directory, [10000 + i], V1_MEMORY_FILES)
            make_cgroup(sandbox, [20000 + i], V1_MEMORY_FILES)
        containers.append((uid, cid))
        procs.append(str(directory / "cgroup.procs"))
    return containers, procs


def remove_tree(root: Path, *, cgroupfs: bool) -> None:
    if not cgroupfs:
        shutil.rmtree(root, ignore_errors=True)
        return
    # cgroup directories go with rmdir, deepest first (their control files cannot be removed).
    for dirpath, _, _ in sorted(os.walk(root), key=lambda entry: -len(Path(entry[0]).parts)):
        os.rmdir(dirpath)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--containers", type=int, default=250)
    parser.add_argument("--terminating", type=int, default=50, help="pods ending: cgroups gone, allocations not yet")
    parser.add_argument("--sweeps", type=int, default=40)
    parser.add_argument("--cgroupfs", type=Path, help="build the tree on this cgroup mount instead of plain files")
    parser.add_argument("--before", metavar="REF", help="also measure the code of git revision REF, side by side")
    parser.add_argument("--cpu", action="store_true", help="time sweeps by CPU time, not the wall clock")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, in alternating order")
    args = parser.parse_args()
    cgroupfs = args.cgroupfs is not None
    with tempfile.TemporaryDirectory(prefix="bench-pids-") as tmp:
        root = (args.cgroupfs / f"bench-pids-{os.getpid()}") if cgroupfs else Path(tmp) / "cgroup"
        try:
            containers, procs = build_tree(root, args.containers, cgroupfs=cgroupfs)
        except OSError as exc:
            print(f"cannot build the cgroup tree under {root}: {exc}", file=sys.stderr)
            return 2
        try:
            where = f"cgroupfs at {args.cgroupfs}" if cgroupfs else "plain directories holding the v1 control files"
            print(f"== {args.containers} shared containers, {where}; {load()}")
            with variants(args.before) as agents:
                results: dict[str, dict[str, list[float]]] = {v.label: {} for v in agents}
                # Each variant runs --rounds times, the order alternating: the first to run on the tree pays
                # for what the ones after it find ready (identical code read 27 and 16 ms first and second).
                for r in range(args.rounds):
                    for i, variant in enumerate(agents if r % 2 == 0 else list(reversed(agents))):
                        spec = {
                            "containers": containers,
                            "gone": [(str(uuid.uuid4()), f"{n:064x}") for n in range(args.terminating)],
                            "procs": procs,
                            "root": str(root),
                            "vm": str(Path(tmp) / f"vm-{r}-{i}"),
                            "sweeps": args.sweeps,
                            "cpu": args.cpu,
                            "waiting": min(args.terminating, args.containers),
                            "parking": str(Path(tmp) / f"parked-{r}-{i}"),
                            # cgroupfs refuses arbitrary PIDs in cgroup.procs: there, only the reads are timed.
                            "writable": not cgroupfs,
                        }
                        out = subprocess.run(
                            [variant.python, "-c", _SWEEPS, json.dumps(spec)],
                            env={**os.environ, **variant.env},
                            check=True,
                            capture_output=True,
                            text=True,
                        ).stdout
                        for key, samples in json.loads(out).items():
                            results[variant.label].setdefault(key, []).extend(samples)
                for key, title in (
                    ("quiet", "a sweep, nothing changed"),
                    ("changing", "a sweep, one container in ten gained a process"),
                    ("terminating", f"a sweep, nothing changed, {args.terminating} more pods ending (cgroups gone)"),
                    ("waiting", f"a sweep, nothing changed, {args.terminating} containers waiting to start again"),
                ):
                    print(title)
                    for label, got in results.items():
                        if key in got:
                            print(f"    {label:22s} {figure('', got[key])}")
        finally:
            remove_tree(root, cgroupfs=cgroupfs)
    print(f"   done; {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
