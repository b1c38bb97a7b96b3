"""The checks of ``gpu-manager selftest``: each runs CUDA programs in child processes and returns rows.

A *container* here is what the agent gives a pod: the mirror on ``LD_LIBRARY_PATH``, a
``vcuda.config`` (written with the agent's own code) and a budget directory of its own.  Memory is
judged by what NVML accounts to the processes (their whole footprint), the SM share by kernel
throughput against an unlimited run and by NVML's per-process utilisation, sampled while the
programs run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumanager.selftest import programs
from gpumanager.vmanager.files import VcudaConfig, pack

log = logging.getLogger(__name__)

MIB = 1 << 20
LEGACY_PATH = "cuMemAlloc (CUDA 2.0 ABI)"
ALLOCATION_PATHS = (
    "cuMemAlloc",
    "cuMemAllocPitch",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemCreate + cuMemMap",
    "cuArray3DCreate",
    "cuMipmappedArrayCreate",
    "graph memory node",
    LEGACY_PATH,
)
CHILD_TIMEOUT = 120.0


@dataclass
class Row:
    """One line of the table: what was checked, what was seen, and whether it passed.  An informational
    row (a measurement with no pass condition: the cost of a call) is shown but is not a check."""

    section: str
    name: str
    result: str
    ok: bool
    informational: bool = False


@dataclass
class Setup:
    """Where the children run: the GPU, the mirror, the real driver, the work directory, the limits."""

    uuid: str
    gpu_index: int
    gpu_total: int
    work: Path
    mirror: Path
    direct: Path
    cap: int
    settle: float
    measure: float
    tolerance: float
    calls: int
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    count: int = 0

    def container(self, *, memory: int = 0, cores: int = 0) -> dict[str, str]:
        """The environment of a new container with its own config and budget."""
        self.count += 1
        name = f"selftest-{self.count}"
        directory = self.work / "vcuda" / name
        directory.mkdir(parents=True)
        config = VcudaConfig(pod_uid=f"selftest-{os.getpid()}", container_name=name, gpu_memory=memory,
                             utilization=cores, hard_limit=1)  # fmt: skip
        (directory / "vcuda.config").write_bytes(pack(config))
        env = self._env(self.mirror)
        env["VCUDA_CONFIG_PATH"] = str(directory / "vcuda.config")
        env["VCUDA_CONFIG_ROOT"] = str(directory)
        env["VCUDA_BUDGET_DIR"] = str(self.work / "shm")
        return env

    def plain(self) -> dict[str, str]:
        """The environment of a process without the interceptor."""
        return self._env(self.direct)

    def _env(self, libdir: Path) -> dict[str, str]:
        # The programs find the GPU by UUID: a CUDA_VISIBLE_DEVICES of the caller's would only hide it.
        dropped = ("LD_PRELOAD", "CUDA_VISIBLE_DEVICES")
        env = {k: v for k, v in self.base_env.items() if not k.startswith("VCUDA_") and k not in dropped}
        env["LD_LIBRARY_PATH"] = str(libdir)
        return env


class ChildError(Exception):
    """A child program failed; the message says how."""


def run_child(source: str, args: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Runs a program to its end; its last output line, parsed."""
    try:
        done = subprocess.run([sys.executable, "-c", source, json.dumps(args)], env=dict(env), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT, check=False)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        raise ChildError(f"no answer within {CHILD_TIMEOUT:.0f} s") from err
    return _last_json(done.stdout, done.returncode, done.stderr)


def read_line(proc: subprocess.Popen[str], timeout: float = 0.0) -> str:
    """The child's next output line ("" at its end); a child that says nothing for ``timeout`` seconds
    (default ``CHILD_TIMEOUT``) is killed and a ChildError raised: a hung driver call never hangs the test."""
    limit = timeout or CHILD_TIMEOUT
    stdout = proc.stdout
    assert stdout is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stdout.readline()), name="selftest-read", daemon=True)
    reader.start()
    reader.join(limit)
    if reader.is_alive() or not box:
        proc.kill()
        reader.join(5.0)
        raise ChildError(f"no answer within {limit:.0f} s")
    return box[0]


