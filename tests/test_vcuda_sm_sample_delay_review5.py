"""The SM limiter holds its share when NVML shows each per-process sample only some time after its moment.

A real driver delivers a process's utilisation sample 0.7 s or more after the time it covers (the self-test allows
a 2 s lag), at a sampling period of about 1/6 s on datacenter GPUs.  The simulated NVML models that delay with
GPUSIM_PROCESS_SAMPLE_DELAY_US.  First the simulator's own semantics (a query sees only delivered samples, each
once when the caller passes a sample's timestamp back), then the limiter: ``launch_loop`` processes of one
container under a hard limit, the container's share read from the simulated timeline over consecutive windows.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.test_vcuda_compute import PACED, Node, loop_built, node
from tests.vcuda_fixtures import BUILD, last_json, run_python, vcuda_built

__all__ = ["loop_built", "node", "vcuda_built"]  # fixtures

POLL = r"""
import pynvml, time
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(GPU)
since = {}
start = int(time.time() * 1e6)
rows = []
while time.time() * 1e6 < start + 2.0e6:
    asked_from = min(since.values()) if since else start
    asked = int(time.time() * 1e6)
    try:
        got = pynvml.nvmlDeviceGetProcessUtilization(h, asked_from)
    except pynvml.NVMLError_NotFound:
        got = []
    for s in got:
        rows.append([s.pid, s.timeStamp, s.smUtil, asked, asked_from, since.get(s.pid, start)])
        since[s.pid] = max(since.get(s.pid, start), s.timeStamp)
    time.sleep(0.02)
print(json.dumps({"start": start, "rows": rows}))
"""


@pytest.mark.parametrize("delay_us", [0, 300000])
def test_nvml_delivers_each_process_sample_a_delay_after_its_moment(node: Node, delay_us: int) -> None:
    """Every sample an answer holds is at least the delay old when asked; asked from the previous sample's time,
    each later sample comes once, in order, and shows the process busy."""
    sim = {"LD_LIBRARY_PATH": str(BUILD / "sim"), "GPUSIM_PROCESS_SAMPLE_DELAY_US": str(delay_us)}
    loop = subprocess.Popen([sys.executable, "-c", PACED, "3.0", "0.004", "12"], env=node.env("s", None, None, **sim))
    try:
        time.sleep(0.5)
        done = run_python(POLL.replace("GPU", "12"), node.env("s", None, None, **sim))
    finally:
        loop.wait(timeout=60)
    assert done.returncode == 0, done.stderr
    got = last_json(done.stdout)
    assert isinstance(got, dict)
    rows = [r for r in got["rows"] if r[0] == loop.pid]
    assert len(rows) >= 10, got  # a 10 ms period over 2 s: samples throughout
    for _pid, ts, _util, asked, asked_from, before in rows:
        assert ts <= asked - delay_us, (ts, asked, delay_us)  # not delivered before its delay
        assert ts > asked_from and ts > before, (ts, asked_from, before)  # newer than asked, never twice
    assert all(0 < r[2] <= 100 for r in rows), rows
