"""Run the real ``gpu-manager-extender`` command as a child process (tests, benchmarks, demos)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from simnode.agent_process import free_port


class ExtenderProcess:
    """One extender process serving on 127.0.0.1, logging to ``workdir/extender.log``."""

    def __init__(self, workdir: Path, kubeconfig: Path, *, extra_args: Sequence[str] = (), port: int | None = None):
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.port = port if port is not None else free_port()
        self.extra_args = list(extra_args)
        self.log_path = workdir / "extender.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def url_prefix(self) -> str:
        """Where the verbs are (the default ``--url-prefix``)."""
        return f"{self.url}/scheduler"

    def start(self, *, wait: bool = True, timeout: float = 30.0) -> ExtenderProcess:
        """Start the process; with ``wait``, until ``/readyz`` answers 200."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpumanager.extender.cli",
                f"--kubeconfig={self.kubeconfig}",
                f"--listen=127.0.0.1:{self.port}",
                *self.extra_args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def ready(self) -> bool:
        """Whether ``/readyz`` answers 200 now."""
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=5) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait for ``/readyz``; raises with the log's tail if the process died or took too long."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            if self.ready():
                return
            time.sleep(0.05)
        raise TimeoutError(f"the extender is not ready:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        """Everything the extender logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def metrics(self) -> str:
        """The ``/metrics`` text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def post(self, verb: str, body: object) -> object:
        """POST a verb, return the decoded answer."""
        req = urllib.request.Request(
            f"{self.url_prefix}/{verb}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def rss_kib(self) -> tuple[int, int]:
        """(current, peak) resident set size of the process, KiB."""
        if self.proc is None:
            raise RuntimeError("extender not started")
        values = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line.split(":")[0]] = int(line.split()[1])
        return values["VmRSS"], values["VmHWM"]

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.wait()

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait (SIGKILL when it does not stop); returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.wait(timeout)

    def wait(self, timeout: float = 20.0) -> int:
        """Wait for the process to end; returns its exit code."""
        if self.proc is None:
            return 0
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is not None and self._log is not None:
                self._log.close()
                self._log = None
