"""A stand-in for what tkestack's vcuda-controller library does at a process's first CUDA call.

It registers the container with gpu-manager, as the library's ``load_necessary_data``:

1. ``/etc/vcuda/vcuda.config`` exists: the old layout; register once with the bus ID of
   device 0 and the config's container name (``--cont-name``).
2. Otherwise the ``memory`` line of ``/proc/self/cgroup`` names the container: the last path
   component is the container (``docker-<id>.scope``, ``cri-containerd-<id>.scope``,
   ``crio-<id>.scope`` or a bare ``<id>``), the one before it the pod (``pod<uid>``, or
   ``kubepods-...-pod<uid with _>.slice``). Then fork, exec
   ``/usr/local/nvidia/bin/gpu-client --addr /etc/vcuda/vcuda.sock --bus-id "" --pod-uid <uid>
   --cont-id <id>``, wait, and ``exit(-1)`` if it did not exit 0 (the process dies).
3. Read exactly 8240 bytes of ``/etc/vcuda/<id>/vcuda.config`` and ``pids.config``.

It prints what it read as one JSON line. Run it where a container would see its mounts
(``/usr/local/nvidia``, ``/etc/vcuda``: a private mount namespace), or map those paths
with ``--nvidia-root``/``--vcuda-root``; ``--cgroup-file`` stands for ``/proc/self/cgroup``
(a process of the simulated node is in no pod's cgroup).

    python -m simnode.upstream_library [--cgroup-file F] [--nvidia-root D] [--vcuda-root D] [--bus-id ID]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path

CONFIG_SIZE = 8240
EXIT_FATAL = 255  # exit(-1)


class CgroupError(ValueError):
    """/proc/self/cgroup does not name a container (the library's FATAL)."""


def container_of(cgroup_text: str) -> tuple[str, str]:
    """(pod UID, container ID) from the ``memory`` line of a /proc/self/cgroup text."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            path = parts[2]
            break
    else:
        raise CgroupError("no memory controller line in the cgroup file (cgroup v2 is not supported)")
    components = [p for p in path.split("/") if p]
    if len(components) < 2:
        raise CgroupError(f"cgroup path {path!r} has no pod and container components")
    pod_part, cont_part = components[-2], components[-1]
    if cont_part.endswith(".scope"):  # systemd driver
        container_id = cont_part[: -len(".scope")].rsplit("-", 1)[-1]
        pod = pod_part[: -len(".slice")] if pod_part.endswith(".slice") else pod_part
        if "-pod" not in pod:
            raise CgroupError(f"cgroup path {path!r}: no pod in {pod_part!r}")
        pod_uid = pod.rsplit("-pod", 1)[1].replace("_", "-")
    else:  # cgroupfs driver
        container_id = cont_part
        pod_uid = pod_part[len("pod") :] if pod_part.startswith("pod") else pod_part
    return pod_uid, container_id


def register(client: Path, args: list[str]) -> int:
    """fork + exec the client (as the library does), wait; its exit status."""
    pid = os.fork()
    if pid == 0:  # the child: nothing but exec
        try:
            os.execv(client, ["gpu-client", *args])
        finally:
            os._exit(127)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cgroup-file", default="/proc/self/cgroup")
    parser.add_argument("--nvidia-root", default="/usr/local/nvidia")
    parser.add_argument("--vcuda-root", default="/etc/vcuda")
    parser.add_argument("--bus-id", default="00000000:00:00.0", help="device 0's bus ID (old layout)")
    opts = parser.parse_args(argv)
    vcuda = Path(opts.vcuda_root)
    client = Path(opts.nvidia_root) / "bin" / "gpu-client"
    sock = str(vcuda / "vcuda.sock")
    legacy = vcuda / "vcuda.config"
    if legacy.exists():
        config_path = legacy
        name = legacy.read_bytes()[4096:8192].split(b"\0", 1)[0].decode()
        uid = legacy.read_bytes()[:48].split(b"\0", 1)[0].decode()
        args = ["--addr", sock, "--bus-id", opts.bus_id, "--pod-uid", uid, "--cont-name", name]
    else:
        try:
            uid, cid = container_of(Path(opts.cgroup_file).read_text())
        except (OSError, CgroupError) as exc:
            print(f"upstream-library FATAL: {exc}", file=sys.stderr)
            return EXIT_FATAL
        config_path = vcuda / cid / "vcuda.config"
        args = ["--addr", sock, "--bus-id", "", "--pod-uid", uid, "--cont-id", cid]
    code = register(client, args)
    if code != 0:
        print(f"upstream-library FATAL: {client} exited {code}", file=sys.stderr)
        return EXIT_FATAL
    data = config_path.read_bytes()
    if len(data) != CONFIG_SIZE:
        print(f"upstream-library FATAL: {config_path} is {len(data)} bytes, not {CONFIG_SIZE}", file=sys.stderr)
        return EXIT_FATAL
    pids_raw = (config_path.parent / "pids.config").read_bytes()
    gpu_memory, utilization, hard_limit = struct.unpack_from("<Qii", data, 8208)
    enable = struct.unpack_from("<i", data, 8232)[0]
    print(
        json.dumps(
            {
                "config": str(config_path),
                "pod_uid": data[:48].split(b"\0", 1)[0].decode(),
                "container_name": data[4096:8192].split(b"\0", 1)[0].decode(),
                "gpu_memory": gpu_memory,
                "utilization": utilization,
                "hard_limit": hard_limit,
                "enable": enable,
                "pids": list(struct.unpack(f"<{len(pids_raw) // 4}i", pids_raw[: len(pids_raw) // 4 * 4])),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
