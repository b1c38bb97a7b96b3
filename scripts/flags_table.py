"""Write the README's flags table from the flag declarations in gpumanager/config.py.

    python scripts/flags_table.py          # rewrite the table in README.md
    python scripts/flags_table.py --check  # exit 1 if README.md is not current

The table sits between the ``<!-- flags:begin -->`` and ``<!-- flags:end -->`` markers.
"""

from __future__ import annotations

import sys
from pathlib import Path

from gpumanager import flagspec
from gpumanager.config import Config

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- flags:begin -->"
END = "<!-- flags:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The Markdown table, one row per flag, in declaration order."""
    rows = [
        "| Flag | Default | Environment | Meaning |",
        "|---|---|---|---|",
    ]
    for f in flagspec.flag_fields(Config):
        default = _cell(f.default_text())
        if f.spec.literal_default:
            default = f"`{default}`"
        rows.append(f"| `{f.flag}` | {default} | `{f.env}` | {_cell(f.spec.help)} |")
    return "\n".join(rows) + "\n"


def replace_block(readme: str) -> str:
    """README text with the block between the markers replaced by the current table."""
    head, sep, rest = readme.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{README}: markers {BEGIN} / {END} not found")
    return f"{head}{BEGIN}\n{render()}{END}{tail}"


def main(argv: list[str]) -> int:
    current = README.read_text()
    wanted = replace_block(current)
    if "--check" in argv:
        if current != wanted:
            print(f"{README.name}: the flags table is out of date; run: python scripts/flags_table.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
