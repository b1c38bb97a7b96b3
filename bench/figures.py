"""Shared by the agent benchmarks: percentiles, one line per figure, the machine's load, and the agent of
another revision, or on another interpreter, to measure side by side (``--before REF``,
``--before-python PATH``).

The machine may be shared: every figure is printed with the load average when it was taken, and a
``--before`` run interleaves the two agents so that load falls on both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


#: Interpreter switch interval of a benchmark process, seconds (Python's default is 5 ms).
SWITCH_INTERVAL = 0.0005


def prompt_threads() -> None:
    """Let a simulator thread that received a message take the interpreter within 0.5 ms.

    The kubelet, API server and clients that a benchmark runs in its own process stand in for Go
    programs, whose goroutines handle each stream in parallel. Here they share one interpreter: with
    the default 5 ms switch interval, the kubelet simulator's thread that received a vcuda-core
    ListAndWatch update waited 5, 10 or 15 ms while its vcuda-memory thread parsed 2,544 devices and
    wrote the checkpoint, and that wait was counted as the agent's (XID -> Unhealthy medians of 4-10
    ms in steps of 5 ms; 3 ms with this). The agent's own interpreter is left as it is."""
    sys.setswitchinterval(SWITCH_INTERVAL)


@contextlib.contextmanager
def no_collector_pauses() -> Iterator[None]:
    """Keep this process's cyclic garbage collector from stopping the simulators mid-measurement.

    The kubelet simulator runs in the benchmark's own interpreter and stands in for a Go kubelet, whose
    collector runs beside its goroutines. Here a full collection stops every simulator thread: in a
    side-by-side run the second agent measured met a 99 ms pause of this process (its heap grown by the
    first's run) while PreStartContainer asked the kubelet's pod-resources service who starts, and that
    wait was counted as the agent's (one call of 50 at 111 ms; 16 ms for the first agent). So the heap is
    collected and frozen before, and the collector stays off for the block (the memory is freed after)."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def load() -> str:
    """The load average (1, 5, 15 minutes) and the number of CPUs."""
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def figure(name: str, seconds: list[float], *, target_ms: float | None = None, stat: str = "p99") -> str:
    """One line: n, median, p99 and max in ms, and the verdict against ``target_ms`` (on ``stat``)."""
    head = f"{name:52s} " if name else ""
    if not seconds:
        return head + "no samples"
    ms = [s * 1000 for s in seconds]
    med, p99 = statistics.median(ms), percentile(ms, 99)
    text = f"{head}n={len(ms):4d} median={med:8.2f} ms p99={p99:8.2f} ms max={max(ms):8.2f} ms"
    if target_ms is not None:
        value = p99 if stat == "p99" else med
        text += f" (target {stat} < {target_ms:g} ms: {'ok' if value < target_ms else 'OVER TARGET'})"
    return text


def dsync_write_seconds(directory: Path, count: int = 200, size: int = 512, pause: float = 0.0) -> list[float]:
    """Latency of one small ``O_DSYNC`` overwrite in ``directory`` (what one durable journal record costs),
    ``pause`` seconds after the previous one: a disk (a virtual one above all) that has been idle for a
    few milliseconds, as between two Allocate calls, can take several times longer than back to back."""
    import time

    path = directory / ".dsync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"\0" * (count * size))
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_DSYNC)
    out = []
    try:
        for i in range(count):
            started = time.perf_counter()
            os.pwrite(fd, b"x" * size, i * size)
            out.append(time.perf_counter() - started)
            if pause:
                time.sleep(pause)
    finally:
        os.close(fd)
        path.unlink()
    return out


def histogram(text: str, family: str, labels: dict[str, str]) -> list[tuple[float, float]]:
    """The cumulative buckets (upper bound, count) of one series of a Prometheus histogram in ``text``."""
    out = []
    for line in text.splitlines():
        if not line.startswith(family + "_bucket{"):
            continue
        head, _, value = line.rpartition(" ")
        pairs = dict(p.split("=", 1) for p in head[head.index("{") + 1 : head.rindex("}")].split(","))
        pairs = {k: v.strip('"') for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            out.append((float(pairs["le"]), float(value)))
    return sorted(out)


def histogram_quantile(q: float, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    """Seconds below which a fraction ``q`` of the observations between two scrapes fell, interpolated
    within the bucket as Prometheus's histogram_quantile does (an estimate, as fine as the buckets)."""
    was = dict(before)
    buckets = [(le, count - was.get(le, 0.0)) for le, count in after]
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = le, count
    return lower


