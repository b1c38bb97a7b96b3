"""Reading C function declarations out of a preprocessed header (shared by vcuda's generators)."""

from __future__ import annotations

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

ALIAS_RE = re.compile(r"^#define\s+(nvml\w+)\s+(nvml\w+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Function:
    """One C function declaration."""

    name: str
    ret: str
    params: tuple[str, ...]  # declarations, each with a parameter name


def preprocess(tool: str, cc: list[str], header: Path, *extra: str) -> str:
    """The C preprocessor's output for ``header``; exits with ``tool``'s name on failure."""
    cmd = [*cc, "-E", "-P", "-x", "c", *extra, str(header)]
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"{tool}: {shlex.join(cmd)} failed:\n{e.stderr}")


def statements(text: str) -> list[str]:
    """Top-level C statements of preprocessed text (split on ';' outside braces and parentheses)."""
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
    """A parameter list split on top-level commas."""
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
    """``decl`` with a parameter name, adding ``arg<index>`` where the header omits it."""
    if re.search(r"\(\s*\*\s*(\w+)\s*\)", decl):
        return decl
    words = re.findall(r"[A-Za-z_]\w*", re.sub(r"\[[^\]]*\]", "", decl))
    last = words[-1] if words else ""
    if len(words) <= 1 or last in C_TYPE_WORDS or last.endswith("_t"):
        return f"{decl} arg{index}"
    return decl


def param_name(decl: str) -> str:
    """The name of a (named) parameter declaration."""
    fnptr = re.search(r"\(\s*\*\s*(\w+)\s*\)", decl)
    if fnptr:
        return fnptr.group(1)
    return re.findall(r"[A-Za-z_]\w*", re.sub(r"\[[^\]]*\]", "", decl))[-1]


def parse_functions(text: str, prefix: str) -> dict[str, Function]:
    """Every function declaration named ``<prefix>*`` in preprocessed header text (first one wins)."""
    decl_re = re.compile(rf"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>{prefix}\w+)\s*\((?P<params>.*)\)$", re.DOTALL)
    funcs: dict[str, Function] = {}
    for stmt in statements(text):
        if stmt.startswith(("typedef", 'extern "C"')) or "{" in stmt or "}" in stmt:
            continue
        m = decl_re.match(stmt)
        if not m:
            continue
        ret = " ".join(m.group("ret").replace("extern", " ").split())
        raw = split_params(m.group("params"))
        params = () if raw in ([], ["void"]) else tuple(name_param(p, i) for i, p in enumerate(raw))
        funcs.setdefault(m.group("name"), Function(m.group("name"), ret, params))
    return funcs
