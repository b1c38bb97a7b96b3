"""The DaemonSets mount every host path the agent opens in their mode, where the agent's flags
(as each manifest sets them) put it."""

from __future__ import annotations

import re
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from gpumanager import cli, names
from gpumanager.config import Config
from tests.test_rbac_review import DEPLOY, RENDER, ROOT

JSON = dict[str, Any]


def _image_command(env: dict[str, str]) -> list[str]:
    """The image's CMD (a shell line) with the container's environment put in."""
    text = (ROOT / "Dockerfile").read_text()
    line = re.search(r'^CMD \["/bin/sh", "-c", "(.*)"\]$', text, re.M)
    assert line is not None
    expanded = re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), line.group(1))
    return shlex.split(expanded)


def _config(container: JSON) -> Config:
    env = {e["name"]: e.get("value", "node-a") for e in container.get("env") or []}
    argv = [*container.get("command", []), *container.get("args", [])] or _image_command(env)
    assert argv[0] in ("gpu-manager", "exec") or argv[:2] == ["exec", "gpu-manager"], argv
    flags = argv[argv.index("gpu-manager") + 1 :]
    parsed = cli.build_parser(env).parse_args(cli.normalize_argv(flags))
    return cli.config_from_args(parsed, env)


def _daemonset(docs: list[JSON]) -> JSON:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


def _mounts(ds: JSON) -> dict[str, tuple[str, bool]]:
    """mountPath -> (host path, read-only) of the agent's container."""
    spec = ds["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    out = {}
    for m in container["volumeMounts"]:
        host = volumes[m["name"]].get("hostPath")
        if host is not None:
            out[m["mountPath"].rstrip("/") or "/"] = (host["path"], bool(m.get("readOnly")))
    return out


def _where(mounts: dict[str, tuple[str, bool]], path: str) -> tuple[str, str, bool] | None:
    """(mountPath, host path of ``path``, read-only) of the mount holding ``path``, None when none does."""
    p = PurePosixPath(path)
    best = max((m for m in mounts if p.is_relative_to(m)), key=len, default=None)
    if best is None:
        return None
    host, ro = mounts[best]
    return best, str(PurePosixPath(host) / p.relative_to(best)), ro


def _check(ds: JSON, cfg: Config, paths: dict[str, tuple[str, bool, bool]]) -> None:
    """``paths``: what -> (path in the container, written, must be the same path on the host)."""
    mounts = _mounts(ds)
    problems = []
    for what, (path, written, same) in paths.items():
        found = _where(mounts, path)
        if found is None or found[0] == "/":
            problems.append(f"{what} {path}: no host path is mounted there")
            continue
        _mount, host, ro = found
        if written and ro:
            problems.append(f"{what} {path}: mounted read-only")
        if same and PurePosixPath(host) != PurePosixPath(path):
            problems.append(f"{what} {path}: the host's path is {host}, not the same")
    assert ds["spec"]["template"]["spec"].get("hostPID") is True, "pids.config and /proc need the host's PIDs"
    assert not problems, problems


def _common(cfg: Config) -> dict[str, tuple[str, bool, bool]]:
    return {
        "--virtual-manager-path": (cfg.virtual_manager_path, True, True),
        "--checkpoint-path": (cfg.checkpoint_path, True, False),
        "driver mirror (vdriver)": ("/etc/gpu-manager/vdriver", True, True),
        "--nvml-lib": (cfg.nvml_lib, False, False),
        "--cgroup-root": (cfg.cgroup_root, False, False),
        "--driver-root": (cfg.driver_root, False, False),
        # connected to only: connect(2) to a socket on a read-only mount works
        "--pod-resources-socket": (cfg.pod_resources_socket, False, False),
        "the kubelet's checkpoint": (str(Path(cfg.device_plugin_path) / names.KUBELET_CHECKPOINT), False, False),
        "--display-socket": (cfg.display_socket, True, False),
        **({"--log-dir": (cfg.log_dir, True, False)} if cfg.log_dir else {}),
    }


@pytest.mark.parametrize("values", [{}, {"logDir": "/var/log/gpu-manager"}])
def test_chart_daemonset_mounts_what_the_device_plugin_agent_opens(values: JSON) -> None:
    ds = _daemonset(RENDER["documents"](values))
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    cfg = _config(container)
    assert cfg.mode != "dra"
    _check(ds, cfg, {**_common(cfg), "--device-plugin-path": (cfg.device_plugin_path, True, False)})


def test_dra_daemonset_mounts_what_the_dra_agent_opens() -> None:
    ds = _daemonset([d for d in yaml.safe_load_all((DEPLOY / "dra" / "daemonset.yaml").read_text()) if d])
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    cfg = _config(container)
    assert cfg.mode == "dra"
    _check(
        ds,
        cfg,
        {
            **_common(cfg),
            "--plugin-registry-path": (cfg.plugin_registry_path, True, False),
            "--dra-plugin-path": (str(cfg.dra_socket_dir), True, False),
            "--cdi-root": (cfg.cdi_root, True, False),
        },
    )


def _ports_agree(docs: list[JSON], port: int) -> None:
    """The container port named metrics, the probes, the Service and its scrape annotation are ``port``."""
    ds = _daemonset(docs)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert named == {"metrics": port}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] in ("metrics", port), probe
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (sp,) = service["spec"]["ports"]
    assert sp["port"] == port and sp["targetPort"] in ("metrics", port)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("port", [5678, 9400])
