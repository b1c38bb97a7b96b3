"""The deployable agent: the manifests, the image's command line and its build steps."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from gpumanager.cli import build_parser, config_from_args, normalize_argv

REPO = Path(__file__).resolve().parent.parent


def manifests() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((REPO / "deploy/daemonset.yaml").read_text()))
    return {doc["kind"]: doc for doc in docs if doc}


def test_daemonset_as_upstream_plus_probes_and_gpu_taints() -> None:
    ds = manifests()["DaemonSet"]
    assert ds["metadata"]["namespace"] == "kube-system"
    assert ds["spec"]["selector"]["matchLabels"] == {"name": "gpu-manager-ds"}
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True and pod["priorityClassName"] == "system-node-critical"
    assert pod["serviceAccountName"] == "gpu-manager"
    assert pod["nodeSelector"] == {"nvidia-device-enable": "enable"}
    assert {t["key"] for t in pod["tolerations"]} == {"CriticalAddonsOnly", "tencent.com/vcuda-core", "nvidia.com/gpu"}
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["ports"] == [{"name": "metrics", "containerPort": 5678, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    volumes = {v["name"]: v["hostPath"] for v in pod["volumes"]}
    mounts = {m["mountPath"]: (volumes[m["name"]]["path"], m.get("readOnly", False)) for m in container["volumeMounts"]}
    assert mounts == {
        "/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),
        "/etc/gpu-manager/vdriver": ("/etc/gpu-manager/vdriver", False),
        "/etc/gpu-manager/vm": ("/etc/gpu-manager/vm", False),
        "/etc/gpu-manager/checkpoint": ("/etc/gpu-manager/checkpoint", False),
        "/var/run": ("/var/run", False),
        "/sys/fs/cgroup": ("/sys/fs/cgroup", True),
        "/usr/local/host": ("/", True),
    }
    assert volumes["pod-resources"]["type"] == "Directory"


def test_rbac_is_least_privilege() -> None:
    docs = manifests()
    rules = {(tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in docs["ClusterRole"]["rules"]}
    assert rules == {(("pods",), ("delete", "list", "patch", "watch")), (("nodes",), ("patch",))}
    binding = docs["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "gpu-manager" != "cluster-admin"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpu-manager", "namespace": "kube-system"}]
    meta = docs["ServiceAccount"]["metadata"]
    assert (meta["name"], meta["namespace"], meta["labels"]["name"]) == ("gpu-manager", "kube-system", "gpu-manager-ds")


def test_metrics_service() -> None:
    svc = manifests()["Service"]
    assert svc["metadata"]["name"] == "gpu-manager-metric"
    assert svc["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {"name": "gpu-manager-ds"}
    assert svc["spec"]["ports"][0]["name"] == "metrics" and svc["spec"]["ports"][0]["port"] == 5678


def image_command() -> list[str]:
    text = (REPO / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))  # type: ignore[union-attr]
    assert cmd[:2] == ["/bin/sh", "-c"]
    words = shlex.split(cmd[2])
    assert words[:2] == ["exec", "gpu-manager"]
    return words[2:]


def test_image_command_is_accepted_by_the_agent() -> None:
    flags = image_command()
    assert flags[-1] == "${EXTRA_FLAGS}"
    expanded = [f.replace("${LOG_LEVEL}", "2").replace("${NODE_NAME}", "node-1") for f in flags[:-1]]
    args = build_parser().parse_args(normalize_argv(expanded))
    config = config_from_args(args, {"NODE_NAME": "node-1"})
    assert config.share_mode is True
    assert config.volume_config == "/etc/gpu-manager/volume.conf"
    assert config.extra_config == "/etc/gpu-manager/extra-config.json"
    assert config.query_addr == "0.0.0.0"
    assert config.driver_root == "/usr/local/host"
    assert config.vcuda_library == "/usr/local/lib/gpu-manager/libcuda-control.so"
    assert config.hostname_override == "node-1"


def test_daemonset_command_is_accepted_by_the_agent_and_writes_no_log_file() -> None:
    (container,) = manifests()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["gpu-manager"]
    config = config_from_args(build_parser().parse_args(normalize_argv(container["args"])), {"NODE_NAME": "node-1"})
    image = config_from_args(
        build_parser().parse_args(
            normalize_argv(
                [f.replace("${LOG_LEVEL}", "2").replace("${NODE_NAME}", "node-1") for f in image_command()[:-1]]
            )
        ),
        {"NODE_NAME": "node-1"},
    )
    # The image's own command and the DaemonSet's agree on everything but the log file.
    for field in (
        "share_mode",
        "volume_config",
        "extra_config",
        "query_addr",
        "driver_root",
        "vcuda_library",
        "nvml_lib",
    ):
        assert getattr(config, field) == getattr(image, field), field
    assert config.resolved_node_name() == "node-1"
    assert config.log_dir == "" and config.logtostderr is True


def test_image_installs_what_the_command_names() -> None:
    script = (REPO / "scripts/image-build-steps.sh").read_text()
    assert "LIBDIR=$PREFIX/usr/local/lib/gpu-manager" in script
    assert "CONFDIR=$PREFIX/etc/gpu-manager" in script and "VENV=$PREFIX/opt/gpu-manager" in script
    dockerfile = (REPO / "Dockerfile").read_text()
    for path in ("/opt/gpu-manager", "/usr/local/lib/gpu-manager", "/etc/gpu-manager"):
        assert f"COPY --from=build {path} {path}" in dockerfile
