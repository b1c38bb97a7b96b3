"""Regenerate gpumanager/api from proto/ with grpcio-tools.

Usage: python scripts/gen_proto.py [OUTPUT_DIR]

The generated modules are committed; tests/test_api_codegen.py fails when
they drift from the .proto sources.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = "gpumanager.api"


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto in proto/ into out_dir and fix the imports."""
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    protos = sorted(PROTO_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for path in sorted(out_dir.glob("*_pb2*.py*")):
        text = path.read_text()
        # grpc_tools emits top-level imports of sibling modules; make them package imports.
        fixed = re.sub(r"^import (\w+_pb2) as (\w+)$", rf"from {PACKAGE} import \1 as \2", text, flags=re.M)
        if fixed != text:
            path.write_text(fixed)
        written.append(path)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "gpumanager" / "api"
    for p in generate(target):
        print(p.relative_to(target.parent) if p.is_relative_to(target.parent) else p)
