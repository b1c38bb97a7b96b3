"""What an operator meets at start: a second agent on the node given another --checkpoint-path never
takes the first one's sockets; a checkpoint directory that cannot be created says why; the in-cluster
configuration names the missing token file; the extender refuses an --assume-ttl that never ends."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import cli, names
from gpumanager.cli import hold_node_lock, hold_socket_dir_locks
from gpumanager.config import Config, ConfigError
from gpumanager.signals import SignalPipe
from simnode.agent_process import AgentProcess
from simnode.gpusim_state import spec_dir


@pytest.fixture
def signal_pipe() -> Iterator[SignalPipe]:
    pipe = SignalPipe()  # not installed: signals are written into it by hand
    yield pipe
    pipe.close()


def _inodes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in directory.iterdir() if p.name.endswith(".sock")}


def test_a_second_agent_with_another_checkpoint_path_waits_and_leaves_the_first_ones_sockets(
    tmp_path: Path,
) -> None:
    spec = spec_dir() / "t4-x1.json"
    first = AgentProcess(tmp_path, spec).start()
    second: AgentProcess | None = None
    try:
        first.wait_for_log("serving 1 GPUs", timeout=60)
        before = _inodes(first.plugin_dir)
        assert names.VCORE_SOCKET in before and names.VMEMORY_SOCKET in before
        second = AgentProcess(
            tmp_path,
            spec,
            extra_args=[
                f"--checkpoint-path={tmp_path / 'other-checkpoint'}",
                f"--display-socket={tmp_path / 'o.sock'}",
            ],
        )
        second.log_path = tmp_path / "second.log"
        second.start()
        text = second.wait_for_log("holds the node", timeout=60)
        assert f"--device-plugin-path={first.plugin_dir}" in text, text
        assert "Traceback" not in text
        assert _inodes(first.plugin_dir) == before
        second.signal(signal.SIGTERM)
        assert second.wait(30) == cli.EXIT_OK, second.log_text()
        assert _inodes(first.plugin_dir) == before
        assert "serving 1 GPUs" not in second.log_text()
    finally:
        if second is not None:
            second.stop()
        first.stop()


def test_socket_directory_locks_skip_the_directory_already_locked_as_the_checkpoint(
    tmp_path: Path, signal_pipe: SignalPipe
) -> None:
    """--device-plugin-path and --virtual-manager-path the same directory as --checkpoint-path: locked once,
    never a wait on the agent's own lock."""
    config = Config(
        checkpoint_path=str(tmp_path), device_plugin_path=str(tmp_path), virtual_manager_path=str(tmp_path / ".")
    )
    fd, stopped = hold_node_lock(tmp_path, signal_pipe)
    assert fd is not None and stopped is None
    os.write(signal_pipe._write, bytes([signal.SIGTERM]))  # a wait would end with it; none must happen
    fds, stopped = hold_socket_dir_locks(config, signal_pipe)
    try:
        assert stopped is None and fds == []
    finally:
        os.close(fd)


def test_the_socket_directory_lock_waits_for_its_holder_and_ends_on_sigterm(
    tmp_path: Path, signal_pipe: SignalPipe, caplog: pytest.LogCaptureFixture
) -> None:
    plugins = tmp_path / "dp"
    # Every directory the test's own: the lock is taken in --virtual-manager-path too, which the default would make
    # on the host (/etc/gpu-manager/vm).
    config = Config(
        checkpoint_path=str(tmp_path / "ck"), device_plugin_path=str(plugins), virtual_manager_path=str(tmp_path / "vm")
    )
    held, stopped = hold_socket_dir_locks(config, signal_pipe)
    assert stopped is None and len(held) == 2  # --device-plugin-path and --virtual-manager-path
    other = SignalPipe()
    try:
        os.write(other._write, bytes([signal.SIGTERM]))
        with caplog.at_level(logging.WARNING, logger="gpumanager.cli"):
            fds, stopped = hold_socket_dir_locks(config, other)
        assert fds == [] and stopped == signal.SIGTERM
        assert f"--device-plugin-path={plugins}" in caplog.text
    finally:
        other.close()
        for fd in held:
            os.close(fd)


def test_a_checkpoint_directory_that_cannot_be_created_says_why(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if os.geteuid() != 0:
        pytest.skip("runs the agent as another user")
    top = Path(tempfile.mkdtemp(prefix="gm-ro-", dir="/tmp"))  # pytest's own directories are root's alone
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    base = top / "ro"
    base.mkdir(mode=0o555)
    node = base / "checkpoint"
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-m",
            "gpumanager.cli",
            f"--checkpoint-path={node}",
            f"--device-plugin-path={tmp_path / 'dp'}",
            "--hostname-override=sim-node",
        ],
        capture_output=True,
        timeout=60,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[1])},
    )
    err = done.stderr.decode()
    assert done.returncode == cli.EXIT_CONFIG, err[-2000:]
    line = next(line for line in err.splitlines() if "single-instance lock" in line)
    assert str(node) in line and "Permission denied" in line and "No such file" not in line, line
    assert "Traceback" not in err


