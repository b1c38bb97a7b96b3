"""The control files a kernel puts in every cgroup directory, for simulated cgroup trees.

A container's cgroup directory on a node holds dozens of files beside ``cgroup.procs``; code that
lists the directory pays for each. The simulated node makes them too, so what the agent does with a
container's cgroup costs what it costs on a node.
"""

from __future__ import annotations

from pathlib import Path

#: cgroup v2 (the unified hierarchy), a container's directory with the usual controllers enabled.
V2_FILES = [
    "cgroup.controllers",
    "cgroup.events",
    "cgroup.freeze",
    "cgroup.kill",
    "cgroup.max.depth",
    "cgroup.max.descendants",
    "cgroup.pressure",
    "cgroup.stat",
    "cgroup.subtree_control",
    "cgroup.threads",
    "cgroup.type",
    "cpu.idle",
    "cpu.max",
    "cpu.max.burst",
    "cpu.pressure",
    "cpu.stat",
    "cpu.weight",
    "cpu.weight.nice",
    "cpuset.cpus",
    "cpuset.cpus.effective",
    "cpuset.cpus.partition",
    "cpuset.mems",
    "cpuset.mems.effective",
    "hugetlb.2MB.current",
    "hugetlb.2MB.events",
    "hugetlb.2MB.max",
    "io.max",
    "io.pressure",
    "io.stat",
    "io.weight",
    "memory.current",
    "memory.events",
    "memory.events.local",
    "memory.high",
    "memory.low",
    "memory.max",
    "memory.min",
    "memory.numa_stat",
    "memory.oom.group",
    "memory.peak",
    "memory.pressure",
    "memory.reclaim",
    "memory.stat",
    "memory.swap.current",
    "memory.swap.events",
    "memory.swap.high",
    "memory.swap.max",
    "pids.current",
    "pids.events",
    "pids.max",
    "pids.peak",
    "rdma.current",
    "rdma.max",
]

#: cgroup v1, a container's directory under the memory controller.
V1_MEMORY_FILES = [
    "cgroup.clone_children",
    "cgroup.event_control",
    "memory.failcnt",
    "memory.force_empty",
    "memory.kmem.failcnt",
    "memory.kmem.limit_in_bytes",
    "memory.kmem.max_usage_in_bytes",
    "memory.kmem.slabinfo",
    "memory.kmem.tcp.failcnt",
    "memory.kmem.tcp.limit_in_bytes",
    "memory.kmem.tcp.max_usage_in_bytes",
    "memory.kmem.tcp.usage_in_bytes",
    "memory.kmem.usage_in_bytes",
    "memory.limit_in_bytes",
    "memory.max_usage_in_bytes",
    "memory.memsw.failcnt",
    "memory.memsw.limit_in_bytes",
    "memory.memsw.max_usage_in_bytes",
    "memory.memsw.usage_in_bytes",
    "memory.move_charge_at_immigrate",
    "memory.numa_stat",
    "memory.oom_control",
    "memory.pressure_level",
    "memory.soft_limit_in_bytes",
    "memory.stat",
    "memory.swappiness",
    "memory.usage_in_bytes",
    "memory.use_hierarchy",
    "notify_on_release",
    "tasks",
]


def make_cgroup(directory: Path, pids: list[int], files: tuple[str, ...] | list[str] = V2_FILES) -> None:
    """A cgroup directory holding ``files`` (empty) and ``cgroup.procs`` listing ``pids``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in files:
        (directory / name).touch()
    (directory / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in pids))
