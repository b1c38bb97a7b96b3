"""What an operator sees when the agent cannot do what it was told: one clear line naming the object
and the value (and what to do), never a library's multi-line text or a gRPC core message."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from gpumanager import cli
from gpumanager.device import nvml
from gpumanager.kube.client import KubeUnavailableError, kube_client
from simnode.agent_process import AgentProcess
from simnode.gpusim_state import sim_env
from tests.agent_fixtures import spec_path
from tests.volume_fixtures import (
    DEFAULT_VOLUME_CONF,
    LIB32,
    LIB64,
    LIBX32,
    V1,
    DriverStore,
    driver_store,
    install_driver,
    remove_libcuda,
)

__all__ = ["driver_store"]

NOBODY = 65534
SERVING = "serving 8 GPUs"


def test_help_names_the_selftest_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    """`gpu-manager --help` is where a newcomer looks for what the command can do: `selftest` is listed."""
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # as wrapped for the terminal
    assert "gpu-manager selftest" in out


def test_malformed_kubeconfig_is_one_line_naming_file_and_position(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nclusters: [\n")
    with pytest.raises(KubeUnavailableError) as err:
        kube_client(str(kubeconfig))
    message = str(err.value)
    assert "\n" not in message, message
    assert str(kubeconfig) in message and "not valid YAML" in message
    assert "line 3" in message, message


def test_nvml_library_not_found_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_found() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", not_found)
    with pytest.raises(nvml.NVMLUnavailableError) as err:
        nvml.init()
    message = str(err.value)
    assert "libnvidia-ml.so.1" in message and "--nvml-lib" in message, message


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may enter and write (pytest's own is the owner's only)."""
    path = Path(tempfile.mkdtemp(prefix="gmop-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_nobody(workdir: Path, *flags: str, wait_for: str = "", timeout: float = 20.0) -> tuple[int | None, str]:
    """Run the agent on the simulated node as an unprivileged user; its exit code (None: it kept running
    until ``wait_for`` was logged and was stopped) and everything it wrote."""
    agent = AgentProcess(workdir, spec_path("h100-nvlink-x8"), extra_args=flags)
    log = workdir / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            agent.args, env=sim_env(agent.spec, agent.state), stdout=out, stderr=subprocess.STDOUT, user=NOBODY
        )
        deadline = time.monotonic() + timeout
        code: int | None = None
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None or (wait_for and wait_for in log.read_text(errors="replace")):
                break
            time.sleep(0.05)
        if code is None:
            proc.terminate()
            proc.wait(timeout=20)
    return code, log.read_text(errors="replace")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs the agent as another user")


@needs_root
def test_device_plugin_dir_not_writable_names_dir_and_errno(shared_dir: Path, sim_built: Path) -> None:
    plugins = shared_dir / "plugins"
    plugins.mkdir(mode=0o755)  # root's: the agent's user may not make its sockets there
    code, out = _as_nobody(shared_dir, f"--device-plugin-path={plugins}")
    assert code == 2, out
    assert "add_port.cc" not in out and "GRPC_VERBOSITY" not in out, out
    line = next(x for x in out.splitlines() if "cannot start" in x)
    assert f"--device-plugin-path={plugins}" in line and "Permission denied" in line, line


@needs_root
def test_display_socket_dir_not_writable_names_path_and_errno(shared_dir: Path, sim_built: Path) -> None:
    run = shared_dir / "run"
    run.mkdir(mode=0o755)
    code, out = _as_nobody(shared_dir, f"--display-socket={run / 'gpu-manager.sock'}", wait_for=SERVING)
    assert code is None, out
    assert "add_port.cc" not in out and "GRPC_VERBOSITY" not in out, out
    line = next(x for x in out.splitlines() if "--display-socket" in x)
    assert str(run / "gpu-manager.sock") in line and "Permission denied" in line, line


def test_missing_volume_config_is_logged_once(tmp_path: Path, sim_built: Path) -> None:
    missing = tmp_path / "volume.conf"
    agent = AgentProcess(tmp_path, spec_path("h100-nvlink-x8"), extra_args=[f"--volume-config={missing}"]).start()
    try:
        text = agent.wait_for_log(SERVING, timeout=30)
    finally:
        agent.stop()
    lines = [x for x in text.splitlines() if "driver mirror not built" in x]
    assert len(lines) == 1, lines
    assert str(missing) in lines[0]


def test_query_port_in_use_names_the_flag_and_what_is_lost(tmp_path: Path, sim_built: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        agent = AgentProcess(tmp_path, spec_path("h100-nvlink-x8"), query_port=port).start()
        try:
            text = agent.wait_for_log(SERVING, timeout=30)
        finally:
            agent.stop()
    line = next(x for x in text.splitlines() if "cannot listen" in x)
    assert f"--query-port={port}" in line and "/healthz" in line, line


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


def test_volume_config_error_is_logged_again_only_when_it_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The keeper checks again every few minutes: the same failure each time is one line, not one per check."""
    from gpumanager.volume.keeper import MirrorKeeper

    config = tmp_path / "volume.conf"
    keeper = MirrorKeeper(
        volume_config=str(config), driver_root=str(tmp_path), share_mode=False, interceptor="", period=3600
    )
    assert not keeper.build()  # at the start: the agent reports it (test_missing_volume_config_is_logged_once)
    keeper.start()
    try:
        with caplog.at_level("ERROR", logger="gpumanager.volume.keeper"):
            for _ in range(3):
                assert not keeper.build()  # what the loop does at each check
            config.write_text("garbage\n")
            assert not keeper.build()
    finally:
        keeper.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and str(config) in errors[0], errors


def test_unknown_node_name_says_which_flag_names_it(tmp_path: Path, sim_built: Path) -> None:
    """A node name the API server does not know (a wrong --hostname-override or $NODE_NAME): the agent
    never sees its pods; the log says so and which setting to correct, not only '404 Not Found'."""
    from simnode.cluster import SimCluster

    cluster = SimCluster(tmp_path, "t4-x1", agent_flags=["--hostname-override=no-such-node"])
    cluster.start(wait=False)
    try:
        assert cluster.agent is not None
        text = cluster.agent.wait_for_log("gpu-inventory on node no-such-node", timeout=30)
    finally:
        cluster.stop()
    line = next(x for x in text.splitlines() if "gpu-inventory on node no-such-node" in x)
    assert "--hostname-override" in line and "NODE_NAME" in line, line


def test_no_in_cluster_configuration_says_to_give_a_kubeconfig(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run by hand (not in a pod) without --kubeconfig: the line says what is missing and which flag gives it."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(KubeUnavailableError) as err:
        kube_client("")
    message = str(err.value)
    assert "KUBERNETES_SERVICE_HOST" in message and "--kubeconfig" in message, message


def test_mirror_recheck_of_an_unchanged_host_logs_nothing(
    tmp_path: Path, driver_store: DriverStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The mirror is checked again every 5 minutes: an unchanged host (here one whose mirror cannot give
    shares the interceptor) logs its state once, at the first build, not at every check."""
    from gpumanager.volume.keeper import MirrorKeeper

    root = tmp_path / "host"
    install_driver(driver_store, root, V1)
    remove_libcuda(root, LIB64, LIB32, LIBX32)
    (tmp_path / "proc").mkdir()
    conf = json.loads(DEFAULT_VOLUME_CONF.read_text())
    for volume in conf["volume"]:
        volume["base"] = str(tmp_path / "vdriver")
    (tmp_path / "volume.conf").write_text(json.dumps(conf))
    mirror = MirrorKeeper(
        volume_config=str(tmp_path / "volume.conf"),
        driver_root=str(root),
        share_mode=True,
        interceptor=str(driver_store.interceptor(0)),
        proc_root=str(tmp_path / "proc"),
    )
    with caplog.at_level("INFO", logger="gpumanager.volume"):
        assert mirror.build() is True
        first = [r.getMessage() for r in caplog.records]
        caplog.clear()
        assert mirror.build() is True and mirror.build() is True
        again = [f"{r.levelname} {r.getMessage()}" for r in caplog.records]
    assert any("share mode has no interceptor" in m for m in first), first
    assert again == [], again


def test_dra_mode_without_api_server_says_why_and_does_not_claim_to_have_started(
    tmp_path: Path, sim_built: Path
) -> None:
    """DRA mode cannot serve without the API server: the log says why (the kubeconfig's problem) in the
    line that says claims are not served, speaks of claims rather than Allocate, and the start's last line
    does not announce a started driver."""
    agent = AgentProcess(tmp_path, spec_path("t4-x1"), extra_args=["--mode=dra"]).start()
    try:
        text = agent.wait_for_log("DRA driver vcuda.tencent.com", timeout=30)  # the start's last line
    finally:
        agent.stop()
    dra_line = next(x for x in text.splitlines() if "DRA mode needs the API server" in x)
    assert "no-kubeconfig" in dra_line, dra_line
    assert "Allocate" not in text, text
    assert "started in" not in text, text


def test_selftest_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["selftest", "--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for default in ("10,30,50,70,90", "default 2", "default 4", "default 200000", "default: all"):
        assert default in out, (default, out)


def test_selftest_refuses_a_negative_gpu_index(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["selftest", "--gpu=-1"])
    assert done.value.code == 2
    assert "--gpu" in capsys.readouterr().err


def test_an_unreachable_api_server_is_named_in_a_short_line() -> None:
    """What urllib3 raises for a connection refused is 300 characters naming its pool classes twice; the
    log line says which server could not be reached and why."""
    import urllib3

    from gpumanager.kube.apierror import failure

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        urllib3.PoolManager(retries=0).request("GET", f"https://127.0.0.1:{port}/api/v1/pods")
    text = failure(err.value)
    assert text.startswith(f"cannot reach the API server at https://127.0.0.1:{port}: "), text
    assert "Connection refused" in text and "HTTPSConnection" not in text and "MaxRetryError" not in text, text


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--hostname-override=gpu_node_1"], {}, "--hostname-override='gpu_node_1'"),
        ([], {"NODE_NAME": "node 2"}, "$NODE_NAME='node 2'"),
    ],
)
def test_a_node_name_no_node_can_have_is_refused_naming_its_source(
    argv: list[str], env: dict[str, str], named: str
) -> None:
    """Node names are DNS subdomains: with another name the agent would watch pods of a node that cannot
    exist, and serve none; exit 2 naming where the name came from."""
    from gpumanager.config import ConfigError

    args = cli.build_parser({}).parse_args(cli.normalize_argv(argv))
    with pytest.raises(ConfigError) as err:
        cli.config_from_args(args, env)
    assert named in str(err.value) and "DNS subdomain" in str(err.value), str(err.value)


def test_http_server_header_has_no_trailing_space() -> None:
    import http.client

    from gpumanager.metrics.http import QueryServer

    server = QueryServer("127.0.0.1", 0, routes={}, metrics=lambda: b"", health=lambda: (True, {}))
    server.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        conn.request("GET", "/healthz")
        header = conn.getresponse().getheader("Server")
        conn.close()
    finally:
        server.stop()
    assert header is not None and header == header.strip() and header.startswith("gpu-manager"), repr(header)


def test_a_directory_not_writable_by_a_non_root_agent_says_it_runs_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run by hand as an ordinary user, the first refusal is the state directory: the line says whose
    write was refused and that the agent runs as root, the usual cause."""
    from gpumanager import flagchecks
    from gpumanager.config import ConfigError

    monkeypatch.setattr(os, "access", lambda *_: False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError) as err:
        flagchecks.check_directory("--virtual-manager-path", str(tmp_path))
    message = str(err.value)
    assert f"--virtual-manager-path={tmp_path}" in message and "uid 1000" in message and "root" in message, message


def test_driver_binaries_missing_on_the_host_are_one_warning(
    tmp_path: Path, sim_built: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A host without some of the driver's optional programs (MPS, debugdump, persistenced...) is common:
    the mirror says which are missing in one line, not one line per program at each start."""
    from gpumanager.volume.keeper import MirrorKeeper
    from simnode.simhost import install_sim_driver, volume_conf

    root = tmp_path / "host"
    install_sim_driver(root)  # the libraries, none of the driver's programs
    (tmp_path / "proc").mkdir()
    mirror = MirrorKeeper(
        volume_config=str(volume_conf(tmp_path / "vdriver", tmp_path / "volume.conf")),
        driver_root=str(root),
        share_mode=False,
        interceptor="",
        proc_root=str(tmp_path / "proc"),
    )
    with caplog.at_level("WARNING", logger="gpumanager.volume"):
        assert mirror.build() is True
    lines = [r.getMessage() for r in caplog.records if "not found on the PATH" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "'nvidia-smi'" in lines[0] and "'nvidia-debugdump'" in lines[0] and str(root) in lines[0], lines


def test_extender_tls_files_that_are_not_pem_say_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gpumanager.extender import cli as extender_cli

    junk = tmp_path / "tls.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(SystemExit) as done:
        extender_cli.main([f"--tls-cert-file={junk}", f"--tls-private-key-file={junk}", "--listen=127.0.0.1:0"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"--tls-cert-file={junk}" in err and "PEM certificate" in err and "private key" in err, err


def test_dra_slice_of_an_unknown_node_says_which_setting_names_the_node(caplog: pytest.LogCaptureFixture) -> None:
    """DRA mode publishes its ResourceSlice for the node it thinks it is on: where the API server has no
    such Node, the line says the name may be wrong and which settings give it."""
    from gpumanager.dra.publisher import SlicePublisher
    from simnode.apiserver import ApiServerSimulator

    driver = "vcuda.tencent.com"
    with ApiServerSimulator() as api:

        def content(gen: int) -> dict[str, object]:
            pool = {"name": "no-such-node", "generation": gen, "resourceSliceCount": 1}
            return {"driver": driver, "nodeName": "no-such-node", "pool": pool, "devices": []}

        pub = SlicePublisher(api.component_client("dra"), node="no-such-node", driver=driver, content=content)
        with caplog.at_level("WARNING", logger="gpumanager.dra.publisher"):
            pub.sync()
    line = next(r.getMessage() for r in caplog.records if "no-such-node" in r.getMessage())
    assert "--hostname-override" in line and "NODE_NAME" in line, line