def test_the_in_cluster_configuration_names_the_missing_token_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from gpumanager.kube import client

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    incluster = pytest.importorskip("kubernetes.config.incluster_config")
    token = tmp_path / "serviceaccount" / "token"
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(token))
    with pytest.raises(client.KubeUnavailableError) as info:
        client.kube_client("")
    assert str(token) in str(info.value), str(info.value)


@pytest.mark.parametrize("ttl", ["inf", "1e400"])
def test_the_extender_refuses_an_assume_ttl_that_never_ends(ttl: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpumanager.extender.cli", f"--assume-ttl={ttl}", "--kubeconfig=/nonexistent"],
        capture_output=True,
        timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == 2, err[-2000:]
    assert "--assume-ttl" in err and "Traceback" not in err, err[-2000:]


_EARLY_SIGNAL = """
import os, signal, sys
import gpumanager.rlimits as rlimits
from gpumanager import cli

def stopped_now():  # the first thing main() does: a stop signal arrives before the agent took the signals
    os.kill(os.getpid(), signal.{name})

rlimits.raise_open_files_limit = stopped_now
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_before_the_signals_are_taken_exits_0_in_one_line(tmp_path: Path, name: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _EARLY_SIGNAL.format(name=name),
            f"--checkpoint-path={tmp_path / 'ck'}",
            f"--device-plugin-path={tmp_path / 'dp'}",
            "--hostname-override=sim-node",
        ],
        capture_output=True,
        timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == cli.EXIT_OK, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert len(err.strip().splitlines()) == 1 and name in err, err
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("flag", ["--kubelet-watch-period", "--health-probe-period"])
@pytest.mark.parametrize("value", ["1ns", "0.0000001", "9ms"])
def test_a_period_so_short_the_agent_would_spin_is_refused(flag: str, value: str) -> None:
    args = cli.build_parser({}).parse_args([f"{flag}={value}", "--hostname-override=sim-node"])
    with pytest.raises(ConfigError, match=f"^{flag}=") as info:
        cli.config_from_args(args, {})
    assert "at least 10ms" in str(info.value)


@pytest.mark.parametrize("flag", ["--kubelet-watch-period", "--health-probe-period"])
def test_a_period_of_10ms_is_taken(flag: str) -> None:
    args = cli.build_parser({}).parse_args([f"{flag}=10ms", "--hostname-override=sim-node"])
    cli.config_from_args(args, {})


def test_a_device_plugin_path_that_is_a_file_is_refused_as_such(tmp_path: Path) -> None:
    afile = tmp_path / "not-a-directory"
    afile.write_text("")
    agent = AgentProcess(tmp_path / "node", spec_dir() / "t4-x1.json", extra_args=[f"--device-plugin-path={afile}"])
    agent.plugin_dir = tmp_path / "node" / "unused"  # start() creates it; the flag that counts comes last
    agent.start()
    try:
        assert agent.wait(60) == cli.EXIT_CONFIG, agent.log_text()[-3000:]
    finally:
        agent.stop()
    text = agent.log_text()
    assert f"--device-plugin-path={afile}: exists and is not a directory" in text, text[-3000:]
    assert "Traceback" not in text and "Errno" not in text, text[-3000:]


def test_a_cgroup_root_that_does_not_exist_is_named_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-cgroup-fs"
    agent = AgentProcess(tmp_path / "node", spec_dir() / "t4-x1.json", extra_args=[f"--cgroup-root={missing}"])
    agent.start()
    try:
        text = agent.wait_for_log("serving 1 GPUs", timeout=60)
    finally:
        assert agent.stop() == cli.EXIT_OK
    lines = [line for line in text.splitlines() if f"--cgroup-root={missing}" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "does not exist" in lines[0], text[-3000:]


@pytest.mark.parametrize("flag", ["--bogus", "--gpu=-1", "--memory-mib=0", "--limits=abc"])
def test_a_bad_selftest_flag_is_one_line_exit_2(flag: str) -> None:
    done = subprocess.run([sys.executable, "-m", "gpumanager.cli", "selftest", flag], capture_output=True, timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "gpu-manager selftest: error:" in err, err
    assert "--help" in err and "Traceback" not in err, err


def test_a_selftest_vcuda_library_that_is_a_directory_is_not_called_missing(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpumanager.cli", "selftest", f"--vcuda-library={tmp_path}"],
        capture_output=True,
        timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    if "cuda-bindings" in err:
        pytest.skip("NVIDIA's cuda-bindings are not installed: the flag is not looked at")
    assert f"--vcuda-library {tmp_path}: is a directory, not the interceptor's file" in err, err


def test_a_display_socket_path_that_is_a_regular_file_is_never_removed(tmp_path: Path) -> None:
    precious = tmp_path / "volume.conf"
    precious.write_text("an operator's file, named by mistake\n")
    agent = AgentProcess(tmp_path / "node", spec_dir() / "t4-x1.json", extra_args=[f"--display-socket={precious}"])
    agent.start()
    try:
        text = agent.wait_for_log("serving 1 GPUs", timeout=60)
    finally:
        assert agent.stop() == cli.EXIT_OK
    assert precious.read_text() == "an operator's file, named by mistake\n"
    lines = [line for line in text.splitlines() if f"--display-socket={precious}" in line]
    assert lines and "not a socket" in lines[0], text[-3000:]
