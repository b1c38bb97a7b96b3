"""DRA mode's socket directories, when they cannot be served.

``--dra-plugin-path`` or ``--plugin-registry-path`` naming a file (or a directory that cannot be made)
ended in the background start as "background start failed; the device plugin goes on serving" with a
FileExistsError traceback, while the agent went on without its DRA sockets and nothing said which flag
was wrong. They are now checked at start with the other directories (exit 2, one line naming the flag
and the path), as device-plugin mode's --device-plugin-path is; one that breaks between that check and
the serving is one line naming both sockets, reported on /readyz, and the agent keeps running.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from simnode.agent_process import vm_path_for
from simnode.dra_cluster import DRACluster
from tests.test_app_start_followups import no_kubelet_node, probe, wait_probe

__all__ = ["no_kubelet_node"]


@pytest.mark.parametrize("flag", ["--dra-plugin-path", "--plugin-registry-path"])
def test_a_dra_socket_directory_that_is_a_file_exits_2_naming_the_flag(no_kubelet_node: DRACluster, flag: str) -> None:
    c = no_kubelet_node
    directory = c.plugin_dir if flag == "--dra-plugin-path" else c.registry_dir
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.write_text("not a directory\n")
    agent = c.start_agent(wait=False)
    assert agent.wait(30) == 2
    text = agent.log_text()
    assert "Traceback" not in text and "background start failed" not in text, text
    assert f"{flag}={directory}: exists and is not a directory" in text, text


def test_a_dra_socket_directory_broken_after_the_start_is_one_line_and_reported(no_kubelet_node: DRACluster) -> None:
    c = no_kubelet_node
    agent = c.start_agent(wait=False, env={"GPU_MANAGER_STALL_AT": "start-dra:3"})
    agent.wait_for_log("stalling 3 s at start-dra", timeout=30)
    shutil.rmtree(c.plugin_dir, ignore_errors=True)
    c.plugin_dir.parent.mkdir(parents=True, exist_ok=True)
    c.plugin_dir.write_text("not a directory\n")
    text = agent.wait_for_log("cannot serve the DRA driver", timeout=30)
    assert "Traceback" not in text and "background start failed" not in text, text
    line = next(x for x in text.splitlines() if "cannot serve the DRA driver" in x)
    assert str(c.plugin_dir) in line and "--dra-plugin-path" in line, line
    status, ready = wait_probe(agent.query_port, "/readyz", lambda s, b: "dra" in b.get("errors", {}))
    assert status == 503 and "cannot serve the DRA driver" in ready["missing"]["registered"], ready
    assert "waiting for the kubelet" not in ready["missing"]["registered"], ready
    status, health = probe(agent.query_port, "/healthz")
    assert "dra" in health["errors"], health
    assert agent.proc is not None and agent.proc.poll() is None, "the agent exited"


@pytest.mark.parametrize("mode", ["device-plugin", "dra"])
def test_an_unexpected_error_of_the_background_start_is_reported_in_the_mode_s_words(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug in a later step (not an operator's error) keeps its traceback, but the line does not speak of a
    device plugin in DRA mode, and /healthz and /readyz carry it (they said nothing)."""
    from gpumanager import cli
    from gpumanager.app import Agent
    from gpumanager.metrics.endpoints import agent_probes

    args = cli.build_parser({}).parse_args(
        [f"--mode={mode}", f"--checkpoint-path={tmp_path}", f"--virtual-manager-path={vm_path_for(tmp_path)}"]
    )
    agent = Agent(cli.config_from_args(args, {}))

    def boom() -> None:
        raise ValueError("a bug")

    for step in ("_start_dra_slices", "_start_allocation", "_start_mirror", "_start_loops", "_label_node"):
        setattr(agent, step, lambda: None)
    agent._start_query = boom  # type: ignore[method-assign]
    agent._start_kube = lambda: None  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="gpumanager.app"):
        agent._start_background()
    assert agent.ready.is_set()
    line = next(r.getMessage() for r in caplog.records if r.exc_info)
    assert "a bug" in line and ("device plugin" in line) == (mode == "device-plugin"), line
    ok, body = agent_probes(agent).readyz()
    missing, errors = body["missing"], agent_probes(agent).healthz()[1]["errors"]
    assert isinstance(missing, dict) and isinstance(errors, dict)
    assert not ok and "a bug" in missing["start"] and "a bug" in errors["start"], body