def nvml_held(uuid: str, pids: set[int]) -> int | None:
    """Device memory the real NVML accounts to these processes on the GPU (None: none of them is listed, or
    NVML cannot say how much one of them holds; ChildError: NVML failed)."""
    import pynvml

    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError as err:
        raise ChildError(f"NVML cannot list the processes of {uuid}: {err}") from err
    found = [p.usedGpuMemory for p in listed if p.pid in pids]
    if not found or any(used is None for used in found):
        return None  # not available (a container without the host's PIDs, MIG): counting it 0 would pass anything
    return sum(int(used) for used in found)


def run_held(source: str, args: dict[str, Any], env: Mapping[str, str], uuid: str) -> tuple[dict[str, Any], int | None]:
    """Runs a program that reports and then holds its memory: its report, and what NVML accounts to it then."""
    proc = subprocess.Popen([sys.executable, "-c", source, json.dumps(args)], env=dict(env), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = read_line(proc)
        held = nvml_held(uuid, {proc.pid}) if line.startswith("{") else None
    finally:
        try:
            out, err = proc.communicate(input="\n", timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired as exc:
            proc.kill()
            raise ChildError(f"no answer within {CHILD_TIMEOUT:.0f} s") from exc
    return _last_json(line + out, proc.returncode, err), held


def _last_json(stdout: str, returncode: int | None, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = stderr.strip().splitlines()[-1:] or [f"exit code {returncode}"]
        raise ChildError(tail[0][:200])
    result: dict[str, Any] = json.loads(lines[-1])
    if "error" in result:
        raise ChildError(str(result["error"]))
    return result


def mib(n: float) -> str:
    return f"{n / MIB:.0f} MiB"


# ---- memory ---------------------------------------------------------------------------------------


def allocation_paths(s: Setup) -> list[Row]:
    """Every allocation path, alone in a container, to its cap: held or escaped (by NVML's count)."""
    rows = []
    chunk = max(2 * MIB, s.cap // 16 // (2 * MIB) * (2 * MIB))
    for path in ALLOCATION_PATHS:
        args = {"uuid": s.uuid, "path": path, "chunk": chunk}
        try:
            r, held = run_held(programs.ALLOCATE, args, s.container(memory=s.cap), s.uuid)
        except ChildError as err:
            rows.append(Row("memory", path, f"error: {err}", False))
            continue
        if held is None:
            rows.append(Row("memory", path, "NVML does not tell the process's memory: cannot tell", False))
            continue
        stopped = r["rc"] == "CUDA_ERROR_OUT_OF_MEMORY"
        if path == LEGACY_PATH and held <= s.cap:
            alone = _driver_alone(s, args)
            if alone is not None:
                rows.append(Row("memory", path, alone, True, informational=True))
                continue
        if held > s.cap:
            rows.append(Row("memory", path, f"ESCAPED: {mib(held)} held on a {mib(s.cap)} cap", False))
        elif not stopped:
            rows.append(Row("memory", path, f"stopped by {r['rc']} at {mib(held)}", False))
        else:
            rows.append(Row("memory", path, f"held: {mib(held)} of {mib(s.cap)} ({r['count']} allocations)", True))
    return rows


def _driver_alone(s: Setup, args: dict[str, Any]) -> str | None:
    """Why the CUDA 2.0 ABI's path cannot show an escape on this driver, or None when it can.

    Its cuMemAlloc hands out 32-bit device addresses: a driver may refuse it in a 64-bit process (or not
    export it), or run out of addresses below 4 GiB before the cap.  What the driver does without the
    interceptor (a cap's worth of allocations at most) tells which: the interceptor cannot make it allocate.
    """
    try:
        r, held = run_held(programs.ALLOCATE, {**args, "most": s.cap // int(args["chunk"]) + 1}, s.plain(), s.uuid)
    except ChildError:
        return None  # the path's own row tells what failed
    if r["rc"] == "CUDA_SUCCESS":
        return None
    if int(r["count"]) == 0:
        return f"the driver refuses it ({r['rc']}, without the interceptor too): nothing to hold"
    if r["rc"] == "CUDA_ERROR_OUT_OF_MEMORY" and held is not None and held <= s.cap:
        return (f"the driver alone stops it at {mib(held)} ({r['count']} allocations without the interceptor: "
                "32-bit addresses), below the cap: nothing to hold")  # fmt: skip
    return None


def memory_views(s: Setup) -> list[Row]:
    """What cuMemGetInfo, cuDeviceTotalMem and NVML report inside a container holding part of its cap."""
    interceptor, driver = ((s.mirror / "libcuda.so.1").resolve(), (s.direct / "libcuda.so.1").resolve())
    args = {"uuid": s.uuid, "alloc": s.cap // 4, "libs": [str(interceptor), str(driver)]}
    try:
        r, held_now = run_held(programs.VIEWS, args, s.container(memory=s.cap), s.uuid)
    except ChildError as err:
        return [Row("views", "cuMemGetInfo, NVML", f"error: {err}", False)]
    loaded = [_loaded(interceptor, driver, r)] if "mapped" in r else []
    cap = min(s.cap, s.gpu_total)

    def judge(name: str, text: str, total: int, used_ok: bool | None) -> Row:
        # used_ok None: NVML does not tell what the process holds, and the interceptor's own answers
        # cannot check each other; only a wrong total is seen.
        if total == cap and used_ok is None:
            return Row("views", name, f"{text}; NVML does not tell the process's memory: cannot tell", False)
        return Row("views", name, text, total == cap and bool(used_ok))

    held = held_now  # what NVML accounts to the process, or None
    return [
        *loaded,
        judge("cuMemGetInfo", f"free {mib(r['free'])}, total {mib(r['total'])}", r["total"],
              None if held is None else abs(r["free"] - (cap - held)) <= 2 * MIB),
        Row("views", "cuDeviceTotalMem", mib(r["device_total"]), r["device_total"] == cap),
        judge("nvmlDeviceGetMemoryInfo", f"total {mib(r['nvml_total'])}, used {mib(r['nvml_used'])}",
              r["nvml_total"], None if held is None else abs(r["nvml_used"] - held) <= 2 * MIB),
    ]  # fmt: skip


def _loaded(interceptor: Path, driver: Path, report: Mapping[str, Any]) -> Row:
    """Whether the program had the interceptor and the real driver behind it mapped (not a pass-through)."""
    name = "interceptor in the programs"
    if interceptor == driver:
        return Row("views", name, f"{interceptor} is the driver itself", False)
    if {str(interceptor), str(driver)} <= set(report["mapped"]):
        return Row("views", name, f"{interceptor}, the driver {driver} behind it", True)
    have = ", ".join(report.get("libcuda", [])) or "none"
    return Row("views", name, f"not loaded: {interceptor} (with {driver} behind it) expected, the programs have "
               f"libcuda {have}", False)  # fmt: skip


def four_processes(s: Setup) -> list[Row]:
    """Four processes of one container, started together, each allocating to the cap: their whole footprint."""
    env = s.container(memory=s.cap)
    chunk = max(2 * MIB, s.cap // 32 // (2 * MIB) * (2 * MIB))
    procs = [subprocess.Popen([sys.executable, "-c", programs.HOLD, json.dumps({"uuid": s.uuid, "chunk": chunk})],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]  # fmt: skip
    results: list[dict[str, Any]] = []
    error = ""
    total_held: int | None = None
    try:
        for p in procs:
            if read_line(p).strip() != "ready":
                raise ChildError("a process did not start")
        for p in procs:  # every context first (all four take memory), then the allocations
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        started = []
        for p in procs:
            line = read_line(p)
            if line.strip() == "context":
                started.append(p)
            else:
                results.append(_last_json(line, p.poll(), ""))
        for p in started:
            assert p.stdin is not None
            p.stdin.write("allocate\n")
            p.stdin.flush()
        for p in started:
            results.append(_last_json(read_line(p), p.poll(), ""))
        running = {int(r["pid"]) for r in results if r.get("context") == "CUDA_SUCCESS"}
        total_held = nvml_held(s.uuid, running) if running else 0
    except (ChildError, OSError) as err:
        error = str(err)
    finally:
        for p in procs:
            if error:
                p.kill()  # in an unknown state: one of them already failed to answer
            try:
                p.communicate(input="\n", timeout=CHILD_TIMEOUT)
            except (subprocess.TimeoutExpired, ValueError):
                p.kill()
                p.communicate()
    if error:
        return [Row("footprint", "4 processes of one container", f"error: {error}", False)]
    if total_held is None:
        return [Row("footprint", "4 processes of one container", "NVML does not tell their memory: cannot tell",
                    False)]  # fmt: skip
    total = total_held
    refused = sum(r.get("context") != "CUDA_SUCCESS" for r in results)
    detail = f"{mib(total)} held together on a {mib(s.cap)} cap" + (
        f" ({refused} context(s) refused: no room)" if refused else ""
    )
    return [Row("footprint", "4 processes of one container", ("held: " if total <= s.cap else "ESCAPED: ") + detail,
                total <= s.cap)]  # fmt: skip


# ---- SM share -----------------------------------------------------------------------------------


#: How long after the GPU time it covers NVML may still add a process's sample: its sampling period (between 1/6 s
#: and 1 s depending on the product, NVIDIA's nvmlUtilization_t; 10 ms on the simulated GPU) and the time the
#: driver takes to show a sample (on real GPUs the newest sample is often 0.7 s or more behind the query).  A
#: poll that finds no sample newer than the last one says every process was idle until this long before it;
#: the launch loops stay until a poll this long after their windows.  Shorter than a real GPU's period and delay,
#: the sampler would ask from after the samples still to come, NVML would never show them, and every share read 0.
SAMPLE_LAG = 2.0

#: Other processes' SM percent over a share's window from which the GPU counts as busy with other work.
BUSY_PERCENT = 1.0

#: The longest stretch before it that one NVML sample describes, when asked from a time no sample marks (the
#: simulated GPU averages a sample over at most a second; a real one over at most its sampling period of 1 s).
SAMPLE_SPAN = 1.0


@dataclass(frozen=True)
class Span:
    """A stretch of time NVML says a process kept the GPU's SMs ``util`` percent busy (CLOCK_REALTIME us)."""

    pid: int
    start_us: int
    end_us: int
    util: int


class UtilSampler:
    """Samples NVML's per-process SM utilisation of one GPU while programs run (the real NVML)."""

    def __init__(self, gpu_index: int, *, nvml: Any = None, clock: Callable[[], float] = time.time) -> None:
        """ChildError when NVML cannot read the GPU.  ``nvml`` (pynvml's functions) and ``clock`` (CLOCK_REALTIME
        seconds) are for tests."""
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._clock = clock
        try:
            nvml.nvmlInit()
            self._handle = nvml.nvmlDeviceGetHandleByIndex(gpu_index)
        except nvml.NVMLError as err:  # the GPU lost (or NVML gone) since the self-test started
            raise ChildError(f"NVML cannot read GPU {gpu_index}: {err}") from err
        self._spans: list[Span] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._since = 0
        self._start_us = 0
        self._idle = True  # the last poll found NOT_FOUND (or none was made)

    def start(self) -> None:
        """Start sampling, in a thread polling every 0.25 s."""
        self.begin()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="selftest-nvml", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """Start sampling without the thread: from now, only :meth:`poll` and :meth:`stop` poll."""
        self._since = self._start_us = int(self._clock() * 1e6)
        self._idle = True  # nothing sampled yet: a first sample describes at most SAMPLE_SPAN
        self._spans = []
        self._thread = None

    def stop(self) -> None:
        """Stop sampling (after one last poll); :meth:`share` then reads what was sampled."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.poll(last=True)

    def share(self, pid: int, window: tuple[int, int]) -> float | None:
        """Percent of ``window`` (CLOCK_REALTIME us) that ``pid``'s kernels ran, over the part of it the
        samples cover; None when they cover none of it."""
        return share(self._spans, pid, window, (self._start_us, self._since))

    def others(self, pids: set[int], window: tuple[int, int]) -> dict[int, float]:
        """The mean SM percent over ``window`` of every sampled process not in ``pids`` that ran in it."""
        foreign = {sp.pid for sp in self._spans if sp.pid not in pids}
        found = {pid: self.share(pid, window) for pid in sorted(foreign)}
        return {pid: pct for pid, pct in found.items() if pct is not None and pct > 0}

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            self.poll()

    def poll(self, *, last: bool = False) -> None:
        """One read of NVML's samples since the last one (``last``: the last read).

        NVML has a sample only of a process that ran since ``lastSeenTimeStamp``, NOT_FOUND when none did,
        and it averages a sample over at most its own recent past (the simulated GPU: a second): so after
        NOT_FOUND every process was idle until ``SAMPLE_LAG`` before the read, and the next read asks from
        there.  (Asked from the sample before a long idle stretch, the sample after it was spread over the
        whole stretch, part of which it does not describe.)  The last read is made ``SAMPLE_LAG`` or more
        after the programs' windows: what it has no sample of was idle until then, and the time a program
        was held idle at the end of its window (a limiter after a burst) counts; otherwise the samples ended
        at the burst and the share was read over the burst alone.
        """
        asked = int(self._clock() * 1e6)
        try:
            answer = self._nvml.nvmlDeviceGetProcessUtilization(self._handle, self._since)
        except self._nvml.NVMLError as err:
            if getattr(err, "value", None) != self._nvml.NVML_ERROR_NOT_FOUND:
                return  # NVML cannot tell (the GPU lost): this time stays unsampled
            answer = []
        samples = [(s.pid, s.timeStamp, s.smUtil) for s in answer]
        # After a NOT_FOUND (an idle stretch) a sample describes at most the last SAMPLE_SPAN before it (the
        # simulated GPU averages over at most a second), not all the time since the last one.
        reach = int(SAMPLE_SPAN * 1e6) if self._idle else None
        newest = credit(self._spans, samples, self._since, reach=reach)
        self._idle = not answer
        if not answer or last:
            newest = max(newest, asked - int(SAMPLE_LAG * 1e6))
        self._since = newest


def credit(spans: list[Span], samples: Sequence[tuple[int, int, int]], since: int, *, reach: int | None = None) -> int:
    """Add NVML's process samples, (pid, timestamp in us, SM percent), taken after ``since``, to ``spans``;
    returns the newest timestamp (the samples cover the time up to it, for every process).

    Each sample covers the time from the process's previous sample in this answer (or ``since``) to its
    own: a poll that came late (a loaded machine) still counts the whole time it covers.  ``reach`` (us):
    a process's first sample covers at most that long before its timestamp (the earlier time: idle).
    """
    newest = since
    last: dict[int, int] = {}
    for pid, stamp, util in sorted(samples, key=lambda smp: smp[1]):
        start = last.get(pid, since if reach is None else max(since, stamp - reach))
        if stamp <= start:
            continue
        spans.append(Span(pid, start, stamp, min(util, 100)))
        last[pid] = stamp
        newest = max(newest, stamp)
    return newest


def share(spans: Sequence[Span], pid: int, window: tuple[int, int], covered: tuple[int, int]) -> float | None:
    """``pid``'s mean SM percent over the part of ``window`` that the samples cover (``covered``: from the
    first poll's start to the newest sample, or to where a poll that found none newer says every process
    was idle; a process absent from a sample was idle then). None when that part is empty.

    Only the program's own window counts: a sampler that ran on after the program ended (its parent
    came late on a loaded machine) would otherwise count the idle time after it as the program's.
    """
    lo, hi = max(window[0], covered[0]), min(window[1], covered[1])
    if hi <= lo:
        return None
    busy = sum(sp.util * (min(sp.end_us, hi) - max(sp.start_us, lo)) for sp in spans
               if sp.pid == pid and sp.end_us > lo and sp.start_us < hi)  # fmt: skip
    return busy / (hi - lo)


def _spin(
    s: Setup, envs: Sequence[Mapping[str, str]], sampler: UtilSampler, program: str | None = None
) -> list[tuple[float, float | None]]:
    """Runs one launch loop per environment together (``program``: ``programs.SPIN`` unless given); (launches/s,
    NVML percent or None) of each, both over the window each program measured its launches in.

    The loops stay (idle) until NVML was last read, ``SAMPLE_LAG`` after the last window's end: NVML
    has no sample of a process that has ended (its last stretch would be lost), and a sample of the end
    of a window may come that long after it.
    """
    args = json.dumps({"uuid": s.uuid, "ptx": programs.PTX, "settle": s.settle, "seconds": s.measure})
    source = programs.SPIN if program is None else program
    procs = [subprocess.Popen([sys.executable, "-c", source, args], env=dict(env), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]  # fmt: skip
    sampler.start()
    results = []
    try:
        for p in procs:
            first = read_line(p)
            if first.strip() != "running":
                p.kill()
                answer = _last_json(first, p.wait(), p.stderr.read() if p.stderr else "")
                raise ChildError(answer.get("error", "failed"))
        for p in procs:
            line = read_line(p, s.settle + s.measure + CHILD_TIMEOUT)
            while line and not line.startswith("{"):
                line = read_line(p, s.settle + s.measure + CHILD_TIMEOUT)
            if not line:  # it ended without its report: _last_json raises, with the reason from its stderr
                _last_json("", p.wait(), p.stderr.read() if p.stderr else "")
            results.append(_last_json(line, None, ""))
        lag = max(int(r["to_us"]) for r in results) / 1e6 + SAMPLE_LAG - time.time()
        if lag > 0:
            time.sleep(lag)
    finally:
        sampler.stop()
        for p in procs:
            try:
                if len(results) < len(procs):
                    p.kill()  # one failed: the others' answers are not read
                p.communicate(input="\n", timeout=CHILD_TIMEOUT)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                p.kill()
                p.wait()
    shares = [(float(r["rate"]), sampler.share(int(r["pid"]), (int(r["from_us"]), int(r["to_us"])))) for r in results]
    if any(util is not None for _, util in shares):  # NVML knows the programs by these PIDs: the others are others
        window = (min(int(r["from_us"]) for r in results), max(int(r["to_us"]) for r in results))
        busy = {pid: pct for pid, pct in sampler.others({int(r["pid"]) for r in results}, window).items()
                if pct >= BUSY_PERCENT}  # fmt: skip
        if busy:
            named = ", ".join(f"PID {pid}: {pct:.0f} %" for pid, pct in sorted(busy.items()))
            raise ChildError(
                f"the GPU ran other work during the measurement ({named} of its time), which takes the time "
                "the share is measured against; run the self-test on an idle GPU (--gpu), or leave the "
                "share section out (--only memory,views,footprint,cost)"
            )
    return shares


PAIR = (30, 70)


def judge_pair(reference: float, pair: Sequence[tuple[float, float | None]], tolerance: float) -> list[Row]:
    """The rows of two containers limited to 30 and 70 % that ran at once, from the kernels/s of a kernel that lasts
    a fixed time of its own context on the GPU (``programs.SPIN_CYCLES``): ``reference`` what two containers
    without a limit completed together, ``pair`` (kernels/s, NVML percent or None) of each limited container.

    Each container's GPU time is its share of the pair's kernels (the two ran at one clock, so the share does not
    follow the clock).  Together they must keep the GPU as busy as the two unlimited containers did (30 + 70 =
    100 %): not against one unlimited run, as two contexts lose GPU time to switching between them (an H200:
    93 % of one alone).  More than the reference is not a fault: limited contexts can switch less often.  Both
    within ``tolerance`` points.  NVML's per-process figure is shown, not judged: a real driver gives one sample
    per period for the whole GPU, naming one process, and over a few seconds that is a handful of coin flips.
    """
    together = sum(rate for rate, _ in pair)
    rows = []
    for limit, (rate, util) in zip(PAIR, pair, strict=True):
        got = 100.0 * rate / together if together > 0 else 0.0
        good = together > 0 and abs(got - limit) <= tolerance
        nvml = "no NVML sample" if util is None else f"NVML {util:.1f} %"
        text = (f"{got:.1f} % of the pair's GPU time ({rate:.0f} of {together:.0f} kernels/s; limit {limit} %); "
                f"{nvml} (not judged: a real driver samples one process per period)")  # fmt: skip
        rows.append(Row("SM share", f"two containers: the {limit} % one", text if good else f"OFF: {text}", good))
    used = 100.0 * together / reference
    good = used >= 100.0 - tolerance
    limits = " + ".join(str(limit) for limit in PAIR)
    text = (f"{used:.1f} % of the GPU time of two containers without a limit ({together:.0f} of {reference:.0f} "
            f"kernels/s; {limits} = 100 %)")  # fmt: skip
    rows.append(Row("SM share", "two containers together", text if good else f"OFF: {text}", good))
    return rows


def sm_shares(s: Setup, limits: Sequence[int]) -> list[Row]:
    """The share achieved at each limit (throughput against an unlimited run, and NVML), then 30/70 together
    (kernels of a cycle spin: shares of the pair's GPU time, and the pair's against two containers without a limit)."""
    try:
        sampler = UtilSampler(s.gpu_index)
        (base, base_util), = _spin(s, [s.container()], sampler)  # fmt: skip
    except (ChildError, OSError, ImportError) as err:
        return [Row("SM share", "unlimited run", f"error: {err}", False)]
    if base <= 0:
        return [Row("SM share", "unlimited run", "no kernel completed", False)]
    nvml = "no NVML sample in the window" if base_util is None else f"NVML {base_util:.1f} %"
    rows = [Row("SM share", "no limit", f"{base:.0f} kernels/s, {nvml}", True)]

    def judge(name: str, limit: int, rate: float, util: float | None) -> Row:
        achieved = 100.0 * rate / base
        good = abs(achieved - limit) <= s.tolerance and util is not None and abs(util - limit) <= s.tolerance
        nvml = "NVML gave no sample in the window" if util is None else f"NVML {util:.1f} %"
        text = f"throughput {achieved:.1f} %, {nvml} (limit {limit} %)"
        return Row("SM share", name, text if good else f"OFF: {text}", good)

    for limit in limits:
        try:
            (rate, util), = _spin(s, [s.container(cores=limit)], sampler)  # fmt: skip
        except ChildError as err:
            rows.append(Row("SM share", f"limit {limit} %", f"error: {err}", False))
            continue
        rows.append(judge(f"limit {limit} %", limit, rate, util))
    try:
        # A time-sliced GPU ends a preempted spin_1000us as soon as it resumes: with two containers at once,
        # only a kernel of a fixed time of its own context on the GPU counts GPU time (programs.PTX).
        reference = sum(rate for rate, _ in _spin(s, [s.container(), s.container()], sampler, programs.SPIN_CYCLES))
        if reference <= 0:
            raise ChildError("no kernel completed when two containers without a limit ran the cycle spin")
        pair = _spin(s, [s.container(cores=limit) for limit in PAIR], sampler, programs.SPIN_CYCLES)
    except ChildError as err:
        return [*rows, Row("SM share", "two containers 30/70", f"error: {err}", False)]
    return [*rows, *judge_pair(reference, pair, s.tolerance)]


# ---- cost -----------------------------------------------------------------------------------------


def call_costs(s: Setup) -> list[Row]:
    """Per-call cost through ctypes, without the interceptor and with it (memory cap and SM limit on): informational
    rows (no cost is a failure), or one failed check when the programs cannot run."""
    args = {"uuid": s.uuid, "ptx": programs.PTX, "calls": s.calls}
    try:
        plain = run_child(programs.COST, args, s.plain())
        limited = run_child(programs.COST, args, s.container(memory=s.cap, cores=99))
    except ChildError as err:
        return [Row("cost", "per call", f"error: {err}", False)]
    rows = []
    for key, label in (("passthrough", "pass-through (cuDriverGetVersion)"), ("alloc_free", "cuMemAlloc+cuMemFree"),
                       ("launch", "cuLaunchKernel")):  # fmt: skip
        extra = limited[key] - plain[key]
        rows.append(Row("cost", label, f"{plain[key]:.0f} ns without, {limited[key]:.0f} ns with ({extra:+.0f} ns)",
                        True, informational=True))  # fmt: skip
    return rows
