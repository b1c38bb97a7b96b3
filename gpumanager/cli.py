"""Command line: gpu-manager v1.1 flags (same names and meaning) plus our own, logging, signals, exit codes.

Exit codes: 0 after a clean stop (SIGTERM/SIGINT), 2 for invalid flags or
configuration, 3 when NVML cannot be used (no driver, or a broken node spec
on the simulated node).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from gpumanager import __version__, names
from gpumanager.config import Config, ConfigError

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_NVML = 3


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "y", "on"):
        return True
    if value in ("0", "f", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean")


def _duration(text: str) -> float:
    """Seconds, or a Go duration such as 500ms, 5s, 1m, 1h."""
    value = text.strip()
    for suffix, scale in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if value.endswith(suffix) and value[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(value[: -len(suffix)]) * scale
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 30s, 5m)") from None


def _xids(text: str) -> tuple[int, ...]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        return tuple(sorted({int(t) for t in items}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of XID numbers") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (flag names as gpu-manager's; ``_`` and ``-`` are interchangeable)."""
    d = Config()
    p = argparse.ArgumentParser(
        prog="gpu-manager",
        description="Share NVIDIA GPUs between Kubernetes containers (tencent.com/vcuda-core, vcuda-memory).",
    )
    flag = p.add_argument
    flag("--driver", default=d.driver, help="GPU driver family (only 'nvidia')")
    flag("--extra-config", default=d.extra_config, help="extra config JSON file")
    flag("--volume-config", default=d.volume_config, help="volume.conf describing the driver mirror")
    flag("--query-port", type=int, default=d.query_port, help="HTTP port (default %(default)s)")
    flag("--query-addr", default=d.query_addr, help="HTTP bind address (default %(default)s)")
    flag("--kubeconfig", default=d.kubeconfig, help="kubeconfig file; empty means in-cluster")
    flag("--sample-period", type=int, default=d.sample_period, help="GPU utilisation sample window, seconds")
    flag("--node-labels", default=d.node_labels, help="k=v,k2=v2 labels for this node")
    flag("--hostname-override", default=d.hostname_override, help="node name (default: $NODE_NAME, else hostname)")
    flag("--virtual-manager-path", default=d.virtual_manager_path, help="per-pod directories")
    flag("--device-plugin-path", default=d.device_plugin_path, help="kubelet device-plugin directory")
    flag("--checkpoint-path", default=d.checkpoint_path, help="directory of our own checkpoint")
    flag("--share-mode", type=_bool, nargs="?", const=True, default=d.share_mode, help="allow vcuda-core < 100")
    flag("--allocation-check-period", type=int, default=d.allocation_check_period, help="seconds")
    flag(
        "--container-runtime-endpoint",
        default=d.container_runtime_endpoint,
        help="accepted for compatibility; container names come from the pod status instead",
    )
    flag(
        "--cgroup-driver",
        default=d.cgroup_driver,
        help="accepted for compatibility: both cgroupfs and systemd layouts are found automatically",
    )
    flag(
        "--runtime-request-timeout",
        type=_duration,
        default=d.runtime_request_timeout,
        help="accepted for compatibility; no container runtime is called",
    )
    flag("--wait-timeout", type=_duration, default=d.wait_timeout, help="max wait for our servers at start, e.g. 1m")
    flag("--display-socket", default=d.display_socket, help="display gRPC socket (default %(default)s)")
    flag("--pod-resources-socket", default=d.pod_resources_socket, help="kubelet PodResources socket")
    flag("--nvml-lib", default=d.nvml_lib, help="path of libnvidia-ml.so.1 (default: the linker's choice)")
    flag("--cgroup-root", default=d.cgroup_root, help="where the cgroup hierarchy is mounted (v1 or v2)")
    flag(
        "--driver-root", default=d.driver_root, help="root of the host's driver files (the image uses /usr/local/host)"
    )
    flag("--vcuda-library", default=d.vcuda_library, help="the interceptor swapped in for shared containers")
    flag(
        "--ignored-xids",
        type=_xids,
        default=d.ignored_xids,
        help="XIDs that do not make a GPU unhealthy (default %(default)s)",
    )
    flag(
        "--health-quiet-period",
        type=_duration,
        default=d.health_quiet_period,
        help="error-free time before an unhealthy GPU is healthy again (default 5m)",
    )
    flag("--health-probe-period", type=_duration, default=d.health_probe_period, help="GPU probe interval")
    flag(
        "--kubelet-watch-period",
        type=_duration,
        default=d.kubelet_watch_period,
        help="how often the kubelet socket is checked for a restart (default 100ms)",
    )
    # klog-compatible logging flags.
    flag("--v", type=int, default=0, help="log verbosity (>= 4 logs debug messages)")
    flag("--logtostderr", type=_bool, nargs="?", const=True, default=True, help="log to stderr")
    flag("--alsologtostderr", type=_bool, nargs="?", const=True, default=False, help="klog compatibility")
    flag("--log-dir", default="", help="also write gpu-manager.log in this directory")
    flag("--version", nargs="?", const="short", default=None, help="print the version and exit")
    return p


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Make ``--share_mode=true`` mean ``--share-mode=true``, as gpu-manager's flag library does."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            arg = "--" + name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    """Build and validate the Config; raise ConfigError on a bad value."""
    env = os.environ if environ is None else environ
    fields = {f: getattr(args, f) for f in Config.__dataclass_fields__ if hasattr(args, f)}
    fields["node_name"] = env.get("NODE_NAME", "")
    return Config(**fields).validate()


def setup_logging(verbosity: int, log_dir: str) -> None:
    """One format for every module; --v >= 4 enables debug messages."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(Path(log_dir) / "gpu-manager.log"))
    logging.basicConfig(
        level=logging.DEBUG if verbosity >= 4 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )
    # grpc and the kubernetes client are noisy at debug level.
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpu-manager`` command."""
    args = build_parser().parse_args(normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.version is not None:
        print(f"gpu-manager {__version__} (device plugin API {names.DEVICE_PLUGIN_API_VERSION})")
        return EXIT_OK
    setup_logging(args.v, args.log_dir)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        log.error("invalid configuration: %s", exc)
        return EXIT_CONFIG

    from gpumanager.app import Agent, StartupError  # imported late: keeps --help and --version fast

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    agent = Agent(config)
    try:
        agent.start()
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        agent.stop()
        return exc.exit_code
    try:
        while not stop.wait(1.0):
            pass
    finally:
        agent.stop()
    log.info("stopped")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
