#!/usr/bin/env python3
"""Generate NOT_SUPPORTED stubs and the export list of the simulated libnvidia-ml.so.1.

Run by vcuda/Makefile.  Every function declared in nvml.h must be exported by the simulated
library, so that no caller ever meets a missing symbol.  This script

1. runs the C preprocessor over nvml.h with NVML_NO_UNVERSIONED_FUNC_DEFS defined, which makes
   the header declare both the unversioned names (nvmlInit, nvmlDeviceGetCount, ...) and every
   versioned one (nvmlInit_v2, ...), and collects all function declarations;
2. runs it again without that macro, with -dM, to find the header's ``#define nvmlX nvmlY``
   aliases (e.g. nvmlGetBlacklistDeviceCount -> nvmlGetExcludedDeviceCount); an alias that the
   header does not also declare as a function is exported too, with its target's signature;
3. scans the hand-written sources for definitions marked SIM_EXPORT (the implemented
   functions), checks that each is declared in nvml.h, and writes a stub returning
   NVML_ERROR_NOT_SUPPORTED for every other function;
4. writes a linker version script exporting exactly the nvml.h names.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

C_TYPE_WORDS = {
    "void", "char", "short", "int", "long", "float", "double", "signed", "unsigned",
    "const", "volatile", "struct", "union", "enum", "restrict",
}  # fmt: skip

DECL_RE = re.compile(r"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>nvml\w+)\s*\((?P<params>.*)\)$", re.DOTALL)
EXPORT_RE = re.compile(r"\bSIM_EXPORT\s+[\w\s\*]*?\b(nvml\w+)\s*\(")
ALIAS_RE = re.compile(r"^#define\s+(nvml\w+)\s+(nvml\w+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Function:
    """One C function declaration from nvml.h."""

    name: str
    ret: str
    params: tuple[str, ...]  # declarations, each with a parameter name


def preprocess(cc: list[str], header: Path, *extra: str) -> str:
    """Runs the C preprocessor on header and returns its output."""
    cmd = [*cc, "-E", "-P", "-x", "c", *extra, str(header)]
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"gen_nvml_stubs: {shlex.join(cmd)} failed:\n{e.stderr}")


def statements(text: str) -> list[str]:
    """Top-level C statements of preprocessed text (split on ';' outside braces/parens)."""
    out: list[str] = []
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
        elif ch == ";" and depth == 0:
            out.append(" ".join(text[start:i].split()))
            start = i + 1
    return out


def split_params(params: str) -> list[str]:
    """Splits a parameter list on top-level commas."""
    parts: list[str] = []
    depth = 0
    cur = ""
    for ch in params:
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        depth += ch in "(["
        depth -= ch in ")]"
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def name_param(decl: str, index: int) -> str:
    """Returns decl with a parameter name, adding argN where the header omits it."""
    fnptr = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
    if fnptr:
        return decl
    words = re.findall(r"[A-Za-z_]\w*", re.sub(r"\[[^\]]*\]", "", decl))
    last = words[-1] if words else ""
    if len(words) <= 1 or last in C_TYPE_WORDS or last.endswith("_t"):
        return f"{decl} arg{index}"
    return decl


def param_name(decl: str) -> str:
    fnptr = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
    if fnptr:
        return fnptr.group(1)
    return re.findall(r"[A-Za-z_]\w*", re.sub(r"\[[^\]]*\]", "", decl))[-1]


def parse_functions(text: str) -> dict[str, Function]:
    """All function declarations named nvml* in preprocessed header text."""
    funcs: dict[str, Function] = {}
    for stmt in statements(text):
        if stmt.startswith(("typedef", "extern \"C\"")) or "{" in stmt or "}" in stmt:
            continue
        m = DECL_RE.match(stmt)
        if not m:
            continue
        raw = split_params(m.group("params"))
        params = () if raw in ([], ["void"]) else tuple(name_param(p, i) for i, p in enumerate(raw))
        funcs[m.group("name")] = Function(m.group("name"), " ".join(m.group("ret").split()), params)
    return funcs


def stub(func: Function, declare: bool) -> str:
    """C source of one NOT_SUPPORTED stub."""
    ret = func.ret.replace(" *", "*")
    if ret == "nvmlReturn_t":
        value = "NVML_ERROR_NOT_SUPPORTED"
    elif ret.endswith("*"):
        value = "NULL"
    else:
        sys.exit(f"gen_nvml_stubs: cannot stub {func.name}: unknown return type {func.ret!r}")
    params = ", ".join(func.params) or "void"
    lines = []
    if declare:
        lines.append(f"SIM_EXPORT {func.ret} {func.name}({params});")
    lines.append(f"SIM_EXPORT {func.ret} {func.name}({params})")
    lines.append("{")
    lines.extend(f"    (void){param_name(p)};" for p in func.params)
    lines.append(f"    return {value};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cc", default="cc", help="C compiler used as preprocessor (may contain flags)")
    ap.add_argument("--header", required=True, type=Path, help="path of nvml.h")
    ap.add_argument("--out-c", required=True, type=Path, help="generated stubs source")
    ap.add_argument("--out-map", required=True, type=Path, help="generated linker version script")
    ap.add_argument("sources", nargs="+", type=Path, help="hand-written sources with SIM_EXPORT definitions")
    args = ap.parse_args()

    cc = shlex.split(args.cc)
    include = ["-I", str(args.header.parent)]
    funcs = parse_functions(preprocess(cc, args.header, *include, "-DNVML_NO_UNVERSIONED_FUNC_DEFS"))
    if len(funcs) < 100:
        sys.exit(f"gen_nvml_stubs: only {len(funcs)} functions found in {args.header}; is it nvml.h?")
    aliases: dict[str, Function] = {}
    for alias, target in ALIAS_RE.findall(preprocess(cc, args.header, *include, "-dM")):
        if alias not in funcs and target in funcs:
            aliases[alias] = Function(alias, funcs[target].ret, funcs[target].params)

    implemented: set[str] = set()
    for src in args.sources:
        implemented.update(EXPORT_RE.findall(src.read_text()))
    unknown = sorted(implemented - funcs.keys() - aliases.keys())
    if unknown:
        sys.exit(f"gen_nvml_stubs: implemented but not declared in nvml.h: {', '.join(unknown)}")

    header_name = args.header.name
    out = [
        f"/* Generated by gen_nvml_stubs.py from {header_name}: do not edit. */\n",
        '#include "nvml_sim.h"\n',
        "#include <stddef.h>\n",
    ]
    for name in sorted(funcs):
        if name not in implemented:
            out.append("\n" + stub(funcs[name], declare=False))
    for name in sorted(aliases):
        if name not in implemented:
            out.append("\n/* alias from nvml.h */\n" + stub(aliases[name], declare=True))
    args.out_c.parent.mkdir(parents=True, exist_ok=True)
    args.out_c.write_text("".join(out))

    exported = sorted(funcs.keys() | aliases.keys())
    script = ["/* Generated by gen_nvml_stubs.py: the nvml.h names, nothing else. */", "{", "  global:"]
    script.extend(f"    {name};" for name in exported)
    script.extend(["  local:", "    *;", "};", ""])
    args.out_map.write_text("\n".join(script))
    print(
        f"gen_nvml_stubs: {len(exported)} exports, {len(implemented)} implemented, "
        f"{len(exported) - len(implemented)} NOT_SUPPORTED stubs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
