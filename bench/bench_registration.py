"""Registration, health and footprint benchmark of the agent on simulated GPU nodes.

For each node spec (8 x H100 and 16 x H200 by default) it prints, median and p99:

  (a) process start -> both resources registered with a full ListAndWatch   (target < 200 ms)
  (b) Register -> first full ListAndWatch                                    (per registration)
  (c) kubelet restart -> both resources registered again                     (target p99 < 20 ms)
  (d) XID 79 injected -> its GPU's devices Unhealthy in ListAndWatch          (target < 5 ms)
  (e) steady RSS with no pods (VmRSS)                                         (target < 64 MiB)
  (f) idle CPU over a quiet interval, percent of one core                     (target < 0.3 %)

    python bench/bench_registration.py [--starts 10] [--restarts 20] [--xids 20] [--idle 20]
                                       [--spec deploy/sim/h200-x16.json ...] [--before REF]

With ``--before REF`` the agent of git revision REF is measured too, side by side: the starts
alternate between the two, then each runs the rest in turn. Each block carries the load average.
With ``--before-python PATH`` that agent (or this checkout's, without ``--before``) runs on another
interpreter (one with the agent's dependencies, e.g. another venv's python).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from figures import Variant, add_before_arguments, figure, load, prompt_threads, spec_arg, variants

from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.gpusim_state import GpuSimState
from simnode.kubelet import KubeletSimulator, RegistrationRecord

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)
TICKS = os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    """Current resident set size of a process, KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("VmRSS missing")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@contextlib.contextmanager
def no_harness_gc() -> Iterator[None]:
    """This process's garbage collector held off while it measures: the kubelet simulator runs here, and a
    full collection (10-70 ms once it holds a few hundred thousand objects: every device list it was sent)
    stopped its streams' readers inside some registrations' figures, which a Go kubelet's collector does
    not do. What the measurements leave is collected after."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def measure_starts(spec: Path, workdir: Path, starts: int, agents: list[Variant]) -> dict[str, list[float]]:
    """Process spawn -> the kubelet has a full ListAndWatch of both resources; the agents take turns."""
    kubelet = KubeletSimulator(workdir / "device-plugins", fill="sorted")
    kubelet.start()
    out: dict[str, list[float]] = {v.label: [] for v in agents}
    try:
        for i in range(starts):
            for j, variant in enumerate(agents if i % 2 == 0 else agents[::-1]):
                before = {r: kubelet.registration_count(r) for r in RESOURCES}
                agent = AgentProcess(
                    workdir,
                    spec,
                    extra_args=[f"--checkpoint-path={workdir / f'cp{i}-{j}'}"],
                    env=variant.env,
                    python=variant.python,
                )
                with no_harness_gc():
                    spawned = time.monotonic()
                    agent.start()
                    done = 0.0
                    for r in RESOURCES:
                        rec = kubelet.wait_for_registration(r, after=before[r], timeout=60, with_devices=True)
                        assert rec.first_list_and_watch_at is not None
                        done = max(done, rec.first_list_and_watch_at)
                out[variant.label].append(done - spawned)
                agent.stop()
    finally:
        kubelet.stop()
    return out


@dataclass
class Running:
    """What one agent showed while running: per-registration, restart and XID latencies, RSS, idle CPU."""

    devices: dict[str, int] = field(default_factory=dict)
    first_list: list[float] = field(default_factory=list)
    reregister: list[float] = field(default_factory=list)
    xid: list[float] = field(default_factory=list)
    rss_kib: int = 0
    idle_pct: float = 0.0
    idle_fast_pct: float = 0.0
    exit_code: int | None = None
    load: str = ""


def start_agent(
    kubelet: KubeletSimulator, spec: Path, workdir: Path, variant: Variant, flags: list[str]
) -> tuple[AgentProcess, dict[str, int]]:
    """An agent, once registered and done starting (the API side too); the devices it advertises."""
    agent = AgentProcess(workdir, spec, extra_args=flags, env=variant.env, python=variant.python).start()
    for resource in RESOURCES:
        kubelet.wait_for_registration(resource, timeout=60, with_devices=True)
    agent.wait_for_log("watching XID events", timeout=30)
    agent.wait_for_log("devices in ", timeout=30)
    return agent, {r: len(kubelet.devices(r)) for r in RESOURCES}


def idle(agent: AgentProcess, seconds: float) -> tuple[int, float]:
    """(VmRSS KiB, percent of a core) of an agent left alone, after start-up work has settled."""
    time.sleep(2.0)
    rss = rss_kib(agent.pid)
    cpu0, t0 = cpu_seconds(agent.pid), time.monotonic()
    time.sleep(seconds)
    return rss, 100.0 * (cpu_seconds(agent.pid) - cpu0) / (time.monotonic() - t0)


def registered_again(kubelet: KubeletSimulator, resource: str, before: int) -> RegistrationRecord:
    """The latest registration of ``resource`` after the first ``before`` ones, once the kubelet has its
    first ListAndWatch. After a kubelet restart the agent may register twice (the kubelet's clean-up
    removed the socket it had just served again): the earlier one never gets a ListAndWatch."""
    kubelet.wait_for_registration(resource, after=before, timeout=30)
    return kubelet.wait_for_registration(resource, timeout=30, with_devices=True)


def measure_running(spec: Path, args: argparse.Namespace, workdir: Path, variant: Variant) -> Running:
    """Idle RSS and CPU of an agent with its default flags; then, with a fast health probe and a short
    quiet period (so each XID's GPU comes back quickly), kubelet restarts and XIDs."""
    got = Running(load=load())
    kubelet = KubeletSimulator(workdir / "default" / "device-plugins", fill="sorted")
    kubelet.start()
    try:
        agent, got.devices = start_agent(kubelet, spec, workdir / "default", variant, [])
        try:
            got.rss_kib, got.idle_pct = idle(agent, args.idle)
        finally:
            agent.stop()
    finally:
        kubelet.stop()
    kubelet = KubeletSimulator(workdir / "fast" / "device-plugins", fill="sorted")
    kubelet.start()
    fast = ["--health-quiet-period=300ms", "--health-probe-period=100ms"]
    try:
        with no_harness_gc():  # its first registration is one of (b)'s
            agent, _ = start_agent(kubelet, spec, workdir / "fast", variant, fast)
    except BaseException:
        kubelet.stop()
        raise
    try:
        _, got.idle_fast_pct = idle(agent, args.idle)
        for _ in range(args.restarts):
            before = {r: kubelet.registration_count(r) for r in RESOURCES}
            with no_harness_gc():
                created = kubelet.restart()
                done = 0.0
                for resource in RESOURCES:
                    record = registered_again(kubelet, resource, before[resource])
                    done = max(done, record.registered_at)
            got.reregister.append(done - created)
            time.sleep(0.2)
        total = got.devices[names.VCORE_RESOURCE]
        with GpuSimState(agent.state) as state:
            for i in range(args.xids):
                gpu = i % (total // 100)
                kubelet.wait_for_devices(names.VCORE_RESOURCE, total, timeout=30)
                updates = len(kubelet.updates(names.VCORE_RESOURCE))
                with no_harness_gc():
                    injected = time.monotonic()
                    state.queue_xid(gpu, 79)
                    kubelet.wait_for_devices(names.VCORE_RESOURCE, total - 100, timeout=30)
                seen = [u for u in kubelet.updates(names.VCORE_RESOURCE)[updates:] if u.kind == "list_and_watch"]
                got.xid.append(seen[0].at - injected if seen else float("nan"))
        for record in kubelet.registrations:
            if record.first_list_and_watch_at is not None:
                got.first_list.append(record.first_list_and_watch_at - record.registered_at)
    finally:
        got.exit_code = agent.stop()
        kubelet.stop()
    return got


def run(spec: Path, args: argparse.Namespace, workdir: Path, agents: list[Variant]) -> None:
    print(f"== node spec {spec.name}; {load()}", flush=True)
    starts = measure_starts(spec, workdir / "starts", args.starts, agents)
    print(f"   starts measured; {load()}", flush=True)
    running = {}
    for i, variant in enumerate(agents):
        running[variant.label] = measure_running(spec, args, workdir / f"run{i}", variant)
    width = max(len(v.label) for v in agents)

    def each(title: str, pick: Callable[[Variant], str]) -> None:
        print(title)
        for v in agents:
            print(f"    {v.label:{width}s} {pick(v)}")

    first = running[agents[-1].label]
    print(f"devices advertised: {first.devices}")
    each(
        "(a) process start -> both registered, full ListAndWatch",
        lambda v: figure("", starts[v.label], target_ms=200, stat="median"),
    )
    each(
        "(b) Register -> first full ListAndWatch",
        lambda v: figure("", running[v.label].first_list, target_ms=100, stat="median"),
    )
    each("(c) kubelet restart -> both re-registered", lambda v: figure("", running[v.label].reregister, target_ms=20))
    each("(d) XID -> Unhealthy in ListAndWatch", lambda v: figure("", running[v.label].xid, target_ms=5, stat="median"))

    def rss(v: Variant) -> str:
        mib = running[v.label].rss_kib / 1024
        return f"{mib:.1f} MiB (target < 64 MiB: {'ok' if mib < 64 else 'OVER TARGET'}; {running[v.label].load})"

    def idle_cpu(v: Variant) -> str:
        pct = running[v.label].idle_pct
        return f"{pct:.3f} % of a core over {args.idle:g} s (target < 0.3 %: {'ok' if pct < 0.3 else 'OVER TARGET'})"

    each("(e) steady RSS, no pods (VmRSS), default flags", rss)
    each("(f) idle CPU, default flags (GPUs probed every second)", idle_cpu)
    each(
        "    idle CPU with --health-probe-period=100ms (as for (c) and (d))",
        lambda v: f"{running[v.label].idle_fast_pct:.3f} % of a core",
    )
    each("agent exit code", lambda v: str(running[v.label].exit_code))
    print(f"   done; {load()}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--spec",
        type=spec_arg,
        action="append",
        default=None,
        help="node spec file or name (repeatable; default h100-nvlink-x8, h200-x16)",
    )
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--xids", type=int, default=20)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle CPU measurement")
    add_before_arguments(parser)
    args = parser.parse_args()
    prompt_threads()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    specs = args.spec or [SPEC_DIR / "h100-nvlink-x8.json", SPEC_DIR / "h200-x16.json"]
    with variants(args.before, args.before_python) as agents:
        for spec in specs:
            with tempfile.TemporaryDirectory(prefix="bench-registration-") as tmp:
                run(spec, args, Path(tmp), agents)
    return 0


if __name__ == "__main__":
    sys.exit(main())
