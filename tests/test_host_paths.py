"""The test world keeps off the host's agent directories (tests/host_paths.py is the guard)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

from kubernetes import client

from gpumanager import cli
from gpumanager.config import Config
from simnode.agent_process import SPEC_DIR, AgentProcess
from simnode.cluster import SimCluster
from simnode.dra_cluster import DRACluster
from simnode.multinode import SimNode
from tests import host_paths

ROOT = Path(__file__).resolve().parent.parent
# The product's own defaults under the guarded roots: every one a harness must override.
HOST_DEFAULTS = {
    f.name: f.default
    for f in fields(Config)
    if isinstance(f.default, str) and any(Path(f.default).is_relative_to(root) for root in host_paths.GUARDED)
}


def _config(args: list[str]) -> Config:
    parsed = cli.build_parser({}).parse_args(cli.normalize_argv(args[3:]))  # after python -m gpumanager.cli
    return cli.config_from_args(parsed, {})


def _host_paths_used(config: Config) -> dict[str, str]:
    """The paths of ``config`` that lie under a guarded host root."""
    used = {name: str(getattr(config, name)) for name in HOST_DEFAULTS}
    used["dra_socket_dir"] = str(config.dra_socket_dir)
    return {
        name: value
        for name, value in used.items()
        if any(Path(value).is_relative_to(root) for root in host_paths.GUARDED)
    }


def test_the_product_defaults_are_what_the_guard_watches() -> None:
    # If these moved, the guard would watch the wrong places.
    assert {"virtual_manager_path", "checkpoint_path", "device_plugin_path", "cdi_root"} <= set(HOST_DEFAULTS)
    assert _host_paths_used(Config()).keys() == {*HOST_DEFAULTS, "dra_socket_dir"}


def test_harness_agents_get_own_dirs(tmp_path: Path) -> None:
    spec = SPEC_DIR / "t4-x1.json"
    cluster = SimCluster(tmp_path / "c", "t4-x1")  # short: socket paths have 107 bytes
    dra = DRACluster(tmp_path / "dra")
    node = SimNode("node-a", spec, tmp_path / "multi", tmp_path / "kubeconfig", client.ApiClient())
    try:
        command_lines = {
            "AgentProcess": AgentProcess(tmp_path / "plain", spec).args,
            "AgentProcess --mode=dra": AgentProcess(tmp_path / "p", spec, extra_args=["--mode=dra"]).args,
            "SimCluster": AgentProcess(cluster.workdir, spec, extra_args=cluster.agent_args()).args,
            "DRACluster": AgentProcess(dra.workdir, dra.spec, extra_args=dra.agent_args()).args,
            "SimNode": node.agent.args,
        }
        for harness, args in command_lines.items():
            assert _host_paths_used(_config(args)) == {}, harness
    finally:
        for path in (cluster.vm_path, dra.vm_path, dra.sockets_dir, node.vm_path):
            shutil.rmtree(path, ignore_errors=True)


def test_listing_sees_creation_change_and_removal(tmp_path: Path) -> None:
    root = tmp_path / "etc-gpu-manager"
    roots = (root,)
    empty = host_paths.listing(roots)
    assert empty == {}
    (root / "checkpoint").mkdir(parents=True)
    created = host_paths.listing(roots)
    assert host_paths.changes(empty, created) == [f"created {root}", f"created {root / 'checkpoint'}"]
    (root / "checkpoint" / "gpumanager_internal_checkpoint").write_text("{}")
    written = host_paths.listing(roots)
    os.utime(root / "checkpoint" / "gpumanager_internal_checkpoint", ns=(1, 1))
    assert f"changed {root / 'checkpoint' / 'gpumanager_internal_checkpoint'}" in host_paths.changes(
        written, host_paths.listing(roots)
    )
    shutil.rmtree(root / "checkpoint")
    assert f"removed {root / 'checkpoint'}" in host_paths.changes(written, host_paths.listing(roots))


def _run_pytest(tmp_path: Path, test_source: str) -> subprocess.CompletedProcess[str]:
    guarded = tmp_path / "guarded"
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_inner.py").write_text(textwrap.dedent(test_source).replace("GUARDED", str(guarded)))
    env = {**os.environ, "HOST_PATHS_GUARDED": str(guarded)}
    plugins = ["-p", "tests.host_paths", "-p", "no:cacheprovider", "-p", "no:cloudcoil"]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *plugins, str(tmp_path / "inner")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_guard_fails_the_test_that_writes_under_a_guarded_path(tmp_path: Path) -> None:
    done = _run_pytest(
        tmp_path,
        """
        from pathlib import Path

        def test_writes_checkpoint():
            Path("GUARDED/checkpoint").mkdir(parents=True)

        def test_keeps_off():
            pass
        """,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ERROR at teardown of test_writes_checkpoint" in done.stdout
    assert f"created {tmp_path / 'guarded' / 'checkpoint'}" in done.stdout
    assert "2 passed, 1 error" in done.stdout


def test_guard_fails_the_session_when_a_path_changes_outside_any_test(tmp_path: Path) -> None:
    done = _run_pytest(
        tmp_path,
        """
        from pathlib import Path

        import pytest

        @pytest.fixture(scope="session")
        def leaves_a_file():
            yield
            Path("GUARDED").mkdir()

        def test_uses_it(leaves_a_file):
            pass
        """,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the test session changed" in done.stdout and "1 passed" in done.stdout