def compile_bytecode(package: Path, python: str = sys.executable) -> None:
    """Byte-compile a package as ``pip install`` does for the image: an agent started from a source tree
    whose ``.pyc`` files were never written (PYTHONDONTWRITEBYTECODE, a fresh clone) compiles every
    module at each start, about 100 ms that a deployed agent does not spend."""
    subprocess.run([python, "-m", "compileall", "-q", str(package)], check=True, stdout=subprocess.DEVNULL)


def spec_arg(text: str) -> Path:
    """``--spec``: a node spec file, or the name of one in ``deploy/sim`` (``h200-x16``); an absolute
    path (the agent runs in another directory)."""
    spec_dir = REPO / "deploy" / "sim"
    for candidate in (Path(text), spec_dir / text, spec_dir / f"{text}.json"):
        if candidate.is_file():
            return candidate.resolve()
    known = ", ".join(sorted(p.stem for p in spec_dir.glob("*.json")))
    raise argparse.ArgumentTypeError(f"no node spec {text!r}: neither a file nor one of {known}")


@dataclass
class Variant:
    """One agent to measure: this checkout's, or another revision's gpumanager package (``--before``), run
    by this interpreter or another one (``--before-python``)."""

    label: str
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable


@contextlib.contextmanager
def variants(before: str | None, before_python: str | None = None) -> Iterator[list[Variant]]:
    """``[this checkout]``, or ``[before, this checkout]``: "before" is REF's ``gpumanager/`` unpacked into a
    temporary directory that the agent process imports first (PYTHONPATH), or this checkout's, run by
    ``before_python`` (an interpreter with the agent's dependencies, e.g. another venv's) or by this one.
    The simulators are this checkout's, in this interpreter."""
    compile_bytecode(REPO / "gpumanager")
    if before is None and before_python is None:
        yield [Variant("this checkout")]
        return
    python = before_python or sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-before-") as tmp:
        if before is None:
            root, what = REPO, "this checkout"
        else:
            commit = subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--short", before], check=True, capture_output=True, text=True
            ).stdout.strip()
            archive = subprocess.run(
                ["git", "-C", str(REPO), "archive", "--format=tar", commit, "gpumanager"],
                check=True,
                capture_output=True,
            ).stdout
            # tar(1): tarfile's extraction filters are missing from Python before 3.11.4.
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            root, what = Path(tmp), f"{before} = {commit}"
        compile_bytecode(root / "gpumanager", python)
        # PYTHONSAFEPATH: ``python -m`` must not put the working directory (this checkout) first.
        env = {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
        where, version = subprocess.run(
            [python, "-c", "import sys, gpumanager.app; print(gpumanager.app.__file__); print(sys.version.split()[0])"],
            env={**os.environ, **env},
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        if not where.startswith(str(root)):
            raise RuntimeError(f"the agent of {what} would not be the one imported by {python}: {where}")
        after = "after (this checkout)"
        if before_python is not None:
            what += f"; python {version} {python}"
            after = f"after (this checkout; python {sys.version.split()[0]} {sys.executable})"
        yield [Variant(f"before ({what})", env, python), Variant(after)]


def add_before_arguments(parser: argparse.ArgumentParser) -> None:
    """``--before REF`` and ``--before-python PATH`` of a benchmark's command line."""
    parser.add_argument(
        "--before", metavar="REF", default=None, help="also measure the agent of git revision REF, side by side"
    )
    parser.add_argument(
        "--before-python",
        metavar="PATH",
        default=None,
        help="run the 'before' agent (REF's, or this checkout's without --before) with this interpreter, "
        "which must have the agent's dependencies (another venv's python); the simulators stay in this one",
    )
