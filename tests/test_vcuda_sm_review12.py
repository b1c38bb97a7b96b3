"""A tenant's attempts to run more kernels than its container's SM share admits (vcuda/tests/review12_sm.c).

Each scenario runs the C program in a container-like set-up: a driver mirror whose ``libcuda.so.1`` and
``libnvidia-ml.so.1`` are the interceptor in front of the simulated driver, a ``vcuda.config`` with a 30 % SM share
and no memory limit, a budget directory of its own.  The program offers kernels of 50 ms of simulated GPU time
through one launch path for at most a second of wall time and reports how many launch calls the interceptor let
through.  The check is functional, not a share over time: at 30 % the gate admits a few hundred ms of GPU time in
that second (a handful of such kernels, however slow the machine), while a path that escapes the gate admits all
100 at once.  Every scenario also runs against the ASan/UBSan builds of the interceptor and of the simulated driver.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from simnode.gpusim_state import GpuSimState
from tests.vcuda_scenario import HOOKS_INTERCEPTOR, VCUDA, build_hooks_interceptor, build_programs, container_env

SOURCE = VCUDA / "tests" / "review12_sm.c"
SHARE = 30
# 1 s at 30 % is 300 ms of GPU time: 6 kernels of 50 ms, plus what the gate lets queue (in flight x cost) and the
# burst the credit cap allows (100 ms of the rate).  An ungated path admits all 100 offered.
MOST_ADMITTED = 30


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The scenario program, plain and under ASan/UBSan, after the interceptor and the simulated driver are built."""
    built = build_programs(tmp_path_factory.mktemp("review12-sm-bin"), SOURCE)
    built["hooks"] = built["plain"]
    return built


def _env(tmp_path: Path, variant: str) -> dict[str, str]:
    """A container with a 30 % SM share and no memory limit; ``variant`` "hooks": the -DVC_TEST_HOOKS interceptor."""
    interceptor = HOOKS_INTERCEPTOR if variant == "hooks" else None
    return container_env(tmp_path, variant, pod_uid="pod-review12", share=SHARE, interceptor=interceptor)


def _stacks(pid: int) -> str:
    """The threads' stacks of a process and its limiter's state on device 0, where gdb is installed (for a
    scenario that hangs: a launch that waits for good shows why)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no gdb: no stacks)"
    fields = ("launched", "completed", "credit", "cost", "rate", "n", "head", "marked", "unmarked", "unmarked_due",
              "ok_launched", "ok_done", "ev_count", "ev_ctx", "prov_n")  # fmt: skip
    command = [gdb, "-p", str(pid), "-batch"]
    for name in fields:
        command += ["-ex", f"echo {name}: ", "-ex", f"output 'vc_core.c'::g_dev[0].{name}", "-ex", "echo \\n"]
    command += ["-ex", "thread apply all bt 12"]
    try:
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        return "(gdb did not answer)"
    return shown.stdout[:20000] + shown.stderr[-2000:]


def _output(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str, **extra: str) -> str:
    """Runs one scenario to its end and returns what it printed.  One that runs past 120 s fails with its threads'
    stacks and the limiter's state."""
    env = {**_env(tmp_path, variant), **extra}
    with subprocess.Popen(
        [str(programs[variant]), scenario], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            stacks = _stacks(proc.pid)
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"{scenario} ({variant}): still running after 120 s\n{out}\n{err[-4000:]}\n{stacks}")
    assert proc.returncode == 0, f"{scenario} ({variant}): exit {proc.returncode}\n{out}\n{err}"
    return out + "\n" + err


def _run(programs: dict[str, Path], tmp_path: Path, variant: str, scenario: str, **extra: str) -> list[int]:
    """Runs one scenario; returns the launches admitted, one figure per report line."""
    out = _output(programs, tmp_path, variant, scenario, **extra)
    found = [int(n) for n in re.findall(r"^admitted (\d+) of", out, re.M)]
    assert found, f"{scenario} ({variant}): no report\n{out}"
    return found


SCENARIOS = [
    "kernel",
    "kernel-ptsz",
    "ex",
    "ex-ptsz",
    "coop",
    "coop-ptsz",
    "multi",
    "grid-async",
    "legacy",
    "grid",
    "graph-captured",
    "graph-built",
    "graph-ptsz",
    "library",
    "threads",
    "contexts",
    "contexts-rested",
    "context-destroyed",
    "primary-released",
    "green-destroyed",
    "stack-full",
    "taught",
    "refused-after-sync",
    "green",
    "failed-burst",
    "failed-burst-learnt",
]


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_launch_path_is_gated(programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str) -> None:
    for admitted in _run(programs, tmp_path, variant, scenario):
        assert admitted <= MOST_ADMITTED, f"{scenario} ({variant}): {admitted} kernels of 50 ms in 1 s at {SHARE} %"


