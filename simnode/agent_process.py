"""Run the real ``gpu-manager`` command as a child process on the simulated GPU node.

Used by the integration tests, the benchmarks and the demo: the agent runs
exactly as in production (its own process, real sockets, real signals), with
``LD_LIBRARY_PATH`` pointing at the simulated ``libnvidia-ml.so.1`` and
``GPUSIM_SPEC``/``GPUSIM_STATE`` naming the node spec and its live state.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from simnode.gpusim_state import sim_env, spec_dir

log = logging.getLogger(__name__)

SPEC_DIR = spec_dir()


#: What the agent adds below --virtual-manager-path for a pod's socket: ``/<36-character pod uid>/vcuda.sock``.
_VCUDA_SOCK_TAIL = 1 + 36 + 1 + len("vcuda.sock")


def vm_path_for(workdir: Path) -> Path:
    """``workdir/vm``, or, where that is too long for the pods' vcuda.sock (107 bytes; the agent refuses
    such a --virtual-manager-path), a shorter directory that is the same for the same ``workdir`` (an
    agent started again there finds its pods' files): in the nearest directory above ``workdir`` inside
    the temporary directory where it fits (a test's run directory, removed with it), else in the
    temporary directory itself."""
    vm = workdir / "vm"
    if _fits(vm):
        return vm
    tmp = Path(tempfile.gettempdir())
    name = "gm-vm-" + hashlib.sha256(os.fsencode(str(workdir.absolute()))).hexdigest()[:16]
    for base in workdir.absolute().parents:
        if base.is_relative_to(tmp) and _fits(base / name):
            return base / name
    return tmp / name


def _fits(vm: Path) -> bool:
    return len(os.fsencode(str(vm))) + _VCUDA_SOCK_TAIL <= 107


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AgentProcess:
    """One ``gpu-manager`` process with its own directories under ``workdir``."""

    def __init__(
        self,
        workdir: Path,
        spec: Path,
        *,
        state: Path | None = None,
        extra_args: Sequence[str] = (),
        query_port: int | None = None,
        env: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        self.workdir = workdir
        self.python = python or sys.executable
        self.spec = spec
        self.state = state or workdir / "gpusim.state"
        self.plugin_dir = workdir / "device-plugins"
        self.display_socket = workdir / "gpu-manager.sock"
        self.vm_path = vm_path_for(workdir)
        self.log_path = workdir / "agent.log"
        self.query_port = query_port if query_port is not None else free_port()
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def args(self) -> list[str]:
        """The command line: every directory and socket the agent writes or dials is under ``workdir``
        (never the host's /etc/gpu-manager, /var/lib/kubelet or /var/run), --virtual-manager-path too
        unless it is too long there (:func:`vm_path_for`); ``extra_args`` come last and override."""
        return [
            self.python,
            "-m",
            "gpumanager.cli",
            f"--device-plugin-path={self.plugin_dir}",
            f"--display-socket={self.display_socket}",
            "--query-addr=127.0.0.1",
            f"--query-port={self.query_port}",
            f"--kubeconfig={self.workdir / 'no-kubeconfig'}",
            f"--checkpoint-path={self.workdir / 'checkpoint'}",
            f"--virtual-manager-path={self.vm_path}",
            f"--pod-resources-socket={self.workdir / 'pod-resources' / 'kubelet.sock'}",
            f"--plugin-registry-path={self.workdir / 'reg'}",
            f"--dra-plugin-path={self.workdir / 'dra'}",
            f"--cdi-root={self.workdir / 'cdi'}",
            "--hostname-override=sim-node",
            *self.extra_args,
        ]

    def start(self) -> AgentProcess:
        """Start the process (returns at once)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self._log_file = log_file
        env = sim_env(self.spec, self.state)
        env.update(self.extra_env)
        self.proc = subprocess.Popen(self.args, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        """PID of the running agent."""
        if self.proc is None:
            raise RuntimeError("agent not started")
        return self.proc.pid

    def log_text(self) -> str:
        """Everything the agent logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(self, text: str, timeout: float = 10.0) -> str:
        """Wait until ``text`` appears in the log; return the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.log_text()
            if text in current:
                return current
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise TimeoutError(f"{text!r} not in the agent log within {timeout:g} s:\n{self.log_text()[-4000:]}")

    def signal(self, signum: int) -> None:
        """Send a signal to the agent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for the process to exit; return its exit code."""
        if self.proc is None:
            raise RuntimeError("agent not started")
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is not None and self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait; SIGKILL if it does not stop in time. Returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                log.error("agent %d ignored SIGTERM for %g s; killing it", self.proc.pid, timeout)
                self.proc.kill()
        return self.wait(timeout)

    def peak_rss_kib(self) -> int:
        """Peak resident set size (VmHWM) of the running agent, KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise RuntimeError("VmHWM missing from /proc status")
