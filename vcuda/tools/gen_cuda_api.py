#!/usr/bin/env python3
"""Generate the CUDA driver (and NVML) entry points of vcuda's two libraries from the headers.

Run by vcuda/Makefile; nothing here is a hand-written list of functions, so a new header brings
its new functions in by itself.

``sim`` mode (the simulated ``libcuda.so.1``):
  * every function declared in ``cuda.h`` (preprocessed with ``__CUDA_API_VERSION_INTERNAL``,
    which declares each exported name under its own name: ``cuMemAlloc`` (the CUDA 2.0 ABI),
    ``cuMemAlloc_v2``, ``cuMemcpyHtoD_v2_ptds``, ...) that the sources do not define with
    ``SIM_EXPORT`` gets a stub returning ``CUDA_ERROR_NOT_SUPPORTED``;
  * the linker version script exports exactly these names;
  * the ``cuGetProcAddress`` table: ``cudaTypedefs.h`` declares one ``PFN_<name>_v<version>``
    typedef per ABI of every function (``PFN_cuMemAlloc_v2000``, ``PFN_cuMemAlloc_v3020``, and
    ``..._ptds`` / ``..._ptsz`` for per-thread default stream variants).  The ABIs of one base
    name, sorted by version, correspond one to one to its exported symbols sorted by suffix
    (``cuMemAlloc``, ``cuMemAlloc_v2``, ...); the generator checks that the counts agree.

``interceptor`` mode (``libcuda-control.so``):
  * an index for every ``cu*`` function of ``cuda.h`` and every ``nvml*`` function of ``nvml.h``
    (plus the header's ``#define`` aliases, as the simulated NVML exports them);
  * a forwarding entry point for every function the sources do not define with ``VC_EXPORT``:
    it loads the real function's address from a table (resolved on first use) and tail-calls it;
  * the version script, and the list of hooked names with their ``cuGetProcAddress`` keys
    (base name, version, per-thread flag) so the interceptor can also recognise pointers that a
    driver's ``cuGetProcAddress`` hands out without exporting them.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import cdecl
from cdecl import ALIAS_RE, Function, param_name, parse_functions

PFN_RE = re.compile(r"typedef\s+CUresult\s*\(\s*CUDAAPI\s*\*\s*PFN_(cu\w+?)_v(\d+)(_ptds|_ptsz)?\s*\)")
SUFFIX_RE = re.compile(r"^(?P<base>.*?)(?:_v(?P<ver>\d+))?(?P<pt>_ptds|_ptsz)?$")
TOOL = "gen_cuda_api"


def preprocess(cc: list[str], header: Path, *extra: str) -> str:
    return cdecl.preprocess(TOOL, cc, header, *extra)


def cuda_functions(cc: list[str], include: Path) -> dict[str, Function]:
    text = preprocess(cc, include / "cuda.h", "-I", str(include), "-D__CUDA_API_VERSION_INTERNAL")
    funcs = parse_functions(text, "cu")
    if len(funcs) < 300:
        sys.exit(f"gen_cuda_api: only {len(funcs)} functions found in {include / 'cuda.h'}")
    bad = sorted(f.name for f in funcs.values() if f.ret != "CUresult")
    if bad:
        sys.exit(f"gen_cuda_api: functions not returning CUresult: {', '.join(bad)}")
    return funcs


def nvml_functions(cc: list[str], header: Path) -> tuple[dict[str, Function], dict[str, Function]]:
    include = ["-I", str(header.parent)]
    funcs = parse_functions(preprocess(cc, header, *include, "-DNVML_NO_UNVERSIONED_FUNC_DEFS"), "nvml")
    if len(funcs) < 100:
        sys.exit(f"gen_cuda_api: only {len(funcs)} functions found in {header}")
    aliases: dict[str, Function] = {}
    for alias, target in ALIAS_RE.findall(preprocess(cc, header, *include, "-dM")):
        if alias not in funcs and target in funcs:
            aliases[alias] = Function(alias, funcs[target].ret, funcs[target].params)
    return funcs, aliases


@dataclass(frozen=True)
class ProcKey:
    """One cuGetProcAddress answer: (base name, version, per-thread) -> exported symbol."""

    base: str
    version: int
    per_thread: bool
    symbol: str


def split_symbol(name: str) -> tuple[str, int, str]:
    m = SUFFIX_RE.match(name)
    assert m is not None
    return m.group("base"), int(m.group("ver") or 1), m.group("pt") or ""


def proc_table(include: Path, names: set[str]) -> list[ProcKey]:
    """The cuGetProcAddress keys of every exported symbol (see the module docstring)."""
    versions: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for base, ver, pt in PFN_RE.findall((include / "cudaTypedefs.h").read_text()):
        versions[base].add((int(ver), pt))
    symbols: dict[str, set[tuple[int, str]]] = defaultdict(set)
    for name in names:
        base, k, pt = split_symbol(name)
        symbols[base].add((k, pt))
    keys: list[ProcKey] = []
    problems: list[str] = []
    for base in sorted(symbols):
        plain_syms = sorted(k for k, pt in symbols[base] if pt == "")
        plain_vers = sorted(v for v, pt in versions.get(base, ()) if pt == "")
        if not plain_vers:
            plain_vers = [0] * len(plain_syms)  # no typedef (yet): available at any version
        if len(plain_vers) != len(plain_syms):
            problems.append(f"{base}: versions {plain_vers} vs symbols {plain_syms}")
            continue
        by_version = dict(zip(plain_vers, plain_syms, strict=True))
        for ver, k in by_version.items():
            keys.append(ProcKey(base, ver, False, base if k == 1 else f"{base}_v{k}"))
        for ver, pt in sorted(versions.get(base, ())):
            if not pt:
                continue
            # The per-thread variant of the plain ABI in force at that version.
            older = [v for v in plain_vers if v <= ver]
            k = by_version[max(older)] if older else None
            sym = None if k is None else (base if k == 1 else f"{base}_v{k}") + pt
            if sym is None or sym not in names:
                problems.append(f"{base}: PFN_{base}_v{ver}{pt} has no exported symbol")
                continue
            keys.append(ProcKey(base, ver, True, sym))
    if problems:
        sys.exit("gen_cuda_api: cannot map cudaTypedefs.h versions to symbols:\n  " + "\n  ".join(problems))
    return keys


def exported_in(sources: list[Path], macro: str, prefix: str) -> set[str]:
    pattern = re.compile(rf"\b{macro}\s+[\w\s\*]*?\b({prefix}\w+)\s*\(")
    found: set[str] = set()
    for src in sources:
        found.update(pattern.findall(src.read_text()))
    return found


def version_script(names: list[str], what: str) -> str:
    lines = [f"/* Generated by gen_cuda_api.py: {what}. */", "{", "  global:"]
    lines.extend(f"    {n};" for n in names)
    lines.extend(["  local:", "    *;", "};", ""])
    return "\n".join(lines)


def c_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- sim mode --------------------------------------------------------------------------------


def gen_sim(args: argparse.Namespace, cc: list[str]) -> None:
    funcs = cuda_functions(cc, args.cuda_include)
    implemented = exported_in(args.sources, "SIM_EXPORT", "cu")
    unknown = sorted(implemented - funcs.keys())
    if unknown:
        sys.exit(f"gen_cuda_api: implemented but not declared in cuda.h: {', '.join(unknown)}")
    out = [
        "/* Generated by gen_cuda_api.py from cuda.h: do not edit. */\n",
        '#include "cuda_sim.h"\n',
    ]
    for name in sorted(funcs):
        if name in implemented:
            continue
        f = funcs[name]
        params = ", ".join(f.params) or "void"
        body = "".join(f"    (void){param_name(p)};\n" for p in f.params)
        out.append(f"\nSIM_EXPORT CUresult {name}({params})\n{{\n{body}    return CUDA_ERROR_NOT_SUPPORTED;\n}}\n")
    args.out_c.parent.mkdir(parents=True, exist_ok=True)
    args.out_c.write_text("".join(out))
    args.out_map.write_text(version_script(sorted(funcs), "the cuda.h names, nothing else"))

    keys = proc_table(args.cuda_include, set(funcs))
    symbols = sorted({k.symbol for k in keys})
    index = {s: i for i, s in enumerate(symbols)}
    procs = ["/* Generated by gen_cuda_api.py from cudaTypedefs.h and cuda.h: do not edit. */\n",
             '#include "cuda_procs.h"\n\n']  # fmt: skip
    procs.extend(f'extern void sim_sym_{i}(void) __asm__("{s}");\n' for s, i in index.items())
    procs.append("\n/* Sorted by base name, then per-thread flag, then version. */\n")
    procs.append("const struct sim_proc_entry sim_proc_table[] = {\n")
    for k in sorted(keys, key=lambda k: (k.base, k.per_thread, k.version)):
        procs.append(f"    {{{c_string(k.base)}, {k.version}, {int(k.per_thread)}, sim_sym_{index[k.symbol]}}},\n")
    procs.append("};\n")
    procs.append("const unsigned sim_proc_table_len = sizeof(sim_proc_table) / sizeof(sim_proc_table[0]);\n")
    args.out_procs.write_text("".join(procs))
    print(
        f"gen_cuda_api: sim: {len(funcs)} exports, {len(implemented)} implemented, "
        f"{len(funcs) - len(implemented)} NOT_SUPPORTED stubs, {len(keys)} cuGetProcAddress keys"
    )


# ---- interceptor mode ------------------------------------------------------------------------


def forwarder(f: Function, table: str, index: int, declare: bool, typeof_name: str) -> str:
    params = ", ".join(f.params) or "void"
    call_args = ", ".join(param_name(p) for p in f.params)
    lines = []
    if declare:
        lines.append(f"VC_EXPORT {f.ret} {f.name}({params});")
    lines.append(f"VC_EXPORT {f.ret} {f.name}({params})")
    lines.append("{")
    lines.append(f"    return ((__typeof__(&{typeof_name})){table}({index}))({call_args});")
    lines.append("}")
    return "\n".join(lines) + "\n"


def gen_interceptor(args: argparse.Namespace, cc: list[str]) -> None:
    cu = cuda_functions(cc, args.cuda_include)
    nv, nv_alias = nvml_functions(cc, args.nvml_header)
    hooked_cu = exported_in(args.sources, "VC_EXPORT", "cu")
    hooked_nv = exported_in(args.sources, "VC_EXPORT", "nvml")
    unknown = sorted((hooked_cu - cu.keys()) | (hooked_nv - nv.keys() - nv_alias.keys()))
    if unknown:
        sys.exit(f"gen_cuda_api: hooked but not declared in the headers: {', '.join(unknown)}")
    cu_names = sorted(cu)
    nv_names = sorted(nv.keys() | nv_alias.keys())
    alias_target = {}
    for name, f in nv_alias.items():
        # typeof needs a declared function of the same type: the alias's target.
        alias_target[name] = next(t for t, g in nv.items() if g.params == f.params and g.ret == f.ret)

    h = ["/* Generated by gen_cuda_api.py from cuda.h and nvml.h: do not edit. */\n",
         "#ifndef VC_API_GEN_H\n#define VC_API_GEN_H\n\n",
         f"#define VC_CU_COUNT {len(cu_names)}u\n#define VC_NVML_COUNT {len(nv_names)}u\n\n",
         "enum vc_cu_index {\n"]  # fmt: skip
    h.extend(f"    VC_CU_{n} = {i},\n" for i, n in enumerate(cu_names))
    h.append("};\n\nenum vc_nvml_index {\n")
    h.extend(f"    VC_NVML_{n} = {i},\n" for i, n in enumerate(nv_names))
    h.append("};\n\n#endif\n")
    args.out_h.parent.mkdir(parents=True, exist_ok=True)
    args.out_h.write_text("".join(h))

    c = ["/* Generated by gen_cuda_api.py from cuda.h and nvml.h: do not edit. */\n",
         '#include "vc_internal.h"\n\n']  # fmt: skip
    c.append("const char *const vc_cu_names[VC_CU_COUNT] = {\n")
    c.extend(f"    {c_string(n)},\n" for n in cu_names)
    c.append("};\n\nconst char *const vc_nvml_names[VC_NVML_COUNT] = {\n")
    c.extend(f"    {c_string(n)},\n" for n in nv_names)
    c.append("};\n\n/* What a call of a function the real library lacks returns (by return type). */\n")
    c.append("const unsigned char vc_nvml_ret_kind[VC_NVML_COUNT] = {\n")
    for n in nv_names:
        f = nv.get(n) or nv_alias[n]
        kind = "VC_RET_NVML" if f.ret == "nvmlReturn_t" else "VC_RET_PTR"
        c.append(f"    {kind},\n")
    c.append("};\n\n")
    # Hooked symbols and their cuGetProcAddress keys.
    keys = [k for k in proc_table(args.cuda_include, set(cu)) if k.symbol in hooked_cu]
    c.append("/* Every hooked cu* function: the wrapper that replaces the real one. */\n")
    c.append("const struct vc_hook vc_cu_hooks[] = {\n")
    for n in sorted(hooked_cu):
        c.append(f"    {{VC_CU_{n}, (void *)&{n}}},\n")
    c.append("};\nconst unsigned vc_cu_hooks_len = sizeof(vc_cu_hooks) / sizeof(vc_cu_hooks[0]);\n\n")
    c.append("/* cuGetProcAddress keys that answer with a hooked symbol. */\n")
    c.append("const struct vc_proc_key vc_cu_hook_keys[] = {\n")
    for k in sorted(keys, key=lambda k: (k.base, k.per_thread, k.version)):
        c.append(f"    {{{c_string(k.base)}, {k.version}, {int(k.per_thread)}, VC_CU_{k.symbol}}},\n")
    c.append("};\nconst unsigned vc_cu_hook_keys_len = sizeof(vc_cu_hook_keys) / sizeof(vc_cu_hook_keys[0]);\n")
    for i, n in enumerate(cu_names):
        if n not in hooked_cu:
            c.append("\n" + forwarder(cu[n], "vc_real_cu", i, False, n))
    for i, n in enumerate(nv_names):
        if n in hooked_nv:
            continue
        if n in nv_alias:
            c.append("\n/* alias from nvml.h */\n" + forwarder(nv_alias[n], "vc_real_nvml", i, True, alias_target[n]))
        else:
            c.append("\n" + forwarder(nv[n], "vc_real_nvml", i, False, n))
    args.out_c.write_text("".join(c))
    args.out_map.write_text(version_script([*cu_names, *nv_names], "every cuda.h and nvml.h name"))
    print(
        f"gen_cuda_api: interceptor: {len(cu_names)} cu* + {len(nv_names)} nvml* exports, "
        f"{len(hooked_cu)} + {len(hooked_nv)} hooked, {len(keys)} cuGetProcAddress keys of hooked symbols"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("sim", "interceptor"))
    ap.add_argument("--cc", default="cc", help="C compiler used as preprocessor (may contain flags)")
    ap.add_argument("--cuda-include", required=True, type=Path, help="directory of cuda.h and cudaTypedefs.h")
    ap.add_argument("--nvml-header", type=Path, help="nvml.h (interceptor mode)")
    ap.add_argument("--out-c", required=True, type=Path)
    ap.add_argument("--out-map", required=True, type=Path)
    ap.add_argument("--out-procs", type=Path, help="cuGetProcAddress table (sim mode)")
    ap.add_argument("--out-h", type=Path, help="index header (interceptor mode)")
    ap.add_argument("sources", nargs="+", type=Path, help="hand-written sources")
    args = ap.parse_args()
    cc = shlex.split(args.cc)
    if args.mode == "sim":
        if args.out_procs is None:
            ap.error("sim mode needs --out-procs")
        gen_sim(args, cc)
    else:
        if args.out_h is None or args.nvml_header is None:
            ap.error("interceptor mode needs --out-h and --nvml-header")
        gen_interceptor(args, cc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
