"""What the shipped DaemonSets give the agent beyond what it uses: every host path mounted
read-write is one the agent writes in (as its flags, as each manifest sets them, put it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from gpumanager import cli
from gpumanager.config import Config
from tests.test_rbac_review import DEPLOY, RENDER
from tests.test_rbac_review_mounts import MOVED, _config, _daemonset, _mounts, _ports_agree

JSON = dict[str, Any]
#: The driver mirror's base, as the image's volume.conf names it.
VDRIVER = "/etc/gpu-manager/vdriver"


def _written_dirs(cfg: Config) -> dict[str, str]:
    """directory the agent creates files or sockets in -> the flag that puts it there."""
    dirs = {
        cfg.virtual_manager_path: "--virtual-manager-path",
        cfg.checkpoint_path: "--checkpoint-path",
        VDRIVER: "the driver mirror (vdriver)",
        str(PurePosixPath(cfg.display_socket).parent): "--display-socket",
    }
    if cfg.log_dir:
        dirs[cfg.log_dir] = "--log-dir"
    if cfg.mode == "dra":
        dirs[cfg.plugin_registry_path] = "--plugin-registry-path"
        dirs[str(cfg.dra_socket_dir)] = "--dra-plugin-path"
        dirs[cfg.cdi_root] = "--cdi-root"
    else:
        dirs[cfg.device_plugin_path] = "--device-plugin-path"
    return {str(PurePosixPath(d)): what for d, what in dirs.items()}


def _writable_beyond_use(ds: JSON) -> list[str]:
    """Read-write host mounts that are not a directory the agent writes in, nor one holding such a
    directory directly with the socket whose inode must survive (/var/run, as upstream mounts it)."""
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    cfg = _config(container)
    written = _written_dirs(cfg)
    extra = []
    for path, (host, ro) in _mounts(ds).items():
        if not ro and str(PurePosixPath(path)) not in written:
            extra.append(f"{path} (host {host}) is mounted read-write; the agent writes in {sorted(written)}")
    return extra


def _dra() -> JSON:
    return _daemonset([d for d in yaml.safe_load_all((DEPLOY / "dra" / "daemonset.yaml").read_text()) if d])


@pytest.mark.parametrize(
    "values", [{}, {"logDir": "/var/log/gpu-manager"}, {"flags": MOVED}, {"paths": {"hostRoot": "/host"}}]
)
def test_chart_mounts_read_write_only_what_the_agent_writes(values: JSON) -> None:
    assert _writable_beyond_use(_daemonset(RENDER["documents"](values))) == []


def test_dra_mounts_read_write_only_what_the_agent_writes() -> None:
    # the PodResources socket is only connected to; the kubelet's plugins directory holds other
    # drivers' sockets (CSI, other DRA drivers): only this driver's own directory is written
    assert _writable_beyond_use(_dra()) == []


def test_dra_pod_resources_is_read_only() -> None:
    (container,) = _dra()["spec"]["template"]["spec"]["containers"]
    cfg = _config(container)
    mounts = _mounts(_dra())
    at = str(PurePosixPath(cfg.pod_resources_socket).parent)
    assert at in mounts, f"{at} is not mounted"
    assert mounts[at][1], f"{at} is mounted read-write"


@pytest.mark.parametrize("flags", [{"query-port": 9400}, {"query_port": 9400}])
def test_chart_ports_follow_a_query_port_set_in_flags(flags: JSON) -> None:
    # flags come last on the command line: the agent listens there, so the probes, the container
    # port and the Service must too, or the liveness probe restarts the agent over and over
    docs = RENDER["documents"]({"flags": flags})
    (container,) = _daemonset(docs)["spec"]["template"]["spec"]["containers"]
    port = _config(container).query_port
    assert port == 9400
    _ports_agree(docs, port)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "10.0.0.5"])
def test_chart_refuses_a_query_addr_the_probes_cannot_reach(addr: str) -> None:
    # the kubelet probes and Prometheus scrapes the pod's IP: an agent on another address is never ready
    with pytest.raises(Exception, match=rf"query-addr={addr}"):
        RENDER["documents"]({"flags": {"query-addr": addr}})


@pytest.mark.parametrize("addr", ["0.0.0.0", "::"])
def test_chart_takes_a_query_addr_of_every_address(addr: str) -> None:
    (container,) = _daemonset(RENDER["documents"]({"flags": {"query-addr": addr}}))["spec"]["template"]["spec"][
        "containers"
    ]
    assert _config(container).query_addr == addr


@pytest.mark.parametrize(
    ("values", "flag", "expected"),
    [
        ({"flags": {"query-addr": "::"}}, "query_addr", "::"),
        ({"flags": {"hostname-override": "gpu-node-1 #a"}}, "hostname_override", "gpu-node-1 #a"),
        ({"flags": {"log-dir": "/var/log/gpu: manager"}}, "log_dir", "/var/log/gpu: manager"),
        ({"logDir": "/var/log/gpu #manager"}, "log_dir", "/var/log/gpu #manager"),
    ],
)
def test_chart_args_are_the_values_whatever_yaml_makes_of_them(values: JSON, flag: str, expected: str) -> None:
    # an unquoted "--x=::" is a YAML mapping, " #..." a comment: the agent got another value or none
    (container,) = _daemonset(RENDER["documents"](values))["spec"]["template"]["spec"]["containers"]
    assert all(isinstance(a, str) for a in container["args"]), container["args"]
    parsed = cli.build_parser().parse_args(cli.normalize_argv(container["args"]))
    assert getattr(parsed, flag) == expected


def test_dra_daemonset_tolerates_the_gpu_node_taints_the_chart_tolerates() -> None:
    # GKE and the GPU Operator taint GPU nodes nvidia.com/gpu:NoSchedule: a DRA-mode node is one of
    # them, and without the toleration the agent never lands there (no slice, no claim prepared)
    chart = _daemonset(RENDER["documents"]({}))["spec"]["template"]["spec"]["tolerations"]
    dra = _dra()["spec"]["template"]["spec"]["tolerations"]
    assert [t for t in chart if t not in dra] == []


@pytest.mark.parametrize("surge", [1, "10%"])
def test_chart_refuses_a_surge_rolling_update(surge: int | str) -> None:
    # a surge pod waits for the old agent's node lock without serving: never ready, so the old pod is
    # never replaced and the rollout hangs with the surge pod restarted by its liveness probe
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": surge}}
    with pytest.raises(Exception, match=rf"updateStrategy.rollingUpdate.maxSurge={surge}"):
        RENDER["documents"]({"updateStrategy": strategy})


@pytest.mark.parametrize("surge", [0, "0%"])
def test_chart_takes_no_surge(surge: int | str) -> None:
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 2, "maxSurge": surge}}
    ds = _daemonset(RENDER["documents"]({"updateStrategy": strategy}))
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 2


def test_chart_takes_on_delete_updates() -> None:
    ds = _daemonset(RENDER["documents"]({"updateStrategy": {"type": "OnDelete", "rollingUpdate": None}}))
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}


# -- the plain alerts with the plain scrape job: it scrapes the DRA agents under job="gpu-manager" too --

RULES = DEPLOY / "prometheus" / "gpu-manager.rules.yaml"


def _targets_missing_expr() -> str:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "GPUManagerTargetsMissing":
                return str(rule["expr"])
    raise AssertionError("no GPUManagerTargetsMissing in " + str(RULES))


def _desired(daemonset: str, n: int) -> JSON:
    labels = f'namespace="kube-system",daemonset="{daemonset}",job="kube-state-metrics"'
    return {"series": f"kube_daemonset_status_desired_number_scheduled{{{labels}}}", "values": f"{n}x15"}


def _up(*instances: str) -> list[JSON]:
    return [{"series": f'up{{job="gpu-manager",instance="{i}:5678"}}', "values": "1x15"} for i in instances]


@pytest.mark.parametrize(
    ("series", "missing"),
    [
        # one DRA agent gone in a cluster that runs both modes: the others made up for it
        ([_desired("gpu-manager-daemonset", 2), _desired("gpu-manager-dra", 2), *_up("a", "b", "c")], 1),
        # DRA mode only (no device-plugin DaemonSet): one of two agents gone
        ([_desired("gpu-manager-dra", 2), *_up("c")], 1),
        ([_desired("gpu-manager-daemonset", 2), _desired("gpu-manager-dra", 2), *_up("a", "b", "c", "d")], 0),
        ([_desired("gpu-manager-daemonset", 2), *_up("a")], 1),
    ],
)
def test_plain_targets_missing_counts_the_dra_daemonset(tmp_path: Path, series: list[JSON], missing: int) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (`make test` installs Debian's prometheus package)")
    samples = [{"labels": "{}", "value": missing}] if missing else []
    test = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [{"expr": _targets_missing_expr(), "eval_time": "10m", "exp_samples": samples}],
            }
        ],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(test))
    done = subprocess.run([promtool, "test", "rules", "t.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_chart_refuses_an_other_daemonset_that_is_no_name() -> None:
    with pytest.raises(Exception, match=r'prometheusRule\.otherDaemonSets: "gpu\.manager\|x"'):
        RENDER["documents"]({"prometheusRule": {"enabled": True, "otherDaemonSets": ["gpu.manager|x"]}})


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"checkpoint-path": "/usr/local/host/var/lib/gpu-manager"}, "--checkpoint-path"),
        ({"log-dir": "/usr/local/host/var/log/gpu-manager"}, "--log-dir"),
        ({"display-socket": "/usr/local/host/run/gpu-manager.sock"}, "--display-socket"),
        ({"device-plugin-path": "/usr/local/host/var/lib/kubelet/device-plugins"}, "--device-plugin-path"),
    ],
)
def test_chart_refuses_a_host_directory_inside_the_host_root(flags: JSON, named: str) -> None:
    # the host's / is mounted read-only at paths.hostRoot: a mount inside it needs its mount point made
    # in that read-only view (the container does not start), and its host path is not the one meant
    with pytest.raises(Exception, match=rf"{named}.*paths\.hostRoot"):
        RENDER["documents"]({"flags": flags})


def test_chart_refuses_one_flag_under_two_spellings() -> None:
    # both reach the command line; the agent takes the later (query_port), the chart's mounts and
    # ports followed the other: name both instead of choosing
    with pytest.raises(Exception, match=r"flags: query-port and query_port are one flag"):
        RENDER["documents"]({"flags": {"query-port": 9400, "query_port": 9500}})


@pytest.mark.parametrize("flags", [{"query-port": 0}, {"query_port": "0"}])
def test_chart_refuses_a_query_port_of_any_port(flags: JSON) -> None:
    # port 0: the agent listens on a port of the kernel's choosing, which no probe or Service knows
    with pytest.raises(Exception, match=r"flags\.query.port=0"):
        RENDER["documents"]({"flags": flags})
