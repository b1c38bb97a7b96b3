"""The agent's background start, when what it waits for is not there.

In DRA mode the start waited ``--wait-timeout`` for its own ``dra.sock`` and then raised an exit
error in the background start thread, which caught it as "background start failed; the device
plugin goes on serving" with a traceback: no exit, no device plugin, and nothing said when the
kubelet never registered the driver. Now the driver keeps serving its sockets; when the kubelet has
not registered it ``--wait-timeout`` after they were served, one line says so, naming the
registration socket, and /healthz and /readyz report it until the kubelet registers the driver.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simnode.dra_cluster import DRIVER, NODE, DRACluster
from simnode.dra_kubelet import DRAKubeletSimulator

JSON = dict[str, Any]


def probe(port: int, path: str) -> tuple[int, JSON]:
    """(status, body) of one of the agent's probes."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_probe(port: int, path: str, check: Any, timeout: float = 30.0) -> tuple[int, JSON]:
    """Poll ``path`` until ``check(status, body)``; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = probe(port, path)
        except OSError:  # the HTTP server is not listening yet
            status, body = 0, {}
        if check(status, body) or time.monotonic() > deadline:
            return status, body
        time.sleep(0.05)


@pytest.fixture
def no_kubelet_node(tmp_path: Path, sim_built: Path) -> Iterator[DRACluster]:
    """A DRA node whose kubelet is not running yet (``cluster.kubelet.start()`` starts it)."""
    cluster = DRACluster(tmp_path / "node", "t4-x1", agent_flags=["--wait-timeout=1s"])
    cluster.start_api()
    cluster.kubelet = DRAKubeletSimulator(
        registry_dir=cluster.registry_dir, api_client=cluster.client, node=NODE, cdi_dirs=[cluster.cdi_root]
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_dra_driver_the_kubelet_does_not_register_says_so_and_waits(no_kubelet_node: DRACluster) -> None:
    c = no_kubelet_node
    agent = c.start_agent(wait=False)
    reg_sock = c.registry_dir / f"{DRIVER}-reg.sock"
    text = agent.wait_for_log("not registered with the kubelet", timeout=30)
    line = next(x for x in text.splitlines() if "not registered with the kubelet" in x)
    assert str(reg_sock) in line and "--wait-timeout=1s" in line, line
    assert agent.proc is not None and agent.proc.poll() is None, "the agent exited"
    assert "Traceback" not in text and "background start failed" not in text, text
    assert "device-plugin server" not in text and "tencent.com/vcuda-core=" not in text, text

    status, ready = wait_probe(agent.query_port, "/readyz", lambda s, b: "dra-registration" in b.get("errors", {}))
    assert status == 503
    assert str(reg_sock) in ready["errors"]["dra-registration"]
    assert str(reg_sock) in ready["missing"]["registered"], ready["missing"]
    status, health = probe(agent.query_port, "/healthz")
    assert status == 200 and "dra-registration" in health["errors"], health

    # The kubelet comes: it registers the driver, which was served all along.
    assert c.kubelet is not None
    c.kubelet.start()
    c.kubelet.wait_registered(DRIVER, timeout=30)
    status, ready = wait_probe(agent.query_port, "/readyz", lambda s, b: s == 200)
    assert status == 200, ready
    assert "dra-registration" not in ready["errors"]
    assert agent.log_text().count("not registered with the kubelet") == 1


def _help(flag: str) -> str:
    from gpumanager import flagspec
    from gpumanager.config import Config

    return next(f.spec.help for f in flagspec.flag_fields(Config) if f.flag == flag)


def test_wait_timeout_help_says_what_the_flag_does_in_each_mode() -> None:
    """Device-plugin mode waits for nothing (its sockets listen when the start returns, and the kubelet's
    absence is retried and reported at once); DRA mode waits for the kubelet's registration."""
    text = _help("--wait-timeout")
    assert "own gRPC servers" not in text, text
    assert "accepted for compatibility" in text and "device-plugin mode" in text, text
    assert "--mode=dra" in text and "register" in text and "never exits" in text, text
