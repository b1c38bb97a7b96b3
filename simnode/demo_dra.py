"""A short, narrated run of the agent in DRA mode on a simulated 8 x H100 node.

``python -m simnode.demo_dra`` (or ``make demo-dra``) shows: the ResourceSlice the agent
publishes (one device per GPU, consumable cores and memory, NVLink group), claims of 30 and 60
cores sharing one GPU and a third of 20 cores placed on the next one by the scheduler stand-in,
a two-GPU claim on one NVLink group, a CUDA program started through a claim's CDI edits and
stopped at its memory, an XID error tainting a GPU, a kubelet restart and an agent restart with
every prepared claim kept, and a finished pod's claim unprepared.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpumanager.vmanager import files
from simnode.dra_cluster import DRIVER, DRACluster, claim_pod, claim_template
from simnode.gpusim_state import repo_root, sim_env, spec_dir
from simnode.simhost import install_sim_driver, volume_conf

CLIENT = r"""
import json
from cuda.bindings import driver as d
R = d.CUresult
def ok(r):
    assert r[0] == R.CUDA_SUCCESS, r
    return r[1] if len(r) == 2 else r[1:]
ok(d.cuInit(0)); dev = ok(d.cuDeviceGet(0)); ok(d.cuCtxSetCurrent(ok(d.cuDevicePrimaryCtxRetain(dev))))
total = 0
while d.cuMemAlloc(256 << 20)[0] == R.CUDA_SUCCESS:
    total += 256 << 20
free, cap = ok(d.cuMemGetInfo())
print(json.dumps({"allocated_mib": total >> 20, "total_mib": cap >> 20}))
"""


def say(text: str = "") -> None:
    print(text, flush=True)


def results(c: DRACluster, pod: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = c.claim_of(pod)["status"]["allocation"]["devices"]["results"]
    return out


def placement(c: DRACluster, pod: str) -> str:
    parts = []
    for r in results(c, pod):
        cap = r.get("consumedCapacity") or {}
        parts.append(f"{r['device']} ({cap.get('cores', '100')} cores, {cap.get('memory', 'all')})")
    return ", ".join(parts)


def run(workdir: Path, spec: Path) -> int:
    root = workdir / "host"
    install_sim_driver(root)
    flags = [
        f"--volume-config={volume_conf(workdir / 'vdriver', workdir / 'volume.conf')}",
        f"--driver-root={root}",
        f"--vcuda-library={repo_root() / 'vcuda/build/libcuda-control.so'}",
    ]
    say(f"== gpu-manager --mode=dra on a simulated node ({spec.name})")
    with DRACluster(workdir / "node", spec, agent_flags=flags, health_quiet_period="1h") as c:
        assert c.agent is not None and c.kubelet is not None
        c.base_env["VCUDA_BUDGET_DIR"] = str(workdir / "shm")
        s = c.slice()
        assert s is not None
        say(f"registered with the kubelet as {DRIVER}; ResourceSlice {s['metadata']['name']}:")
        for dev in s["spec"]["devices"]:
            caps = dev["capacity"]
            group = dev["attributes"].get("nvlinkGroup", {}).get("int")
            say(
                f"  {dev['name']}: cores {caps['cores']['value']}, memory {caps['memory']['value']}, "
                f"NVLink group {group}, {dev['attributes']['productName']['string']}"
            )
        say()
        say("== shares placed by the scheduler (consumable capacity)")
        c.add_template(claim_template("c30", cores=30, memory="4Gi"))
        c.add_template(claim_template("c60", cores=60, memory="8Gi"))
        c.add_template(claim_template("c20", cores=20, memory="1Gi"))
        c.add_template(claim_template("pair", count=2, match_attribute=f"{DRIVER}/nvlinkGroup"))
        for name, template in (("train-30", "c30"), ("train-60", "c60"), ("infer-20", "c20")):
            c.create_pod(claim_pod(name, template))
            c.settle()
            say(f"  pod {name}: {placement(c, name)}")
        c.create_pod(claim_pod("allreduce", "pair"))
        c.settle()
        say(f"  pod allreduce (two GPUs, one NVLink group): {placement(c, 'allreduce')}")
        claim = c.claim_of("train-30")
        config = files.unpack((c.vm_path / claim["metadata"]["uid"] / "vcuda.config").read_bytes())
        say(
            f"  train-30's vcuda.config: {config.gpu_memory >> 20} MiB, {config.utilization} cores; "
            f"CDI spec {DRIVER}-{claim['metadata']['uid'][:8]}....json"
        )
        say()
        say("== a CUDA program started through a claim's CDI edits")
        c.add_template(claim_template("c10", cores=10, memory="2Gi"))
        pod = c.create_pod(claim_pod("cuda", "c10"), commands={"main": [sys.executable, "-c", CLIENT]})
        c.settle()
        proc = c.kubelet.containers[(pod["metadata"]["uid"], "main")].proc
        assert proc is not None
        out, _ = proc.communicate(timeout=120)
        result = json.loads(out.decode().strip().splitlines()[-1])
        say(
            f"  claim 10 cores / 2Gi: allocated {result['allocated_mib']} MiB, "
            f"cuMemGetInfo total {result['total_mib']} MiB"
        )
        say()
        say("== XID 79 on GPU 7")
        subprocess.run(
            [sys.executable, "-m", "simnode.gpusim", "xid", "--gpu", "7", "--xid", "79"],
            env=sim_env(c.spec, c.agent.state),
            check=True,
            capture_output=True,
        )
        s = c.wait_slice(lambda sl: sl is not None and any(d.get("taints") for d in sl["spec"]["devices"]))
        assert s is not None
        for dev in s["spec"]["devices"]:
            for t in dev.get("taints") or []:
                say(f"  {dev['name']} tainted {t['key']}={t['value']}:{t['effect']}")
        say()
        say("== kubelet restart (sockets and ResourceSlices wiped)")
        before = c.kubelet.registrations(DRIVER)
        c.kubelet.restart(wipe_sockets=True, plugin_dirs=[c.plugin_dir])
        c.kubelet.wait_registered(DRIVER, after=before)
        s = c.wait_slice(lambda sl: sl is not None)
        assert s is not None
        say(
            f"  registered again in process (agent pid {c.agent.pid}); "
            f"slice generation {s['spec']['pool']['generation']}"
        )
        say()
        say("== agent restart")
        c.agent.stop()
        c.start_agent()
        checkpoint = json.loads((c.checkpoint_dir / "gpumanager_internal_checkpoint").read_text())
        say(f"  {len(checkpoint.get('Claims', {}))} prepared claims recovered from the checkpoint")
        say()
        say("== train-60 finishes")
        c.end_pod("train-60")
        c.settle()
        say(f"  its claim is unprepared; {len(list(c.cdi_root.iterdir()))} CDI specs left")
    say("done")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", type=Path, default=spec_dir() / "h100-nvlink-x8.json", help="node spec JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="gpu-manager-demo-dra-") as tmp:
        return run(Path(tmp), args.spec)


if __name__ == "__main__":
    sys.exit(main())
