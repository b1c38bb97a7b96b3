"""``python -m simnode.gpusim``: change the live state of the simulated GPU node.

Every process that loads the simulated ``libnvidia-ml.so.1`` with the same ``GPUSIM_STATE``
sees the change at once::

    gpusim xid --gpu 2 --xid 79            queue an XID critical-error event on GPU 2
    gpusim lost --gpu 1                    GPU 1 answers NVML_ERROR_GPU_IS_LOST
    gpusim restore --gpu 1                 ... and is back
    gpusim hang --gpu 1                    NVML calls on GPU 1 block (stuck in reset)
    gpusim unhang --gpu 1                  ... and answer again
    gpusim mig --gpu 0 --on|--off          MIG mode (answered by A100/A30/H100/H200/B200 models only)
    gpusim compute-mode --gpu 0 --mode EXCLUSIVE_PROCESS   (DEFAULT, EXCLUSIVE_THREAD, PROHIBITED)
    gpusim proc --gpu 0 --pid 4242 --used-mib 1024 [--sm-percent 30] [--mem-percent 10] [--graphics]
    gpusim proc-remove --pid 4242 [--gpu 0]
    gpusim util --gpu 0 --percent 75 [--memory-percent 40]
    gpusim show [--json]                   (also the simulated GPU time of GPUs that ran kernels)

The state file comes from ``--state`` or ``GPUSIM_STATE``, the node spec (for the GPU count
and names) from ``--spec`` or ``GPUSIM_SPEC``.  Exit status: 0 done, 1 error, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from simnode.gpusim_state import COMPUTE_MODES, GpuSimState, NodeSpec, SpecError, StateError, load_spec

MIB = 1024 * 1024


class _UsageError(Exception):
    """A problem with the command line that argparse cannot see (missing path, GPU out of range)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simnode.gpusim",
        description="Change the live state of the simulated GPU node (see vcuda/sim/README.md).",
    )
    p.add_argument("--state", help="state file (default: $GPUSIM_STATE)")
    p.add_argument("--spec", help="node spec JSON (default: $GPUSIM_SPEC)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def gpu_arg(cmd: argparse.ArgumentParser, required: bool = True) -> None:
        cmd.add_argument("--gpu", type=int, required=required, help="NVML index of the GPU")

    cmd = sub.add_parser("xid", help="queue an XID critical-error event")
    gpu_arg(cmd)
    cmd.add_argument("--xid", type=int, required=True, help="the XID number, e.g. 79")
    gpu_arg(sub.add_parser("lost", help="make a GPU answer NVML_ERROR_GPU_IS_LOST"))
    gpu_arg(sub.add_parser("restore", help="bring a lost GPU back"))
    gpu_arg(sub.add_parser("hang", help="make NVML calls on a GPU block (a GPU stuck in reset)"))
    gpu_arg(sub.add_parser("unhang", help="let a hung GPU's NVML calls answer again"))
    cmd = sub.add_parser("mig", help="turn MIG mode on or off (MIG-capable models)")
    gpu_arg(cmd)
    on_off = cmd.add_mutually_exclusive_group(required=True)
    on_off.add_argument("--on", dest="mig", action="store_true")
    on_off.add_argument("--off", dest="mig", action="store_false")
    cmd = sub.add_parser("compute-mode", help="set the compute mode NVML reports")
    gpu_arg(cmd)
    cmd.add_argument("--mode", required=True, choices=sorted(COMPUTE_MODES), help="the compute mode")
    cmd = sub.add_parser("proc", help="add or update a process using a GPU")
    gpu_arg(cmd)
    cmd.add_argument("--pid", type=int, required=True)
    cmd.add_argument("--used-mib", type=int, required=True, help="device memory it uses, MiB")
    cmd.add_argument("--sm-percent", type=int, default=0, help="its SM utilisation (process utilisation)")
    cmd.add_argument("--mem-percent", type=int, default=0, help="its memory utilisation")
    cmd.add_argument("--graphics", action="store_true", help="a graphics process (not a compute one)")
    cmd = sub.add_parser("proc-remove", help="remove a process (from one GPU or all)")
    gpu_arg(cmd, required=False)
    cmd.add_argument("--pid", type=int, required=True)
    cmd = sub.add_parser("util", help="set a GPU's utilisation (also recorded as a sample)")
    gpu_arg(cmd)
    cmd.add_argument("--percent", type=int, required=True, help="GPU utilisation, 0..100")
    cmd.add_argument("--memory-percent", type=int, default=0, help="memory utilisation, 0..100")
    cmd = sub.add_parser("show", help="print the node's state")
    cmd.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def _path(value: str | None, env: str, what: str) -> str:
    path = value or os.environ.get(env)
    if not path:
        raise _UsageError(f"no {what}: pass --{what} or set {env}")
    return path


def _check_gpu(spec: NodeSpec, gpu: int | None) -> None:
    if gpu is not None and not 0 <= gpu < len(spec.gpus):
        raise _UsageError(f"--gpu {gpu} out of range: {spec.source} has {len(spec.gpus)} GPU(s)")


def _show(spec: NodeSpec, state: GpuSimState, as_json: bool) -> None:
    snap = state.snapshot(len(spec.gpus))
    if as_json:
        doc = {
            "spec": spec.source,
            "state": str(state.path),
            "event_next_seq": snap.event_next_seq,
            "gpus": [
                {
                    **asdict(g),
                    "samples": [asdict(s) for s in g.samples[-10:]],
                    "uuid": spec.gpus[g.index].uuid,
                    "used_bytes": snap.used_bytes(g.index),
                    "total_bytes": spec.gpus[g.index].memory_bytes,
                    "timeline": asdict(tl) if (tl := state.timeline(g.index)) is not None else None,
                }
                for g in snap.gpus
            ],
            "processes": [asdict(p) for p in snap.processes],
            "events": [asdict(e) for e in snap.events[-50:]],
        }
        print(json.dumps(doc, indent=2))
        return
    print(f"node {spec.source} (driver {spec.driver_version}), state {state.path}")
    for g in snap.gpus:
        info = spec.gpus[g.index]
        used = snap.used_bytes(g.index) // MIB
        status = "LOST" if g.lost else "ok"
        print(
            f"  GPU {g.index} {info.uuid} {info.name}: {status}, memory {used}/{info.memory_mib} MiB, "
            f"util {g.util_gpu}% (memory {g.util_memory}%)"
        )
        for p in snap.processes:
            if p.gpu == g.index:
                print(f"      pid {p.pid}: {p.used_bytes // MIB} MiB, sm {p.sm_util}%, mem {p.mem_util}%")
        tl = state.timeline(g.index)
        if tl is not None and tl.active:
            print(f"      simulated GPU time: busy {tl.busy_ns / 1e9:.3f} s, {tl.kernels_done} kernels done")
            for tp in tl.processes:
                print(f"      pid {tp.pid}: kernels ran {tp.busy_ns / 1e9:.3f} s, {tp.pending} queued")
    recent = snap.events[-10:]
    print(f"events: {snap.event_next_seq - 1} queued in total" + (", latest:" if recent else ""))
    for e in recent:
        print(f"  #{e.seq} GPU {e.gpu} type {e.event_type:#x} data {e.data}")


def _run(args: argparse.Namespace) -> str | None:
    spec = load_spec(_path(args.spec, "GPUSIM_SPEC", "spec"))
    _check_gpu(spec, getattr(args, "gpu", None))
    with GpuSimState(_path(args.state, "GPUSIM_STATE", "state")) as state:
        cmd = args.command
        if cmd == "xid":
            seq = state.queue_xid(args.gpu, args.xid)
            return f"queued XID {args.xid} on GPU {args.gpu} (event #{seq})"
        if cmd in ("lost", "restore"):
            state.set_lost(args.gpu, cmd == "lost")
            return f"GPU {args.gpu} {'lost' if cmd == 'lost' else 'restored'}"
        if cmd in ("hang", "unhang"):
            state.set_hung(args.gpu, cmd == "hang")
            return f"GPU {args.gpu} {'hung' if cmd == 'hang' else 'answers again'}"
        if cmd == "mig":
            state.set_mig(args.gpu, args.mig)
            return f"GPU {args.gpu} MIG mode {'on' if args.mig else 'off'}"
        if cmd == "compute-mode":
            state.set_compute_mode(args.gpu, COMPUTE_MODES[args.mode])
            return f"GPU {args.gpu} compute mode {args.mode}"
        if cmd == "proc":
            if args.used_mib < 0:
                raise _UsageError("--used-mib must not be negative")
            state.set_process(
                args.gpu,
                args.pid,
                args.used_mib * MIB,
                sm_util=args.sm_percent,
                mem_util=args.mem_percent,
                graphics=args.graphics,
            )
            return f"pid {args.pid} uses {args.used_mib} MiB on GPU {args.gpu}"
        if cmd == "proc-remove":
            removed = state.remove_process(args.pid, args.gpu)
            if removed == 0:
                raise _UsageError(f"pid {args.pid} is not in the process table")
            return f"removed pid {args.pid} ({removed} entr{'y' if removed == 1 else 'ies'})"
        if cmd == "util":
            state.set_utilization(args.gpu, args.percent, args.memory_percent)
            return f"GPU {args.gpu} utilisation {args.percent}% (memory {args.memory_percent}%)"
        _show(spec, state, args.json)
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        message = _run(args)
    except (_UsageError, SpecError, StateError, OSError) as exc:
        print(f"gpusim: {exc}", file=sys.stderr)
        return 1
    if message:
        print(message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
