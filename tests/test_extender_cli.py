"""The gpu-manager-extender command: flags, exit codes, HTTP(S) endpoints of the real process."""

from __future__ import annotations

import json
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager.extender.cli import build_parser
from simnode.agent_process import free_port
from simnode.apiserver import ApiServerSimulator
from tests.extender_fixtures import BLOCK, GIB, gpu_pod, inventory

CMD = [sys.executable, "-m", "gpumanager.extender.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CMD, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--policy=tightest"], "--policy"),
        (["--listen=nowhere"], "--listen=nowhere"),
        (["--listen=:99999"], "--listen=:99999"),
        (["--url-prefix=scheduler"], "--url-prefix=scheduler"),
        (["--tls-cert-file=/etc/hostname"], "--tls-cert-file=/etc/hostname: needs --tls-private-key-file"),
        (["--tls-cert-file=/nonexistent", "--tls-private-key-file=/nonexistent"], "--tls-cert-file=/nonexistent"),
        (["--kubeconfig=/nonexistent/kubeconfig"], "--kubeconfig=/nonexistent/kubeconfig: no such file"),
        (["--assume-ttl=0"], "--assume-ttl"),
        (["--assume-ttl=nan"], "--assume-ttl=nan"),
        (["--bind-timeout=0"], "--bind-timeout=0"),
        (["--bind-timeout=nan"], "--bind-timeout=nan"),
        (["--no-such-flag"], "--no-such-flag"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = run(*args)
    assert done.returncode == 2, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_version_and_console_script() -> None:
    done = run("--version")
    assert done.returncode == 0 and done.stdout.startswith("gpu-manager-extender ")
    script = Path(sys.executable).parent / "gpu-manager-extender"
    assert script.exists(), "console script not installed"
    assert subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60).stdout == done.stdout


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiServerSimulator]:
    sim = ApiServerSimulator()
    sim.start()
    sim.add_node("n1", annotations={"tencent.com/gpu-inventory": inventory([80] * 2)})
    yield sim
    sim.stop()


def start(tmp_path: Path, api: ApiServerSimulator, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    kubeconfig = api.write_component_kubeconfig(tmp_path / "kubeconfig", "extender")
    port = free_port()
    log = open(tmp_path / "extender.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [*CMD, f"--kubeconfig={kubeconfig}", f"--listen=127.0.0.1:{port}", *extra], stdout=log, stderr=log
    )
    return proc, port


def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_ready(base: str, proc: subprocess.Popen[bytes], context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the extender exited"
        try:
            if get(f"{base}/readyz", context)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError("the extender did not become ready")


def test_process_serves_verbs_health_version_and_metrics(tmp_path: Path, api: ApiServerSimulator) -> None:
    proc, port = start(tmp_path, api, "--policy=spread", "--url-prefix=/gpu")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        assert get(f"{base}/healthz") == (200, b"ok")
        version = json.loads(get(f"{base}/version")[1])
        assert version["component"] == "gpu-manager-extender" and version["policy"] == "spread"
        pod = api.create_pod(gpu_pod("p", [(50, 20 * GIB // BLOCK)]))
        body = json.dumps({"Pod": pod, "Nodes": {"items": api.nodes()}}).encode()
        for verb in ("filter", "predicates"):  # gpu-admission's verb name works too
            req = urllib.request.Request(f"{base}/gpu/{verb}", data=body, headers={"Content-Type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=10).read())
            assert [n["metadata"]["name"] for n in answer["Nodes"]["items"]] == ["n1"]
        metrics = get(f"{base}/metrics")[1].decode()
        assert 'gpu_extender_requests_total{code="200",verb="filter"} 2.0' in metrics
        assert 'gpu_extender_decisions_total{outcome="pass",verb="filter"} 2.0' in metrics
        assert 'gpu_extender_request_duration_seconds_count{verb="filter"} 2.0' in metrics
        assert "gpu_extender_assumed_pods 0.0" in metrics and "gpu_extender_nodes 1.0" in metrics
        assert get(f"{base}/scheduler/filter")[0] == 404  # the prefix is the flag's
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is needed to make a certificate")
def test_tls(tmp_path: Path, api: ApiServerSimulator) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    proc, port = start(tmp_path, api, f"--tls-cert-file={cert}", f"--tls-private-key-file={key}")
    context = ssl.create_default_context(cafile=str(cert))
    try:
        wait_ready(f"https://127.0.0.1:{port}", proc, context)
        assert get(f"https://127.0.0.1:{port}/healthz", context) == (200, b"ok")
        with pytest.raises(urllib.error.URLError):
            get(f"https://127.0.0.1:{port}/healthz", ssl.create_default_context())  # not trusted
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_port_in_use_exits_1(tmp_path: Path, api: ApiServerSimulator) -> None:
    proc, port = start(tmp_path, api)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        second = run(f"--kubeconfig={tmp_path / 'kubeconfig'}", f"--listen=127.0.0.1:{port}")
        assert second.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in second.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_every_flag_is_documented() -> None:
    root = Path(__file__).resolve().parent.parent
    docs = (root / "docs" / "scheduling.md").read_text()
    readme = (root / "README.md").read_text()
    flags = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert flags
    for flag in flags:
        assert f"`{flag}`" in docs or f"`{flag}`," in docs, f"{flag} missing from docs/scheduling.md"
        if flag != "--version":
            assert f"`{flag}" in readme, f"{flag} missing from README.md"


def test_ipv6_listen_address(tmp_path: Path, api: ApiServerSimulator) -> None:
    kubeconfig = api.write_component_kubeconfig(tmp_path / "kubeconfig", "extender")
    port = free_port()
    proc = subprocess.Popen([*CMD, f"--kubeconfig={kubeconfig}", f"--listen=[::1]:{port}"])
    try:
        wait_ready(f"http://[::1]:{port}", proc)
        assert get(f"http://[::1]:{port}/healthz") == (200, b"ok")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
