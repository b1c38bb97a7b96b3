"""Build hooks: the git commit a build comes from is recorded in the package as ``gpumanager/COMMIT``.

Everything else is declared in pyproject.toml. The commit is taken from ``$GPU_MANAGER_COMMIT``,
else from git when building in a checkout, else from the ``gpumanager/COMMIT`` an sdist carries
(the sdist gets one written at its creation), so a wheel built from an sdist, or from a copy
without ``.git`` given the variable, still says which commit it is. ``gpu-manager --version``
prints it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
RECORDED = Path("gpumanager") / "COMMIT"


def source_commit() -> str:
    """The commit of the source being built, or '' when nothing says."""
    given = os.environ.get("GPU_MANAGER_COMMIT", "").strip()
    if given:
        return given
    if (HERE / ".git").exists():
        try:
            done = subprocess.run(
                ["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
            )
            return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return (HERE / RECORDED).read_text().strip()
    except OSError:
        return ""


class BuildPy(build_py):
    """build_py that writes gpumanager/COMMIT into the build (not in editable installs, which ask git)."""

    def run(self) -> None:
        super().run()
        commit = source_commit()
        if commit and not getattr(self, "editable_mode", False):
            target = Path(self.build_lib) / RECORDED
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(commit + "\n")


class SDist(sdist):
    """sdist that carries gpumanager/COMMIT, for wheels built from it without git."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        commit = source_commit()
        if commit:
            target = Path(base_dir) / RECORDED
            target.unlink(missing_ok=True)  # may be a hard link to the source's
            target.write_text(commit + "\n")


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildPy, "sdist": SDist})