def test_chart_ports_follow_the_query_port(port: int) -> None:
    docs = RENDER["documents"]({"port": port})
    (container,) = _daemonset(docs)["spec"]["template"]["spec"]["containers"]
    assert _config(container).query_port == port
    _ports_agree(docs, port)


def test_dra_ports_follow_the_query_port() -> None:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "dra" / "daemonset.yaml").read_text()) if d]
    (container,) = _daemonset(docs)["spec"]["template"]["spec"]["containers"]
    _ports_agree(docs, _config(container).query_port)


def test_extender_ports_follow_its_listen_flag() -> None:
    from gpumanager.extender.cli import build_parser

    docs = [d for d in yaml.safe_load_all((DEPLOY / "extender.yaml").read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    parsed = build_parser().parse_args(container["args"])
    port = int(parsed.listen.rpartition(":")[2])
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": port}
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (sp,) = service["spec"]["ports"]
    assert sp["port"] == port and sp["targetPort"] in ("http", port)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for name in ("gpu-scheduler.yaml", "default-scheduler.yaml"):
        config = yaml.safe_load((DEPLOY / "scheduler" / name).read_text())
        (ext,) = config["extenders"]
        assert ext["urlPrefix"].endswith(f":{port}{parsed.url_prefix}"), (name, ext["urlPrefix"])


MOVED = {
    "checkpoint-path": "/var/lib/gpu-manager/checkpoint",
    "virtual_manager_path": "/var/lib/gpu-manager/vm",
    "device-plugin-path": "/var/lib/k8s/kubelet/device-plugins/",
    "pod-resources-socket": "/var/lib/k8s/kubelet/pod-resources/kubelet.sock",
}


def test_chart_mounts_the_directories_its_flags_move() -> None:
    # `flags` takes any flag: one that moves a host directory must move its mount, else the agent
    # writes its checkpoint into the container (lost on restart) or serves where the kubelet never looks
    ds = _daemonset(RENDER["documents"]({"flags": MOVED}))
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    cfg = _config(container)
    assert cfg.checkpoint_path == MOVED["checkpoint-path"]
    _check(ds, cfg, {**_common(cfg), "--device-plugin-path": (cfg.device_plugin_path, True, True)})


def test_chart_refuses_dra_mode() -> None:
    # DRA mode needs other RBAC and mounts: deploy/dra/daemonset.yaml; the chart must not half-do it
    with pytest.raises(Exception, match=r"deploy/dra/daemonset\.yaml"):
        RENDER["documents"]({"flags": {"mode": "dra"}})