@pytest.mark.parametrize("variant", ["plain", "asan"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_launch_path_is_gated_with_credit_in_hand(
    programs: dict[str, Path], tmp_path: Path, scenario: str, variant: str
) -> None:
    """The same offer after one launch through the path and half a second's rest: the limiter's credit is full
    when it starts.  Launches round-robin over four contexts then went through all at once (100 of 100): a launch
    in another context than the outstanding markers' counted complete at once, and every launch before it."""
    for admitted in _run(programs, tmp_path, variant, scenario, REVIEW12_RESTED="1"):
        assert admitted <= MOST_ADMITTED, f"{scenario} rested ({variant}): {admitted} kernels of 50 ms in 1 s"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_first_launch_stuck_in_its_log_line_lets_no_other_launch_through(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """The first limited launch logs the limit it sets up (LOGGER_LEVEL=4, the tenant's variable).  With stderr a
    full pipe nobody reads, that write blocks for good: the device was marked set up before it was marked limited,
    so every other thread's launches went through ungated for as long as the write blocked."""
    (admitted,) = _run(programs, tmp_path, variant, "stall", LOGGER_LEVEL="4")
    assert admitted <= MOST_ADMITTED, f"stall ({variant}): {admitted} kernels of 50 ms admitted in 1 s at {SHARE} %"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_kernel_that_ran_while_the_process_was_stopped_is_paid_for(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """A 2.5 s kernel, then the process is stopped for 3.5 s (SIGSTOP, SIGCONT): NVML answers for the last second
    only, so the limiter, measuring nothing meanwhile, charged 1 s of it and then admitted a share's worth of
    kernels at once (10 of 50 ms in the next second).  The time it could not measure is charged now: the container
    owes about 1.5 s and admits at most the launch that was on its way before the first measurement."""
    (admitted,) = _run(programs, tmp_path, variant, "stopped")
    assert admitted <= 2, f"stopped ({variant}): {admitted} kernels of 50 ms admitted in the second after the stop"


@pytest.mark.usefixtures("hooks")
def test_a_stop_that_lands_between_the_watcher_reading_the_clock_and_measuring_is_still_paid_for(
    programs: dict[str, Path], tmp_path: Path
) -> None:
    """As above, the stop landing where the watcher has read the clock and not yet measured (held there for 90 ms of
    each tick, as a busy machine can hold it): resumed, it measured with the time read before the stop, saw the
    kernel done and nothing for the last second, and the 2.5 s went unpaid (1 run in 20 under load; most runs here)."""
    (admitted,) = _run(programs, tmp_path, "hooks", "stopped", VCUDA_TEST_WATCHER_DELAY_US="90000")
    assert admitted <= 2, f"stopped (hooks): {admitted} kernels of 50 ms admitted in the second after the stop"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_cuGetProcAddress_hands_out_only_gated_launch_entry_points(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """Every launch entry point (cuLaunchKernel, Ex, cooperative, multi-device, graph, legacy) asked for through
    cuGetProcAddress and cuGetProcAddress_v2, at every version from 2.0 to 13.0 and every flag, is the
    interceptor's."""
    env = _env(tmp_path, variant)
    done = subprocess.run([str(programs[variant]), "getproc"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"getproc ({variant}): exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    m = re.search(r"^found (\d+) escapes (\d+)$", done.stdout, re.M)
    assert m is not None, done.stdout
    assert int(m.group(1)) > 500, done.stdout
    assert int(m.group(2)) == 0, done.stdout


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_launches_on_a_stream_another_thread_destroys_run_through(
    programs: dict[str, Path], tmp_path: Path, variant: str
) -> None:
    """1 us kernels for a second on a stream another thread keeps replacing (made anew, the one before destroyed):
    launches find their stream destroyed in the driver or right after it (the limiter's marker then fails).  The
    simulated driver wrote to the stream it had looked up, freed meanwhile by the other thread (ASan stopped the
    process); the process must run through, with launches admitted."""
    (admitted,) = _run(programs, tmp_path, variant, "stream-churn")
    assert admitted > 0, f"stream-churn ({variant}): no launch admitted in a second"


@pytest.mark.parametrize("churn", ["context-churn", "primary-churn", "primary-held-churn"])
@pytest.mark.parametrize("rested", [False, True])
@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_a_context_destroyed_after_each_launch_keeps_the_share(
    programs: dict[str, Path], tmp_path: Path, variant: str, rested: bool, churn: str
) -> None:
    """Each 50 ms kernel in a context of its own, destroyed right after the launch with the kernel running: a
    destroyed context's launches count as complete from the start of its destroy (their work ends with it), so the
    debt NVML then shows is what holds the share.  A launch may wait for seconds there, and the offer outlasts its
    second: the GPU time admitted is held against the time the offer took (at 30 %, plus 600 ms: the credit's burst
    and a measurement's lag; an ungated path admits 100 kernels, 5 s of GPU time, in about a second).
    "primary-churn": in the primary context, retained for the launch and released for the last time right after it;
    "primary-held-churn": the same with a reference held all along, so that no release destroys it and its
    kernels are still waited for."""
    extra = {"REVIEW12_RESTED": "1"} if rested else {}
    out = _output(programs, tmp_path, variant, churn, **extra)
    m = re.search(r"^admitted (\d+) of \d+ in (\d+) ms", out, re.M)
    assert m is not None, f"{churn} ({variant}): no report\n{out}"
    admitted, took_ms = int(m.group(1)), int(m.group(2))
    assert admitted * 50 <= SHARE / 100 * took_ms + 600, (
        f"{churn}: {admitted} kernels of 50 ms in {took_ms} ms at {SHARE} %"
    )


@pytest.mark.usefixtures("hooks")
@pytest.mark.parametrize("scenario", ["context-destroyed", "primary-released", "green-destroyed"])
def test_no_marker_of_a_destroyed_context_is_touched_after_the_destroy(
    programs: dict[str, Path], tmp_path: Path, scenario: str
) -> None:
    """Kernels outstanding in a context that goes (destroyed, the primary context's last release, a green
    context's destroy).  The driver frees the context's events in its destroy; the limiter forgot its markers there
    only after it returned, and its watcher (every 10 ms), a launch waiting for credit or a marker recorded in the
    slot could ask for, or destroy, a freed event in between: the simulated driver stops the process.  A test-only
    delay right after the driver's destroy (VCUDA_TEST_DESTROY_DELAY_US, -DVC_TEST_HOOKS) holds that moment open."""
    for admitted in _run(programs, tmp_path, "hooks", scenario, VCUDA_TEST_DESTROY_DELAY_US="100000"):
        assert admitted <= MOST_ADMITTED, f"{scenario} (destroy delayed): {admitted} kernels of 50 ms in 1 s"


@pytest.mark.usefixtures("hooks")
@pytest.mark.parametrize("scenario", ["destroy-elsewhere", "destroy-elsewhere-running", "release-elsewhere-running"])
def test_launches_in_another_context_go_on_while_a_context_is_destroyed(
    programs: dict[str, Path], tmp_path: Path, scenario: str
) -> None:
    """A thread launches 1 us kernels in its own context while another destroys a context that ran kernels (their
    markers still in the limiter's ring; "-running": the kernels still running), the destroy made to last half a
    second (VCUDA_TEST_DESTROY_DELAY_US, -DVC_TEST_HOOKS).  The driver's destroy waits for the context's work, and
    a host function of that context waiting for another thread's launch must not wait for good.  The limiter held
    every device's lock across the destroy: no launch went meanwhile (1 of 1 us in 0.5 s).  Then it left the
    context's markers alone until the destroy returned, and stopped its look at the launches complete at the first
    one: with the context's kernels still running, the other thread's launches waited for credit all along (1 in
    0.5 s).  A destroyed context's launches now count as complete from the start of the destroy."""
    (admitted,) = _run(programs, tmp_path, "hooks", scenario, VCUDA_TEST_DESTROY_DELAY_US="500000")
    assert admitted >= 10, f"{scenario}: {admitted} launches in another context during a 0.5 s destroy"


@pytest.mark.usefixtures("hooks")
def test_a_release_that_leaves_the_primary_context_alive_is_not_taken_for_its_last(
    programs: dict[str, Path], tmp_path: Path
) -> None:
    """The primary context retained twice, 50 ms kernels running in it, then one release, made to last half a second
    (VCUDA_TEST_RELEASE_DELAY_US, -DVC_TEST_HOOKS), while another thread launches 1 us kernels in its own context.
    The context stays alive with its kernels: they are waited for as launches in flight, and the other thread's
    launches wait for credit meanwhile.  Were the release taken for the last (the count of references one short),
    its kernels would count as complete at its start and the other thread's launches would go (about 250)."""
    (admitted,) = _run(
        programs, tmp_path, "hooks", "release-elsewhere-running-held", VCUDA_TEST_RELEASE_DELAY_US="500000"
    )
    assert admitted < 10, f"{admitted} launches in another context while a release that was not the last lasted 0.5 s"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_launches_the_driver_refuses_cost_no_gpu_time(programs: dict[str, Path], tmp_path: Path, variant: str) -> None:
    """Once NVML's samples have taught the limiter a kernel's cost (50 ms), 2000 launches the driver refuses (no
    function), spread over the limiter's measurements, never ran: each is counted complete, but none is charged that
    cost, so none waits for credit and all 2000 go within the scenario's 20 s (charged at the cost, they were a debt
    of about 100 s and a launch of the burst waited for minutes)."""
    out = _output(programs, tmp_path, variant, "failed-burst-learnt")
    m = re.search(r"^refused (\d+) of 2000 in (\d+) ms", out, re.M)
    assert m is not None, f"failed-burst-learnt ({variant}): no report\n{out}"
    assert int(m.group(1)) == 2000, f"failed-burst-learnt ({variant}): {m.group(0)}"


@pytest.mark.parametrize("variant", ["plain", "asan"])
def test_launches_measure_when_the_watcher_is_gone(programs: dict[str, Path], tmp_path: Path, variant: str) -> None:
    """The limiter's watcher thread (the one that measures every 10 ms) cannot be started: the tenant refuses its
    creation (as a full pids cgroup does; it could as well end the thread with a signal handler that calls
    pthread_exit).  Then a 2.5 s kernel every 300 ms: each found the 90 ms of refill it needed and went without a
    look at NVML, so nothing was measured and all 10 went in 3 s of a 30 % share.  A launch now measures itself
    when nothing was measured for 50 ms: the second waits for the first to be paid for."""
    (admitted,) = _run(programs, tmp_path, variant, "no-watcher")
    assert admitted <= 2, f"no-watcher ({variant}): {admitted} kernels of 2.5 s admitted in 3 s at {SHARE} %"


@pytest.fixture(scope="module")
def hooks(programs: dict[str, Path]) -> None:
    """The interceptor built with -DVC_TEST_HOOKS (under vcuda/build/t_VC_TEST_HOOKS), for the "hooks" variant."""
    del programs
    build_hooks_interceptor()


@pytest.mark.usefixtures("hooks")
def test_a_launch_waits_for_a_limiter_another_thread_is_setting_up(programs: dict[str, Path], tmp_path: Path) -> None:
    """Two threads' first launches at once.  The device was marked set up before it was marked limited, so a launch
    that came between the two stores went through ungated (for as long as the thread setting it up was preempted
    there; -DVC_TEST_HOOKS widens the window with VCUDA_TEST_INIT_DELAY_US).  The limited mark comes first now: a
    launch that finds the device set up finds it limited."""
    (admitted,) = _run(programs, tmp_path, "hooks", "init-race", VCUDA_TEST_INIT_DELAY_US="800000")
    assert admitted <= MOST_ADMITTED, f"init-race: {admitted} kernels of 50 ms admitted in 1 s at {SHARE} %"


@pytest.mark.timing
@pytest.mark.xfail(
    strict=False,
    reason="not fixed: the container's sum of provisional charges is a pay-off deadline that runs down with the wall "
    "clock while the process that holds them also refills its credit, so a process that exits leaves rate x (time "
    "they were held) too little of its last charges to the next one (0.28 s of each 1 s process at 0.7 s sample delay)",
)
def test_a_chain_of_processes_that_exit_with_a_kernel_running_keeps_the_share(
    programs: dict[str, Path], tmp_path: Path
) -> None:
    """Five processes one after the other, each launching a 5 s kernel (gated: it waits for the debt of those before
    it) and exiting 1 s later with it still running, NVML's samples 0.7 s late as on a real driver: the chain must
    use at most its 30 % of the time it took, plus the last process's second (nobody pays for it) and a margin."""
    state = tmp_path / "node.state"
    env = _env(tmp_path, "plain")
    env["GPUSIM_PROCESS_SAMPLE_DELAY_US"] = "700000"
    done = subprocess.run([str(programs["plain"]), "exit-tail"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    m = re.search(r"^elapsed (\d+)$", done.stdout, re.M)
    assert m is not None, done.stdout
    elapsed = int(m.group(1)) / 1000
    with GpuSimState(str(state)) as st:
        timeline = st.timeline(0)
    assert timeline is not None
    busy = timeline.busy_ns / 1e9
    assert busy <= SHARE / 100 * elapsed + 1.5, f"the chain used {busy:.2f} s of the GPU in {elapsed:.2f} s"
