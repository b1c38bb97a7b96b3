"""Registration benchmark on the simulated 16 x H200 node.

Prints (a) Register -> first full ListAndWatch, (b) kubelet restart ->
re-registration of both resources, median and p99 over N restarts, and (c) the
agent's peak RSS. Targets: (a) < 100 ms, (b) < 1 s p99, (c) < 100 MiB.

    python bench/bench_registration.py [--restarts 20] [--spec deploy/sim/h200-x16.json]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpumanager import names
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.kubelet import KubeletSimulator

RESOURCES = (names.VCORE_RESOURCE, names.VMEMORY_RESOURCE)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary(name: str, values_s: list[float], target_ms: float, stat: str) -> str:
    ms = [v * 1000 for v in values_s]
    med, p99 = statistics.median(ms), percentile(ms, 99)
    verdict = "ok" if (p99 if stat == "p99" else med) < target_ms else "OVER TARGET"
    return (
        f"{name:44s} n={len(ms):3d} median={med:8.2f} ms p99={p99:8.2f} ms max={max(ms):8.2f} ms "
        f"(target {stat} < {target_ms:g} ms: {verdict})"
    )


def run(spec: Path, restarts: int, workdir: Path) -> int:
    kubelet = KubeletSimulator(workdir / "device-plugins", fill="sorted")
    kubelet.start()
    agent = AgentProcess(workdir, spec).start()
    first_list: list[float] = []
    reregister: list[float] = []
    try:
        for resource in RESOURCES:
            kubelet.wait_for_registration(resource, timeout=60, with_devices=True)
        devices = {r: len(kubelet.devices(r)) for r in RESOURCES}
        for _ in range(restarts):
            before = {r: kubelet.registration_count(r) for r in RESOURCES}
            created = kubelet.restart()
            done = 0.0
            for resource in RESOURCES:
                record = kubelet.wait_for_registration(resource, after=before[resource], timeout=30, with_devices=True)
                done = max(done, record.registered_at)
            reregister.append(done - created)
            time.sleep(0.2)
        for record in kubelet.registrations:
            if record.first_list_and_watch_at is not None:
                first_list.append(record.first_list_and_watch_at - record.registered_at)
        rss_kib = agent.peak_rss_kib()
    finally:
        code = agent.stop()
        kubelet.stop()
    print(f"node spec: {spec.name}; devices advertised: {devices}; agent exit code {code}")
    print(summary("(a) Register -> first full ListAndWatch", first_list, 100, "median"))
    print(summary("(b) kubelet restart -> both re-registered", reregister, 1000, "p99"))
    print(
        f"{'(c) agent peak RSS (VmHWM)':44s} {rss_kib / 1024:.1f} MiB (target < 100 MiB: "
        f"{'ok' if rss_kib < 100 * 1024 else 'OVER TARGET'})"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=Path, default=SPEC_DIR / "h200-x16.json")
    parser.add_argument("--restarts", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="bench-registration-") as tmp:
        return run(args.spec, args.restarts, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
