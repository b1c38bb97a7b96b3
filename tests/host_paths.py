"""The tests never touch the host's real agent directories.

Every agent the tests start gets directories under its test's ``tmp_path``. A test that
forgets one (a ``Config`` or command line without an explicit path) would write into the
host's ``/etc/gpu-manager`` (checkpoint, saved inventory, vm), ``/var/lib/kubelet`` or
``/var/run/cdi``: on a developer's GPU node, the files of the real agent. This plugin takes
a listing of those paths (every entry's type, size, mtime and inode) before and after each
test and fails the test that changed them, and the session if anything changed between its
start and its end (a session-scoped fixture, a process that outlived its test).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

#: What the tests must leave alone: the product's default host paths ($HOST_PATHS_GUARDED, colon-separated,
#: replaces them: the guard's own test points it at a directory of its own).
GUARDED: tuple[Path, ...] = tuple(
    Path(p)
    for p in os.environ.get(
        "HOST_PATHS_GUARDED", "/etc/gpu-manager:/var/lib/kubelet:/var/run/cdi:/var/run/gpu-manager.sock"
    ).split(":")
    if p
)

Entry = tuple[str, int, int, int]
Listing = dict[str, Entry]


def listing(roots: tuple[Path, ...] = GUARDED) -> Listing:
    """path -> (kind, size, mtime_ns, inode) of every entry under ``roots`` (symlinks not followed)."""
    found: Listing = {}

    def add(path: str) -> bool:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "link" if stat.S_ISLNK(st.st_mode) else "file"
        found[path] = (kind, st.st_size if kind != "dir" else 0, st.st_mtime_ns, st.st_ino)
        return kind == "dir"

    for root in roots:
        if not add(str(root)):
            continue
        for dirpath, dirnames, filenames in os.walk(root, onerror=lambda _exc: None):
            for name in dirnames + filenames:
                add(os.path.join(dirpath, name))
    return found


def changes(before: Mapping[str, Entry], after: Mapping[str, Entry]) -> list[str]:
    """What differs between two listings, one line per path."""
    out = [f"created {p}" for p in sorted(after.keys() - before.keys())]
    out += [f"removed {p}" for p in sorted(before.keys() - after.keys())]
    out += [f"changed {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    return out


def _report(what: str, found: list[str]) -> str:
    shown = "\n  ".join(found[:20]) + (f"\n  ... and {len(found) - 20} more" if len(found) > 20 else "")
    return (
        f"{what} the host's agent directories ({', '.join(map(str, GUARDED))}): give every agent and Config "
        f"the test's own directories (tmp_path).\n  {shown}"
    )


_SESSION_START = pytest.StashKey[Listing]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Remember the host paths as the session found them."""
    session.stash[_SESSION_START] = listing()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when the host paths differ from its start."""
    before = session.stash.get(_SESSION_START, None)
    if before is None:
        return
    found = changes(before, listing())
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = _report("the test session changed", found)
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _host_paths_untouched() -> Iterator[None]:
    """Fail the test (at teardown) that created or changed anything under the guarded host paths."""
    before = listing()
    yield
    found = changes(before, listing())
    if found:
        pytest.fail(_report("this test changed", found), pytrace=False)
