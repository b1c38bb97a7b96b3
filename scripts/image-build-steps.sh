#!/bin/sh
# The build steps of the gpu-manager image, shared by the Dockerfile and CI.
#
# The Dockerfile runs them with --prefix / (the image's own file system); `make deploy-check`
# runs the very same steps into a temporary prefix, outside Docker, to prove they work.
#
# Usage: scripts/image-build-steps.sh [--prefix DIR] [--work DIR] STEP...
#   vcuda   build vcuda/ with gcc (NVIDIA headers from PyPI wheels, in a throwaway venv) and
#           install the interceptor as $PREFIX/usr/local/lib/gpu-manager/libcuda-control.so and,
#           beside it, gpu-client (the static registration client the driver mirror ships)
#   python  install the Python package into the venv $PREFIX/opt/gpu-manager
#   config  install the defaults: $PREFIX/etc/gpu-manager/{volume.conf,extra-config.json}
#   verify  check the result: the command runs, the defaults load, the interceptor is a shared object
#
# Environment: PYTHON (default python3), PIP_* (passed to pip as usual).
set -eu

# Header wheels for vcuda/ (nvml.h; cuda.h and cudaTypedefs.h). Pinned for reproducible images.
NVML_DEV_WHEEL="nvidia-nvml-dev-cu12==12.9.79"
CUDA_RUNTIME_WHEEL="nvidia-cuda-runtime-cu12==12.9.79"

SRC=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/
WORK=/tmp/gpu-manager-build
PYTHON=${PYTHON:-python3}

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=$2; shift 2 ;;
        --work) WORK=$2; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        --*) echo "image-build-steps: unknown option $1" >&2; exit 2 ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || { echo "image-build-steps: name at least one step (vcuda python config verify)" >&2; exit 2; }
PREFIX=${PREFIX%/}
VENV=$PREFIX/opt/gpu-manager
LIBDIR=$PREFIX/usr/local/lib/gpu-manager
CONFDIR=$PREFIX/etc/gpu-manager

step_vcuda() {
    tools=$WORK/tools-venv
    "$PYTHON" -m venv "$tools"
    "$tools/bin/pip" install --quiet "$NVML_DEV_WHEEL" "$CUDA_RUNTIME_WHEEL"
    make -C "$SRC/vcuda" PYTHON="$tools/bin/python" BUILD="$WORK/vcuda-build"
    mkdir -p "$LIBDIR"
    # Until vcuda/ builds the interceptor, the image simply has none (share mode then reports it).
    found=$(find "$WORK/vcuda-build" -maxdepth 2 -name libcuda-control.so -type f | head -n 1)
    if [ -n "$found" ]; then
        install -m 0755 "$found" "$LIBDIR/libcuda-control.so"
        echo "image-build-steps: interceptor $found -> $LIBDIR/libcuda-control.so"
    else
        echo "image-build-steps: note: vcuda/ built no libcuda-control.so; the image has no interceptor" >&2
    fi
    install -m 0755 "$WORK/vcuda-build/gpu-client" "$LIBDIR/gpu-client"
    echo "image-build-steps: gpu-client -> $LIBDIR/gpu-client"
}

step_python() {
    "$PYTHON" -m venv "$VENV"
    # [selftest]: NVIDIA's cuda-bindings, for gpu-manager selftest.
    "$VENV/bin/pip" install --quiet "$SRC[selftest]"
}

step_config() {
    install -d -m 0755 "$CONFDIR"
    install -m 0644 "$SRC/deploy/volume.conf" "$CONFDIR/volume.conf"
    install -m 0644 "$SRC/deploy/extra-config.json" "$CONFDIR/extra-config.json"
}

step_verify() {
    "$VENV/bin/gpu-manager" --version
    "$VENV/bin/python" -c 'import cuda.bindings.driver' # gpu-manager selftest runs its programs with it
    "$VENV/bin/gpu-manager-extender" --version
    "$VENV/bin/python" - "$CONFDIR" "$LIBDIR/libcuda-control.so" "$LIBDIR/gpu-client" <<'PY'
import json, sys
from pathlib import Path
from gpumanager.volume import load_volume_config
from gpumanager.volume.elffacts import read_elf_facts

conf, interceptor, client = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
volumes = load_volume_config(conf / "volume.conf").volumes
assert [v.name for v in volumes] == ["nvidia", "origin"], volumes
assert isinstance(json.loads((conf / "extra-config.json").read_text()), dict)
if interceptor.exists():
    facts = read_elf_facts(interceptor)
    print(f"interceptor: {interceptor} ({facts.bits}-bit, soname {facts.soname})")
facts = read_elf_facts(client)
assert facts.bits == 64 and not facts.needed, f"{client} must be a static executable: {facts}"
print(f"gpu-client: {client} (static)")
print(f"defaults: {conf}/volume.conf ({len(volumes)} volumes), extra-config.json")
PY
}

for step in "$@"; do
    case "$step" in
        vcuda|python|config|verify) echo "image-build-steps: $step"; "step_$step" ;;
        *) echo "image-build-steps: unknown step $step" >&2; exit 2 ;;
    esac
done
