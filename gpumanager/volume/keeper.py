"""Keeps the driver mirror built: at start, every few minutes, and on request.

It also knows whether shared containers can be served: in share mode their
answer mounts the share-mode tree, which must exist and hold the interceptor;
:attr:`MirrorKeeper.share_problem` says why not when it does not.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gpumanager.volume.errors import SourceChangedError, VolumeError

if TYPE_CHECKING:
    from gpumanager.volume.manager import VdriverResult

log = logging.getLogger(__name__)

DEFAULT_VDRIVER = Path("/etc/gpu-manager/vdriver")
#: How often the driver mirror is checked again (an unchanged driver costs a few ms and changes nothing).
RECHECK_SECONDS = 300.0
#: While a driver install seems to be going on (see gpumanager.volume.settle): how soon to look again,
#: and how long the driver files must be left alone before a half-installed look is the host's state.
INSTALL_RETRY_SECONDS = 10.0
INSTALL_SETTLE_SECONDS = 60.0


class MirrorKeeper:
    """Builds the vdriver trees and rechecks them in the background."""

    def __init__(
        self,
        *,
        volume_config: str,
        driver_root: str,
        share_mode: bool,
        interceptor: str,
        gpu_client: Path | None = None,
        proc_root: str = "/proc",
        period: float = RECHECK_SECONDS,
        retry: float = INSTALL_RETRY_SECONDS,
        settle: float = INSTALL_SETTLE_SECONDS,
        clock: Callable[[], float] = time.time,
        report: Callable[[str], None] | None = None,
    ) -> None:
        """``report`` is called after each build with its error ('' when it succeeded)."""
        self._report = report or (lambda _error: None)
        self._gpu_client = gpu_client
        self._proc_root = proc_root
        self._config = volume_config
        self._root = driver_root
        self._share = share_mode
        self._interceptor = interceptor
        self._period = period
        self._retry = retry
        self._settle = settle
        self._clock = clock
        #: seconds until the next check: the period, or the retry while an install goes on
        self.next_check = period
        #: why the driver looks half-installed ('' when it does not); logged once per install
        self.install_in_progress = ""
        self.nvidia = str(DEFAULT_VDRIVER / "nvidia")
        self.origin = str(DEFAULT_VDRIVER / "origin")
        self.error = ""
        self._built = False
        self._mirror_problem = ""
        self._reported: set[str] = set()  # the warnings of the last build, already logged
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def share_problem(self) -> str:
        """Why shared containers cannot get the interceptor now ('' when they can, or share mode is off)."""
        if not self._share:
            return ""
        if not self._config:
            return "share mode has no interceptor: --volume-config is not set, so no driver tree holds it"
        if not self._built:
            return f"share mode has no interceptor: the driver mirror is not built ({self.error or 'not yet'})"
        return self._mirror_problem

    def build(self) -> bool:
        """Build (or check) the mirror now; False with :attr:`error` set when it fails. A failure is
        logged by the rechecks after :meth:`start` (once until it changes); the first build's caller
        reports its own. Either way the outcome goes to ``report``."""
        if not self._config:
            return False
        built = self._build()
        self._report(self.error)
        return built

    def _build(self) -> bool:
        # Loaded here, after registration: ELF reading is the slowest import of the agent.
        from gpumanager.volume.manager import build_vdriver

        try:
            result = build_vdriver(
                volume_config=Path(self._config),
                driver_root=Path(self._root),
                share_mode=self._share,
                interceptor=Path(self._interceptor) if self._share else None,
                gpu_client=self._gpu_client,
                proc_root=Path(self._proc_root),
                now=self._clock(),
                settle_seconds=self._settle,
            )
        except VolumeError as exc:
            if self._new_error(str(exc)):
                log.error("driver mirror not built: %s", exc)
            # a driver file written while it was read: an install is going on, look again soon
            if isinstance(exc, SourceChangedError):
                self.next_check = self._retry
            self._configured_paths()
            return False
        except Exception as exc:  # a reader's surprise must not end the agent's start
            if self._new_error(f"{type(exc).__name__}: {exc}"):
                log.exception("driver mirror not built: %s", self.error)
            self._configured_paths()
            return False
        if result.install_in_progress:
            return self._wait_for_install(result)
        if self.install_in_progress:
            log.info("driver mirror: the driver files have settled; mirroring them")
        self.install_in_progress = ""
        self.next_check = self._period
        # A warning is logged when it appears, not again at every recheck of an unchanged host.
        for warning in _grouped([w for w in result.warnings if w not in self._reported]):
            log.warning("driver mirror: %s", warning)
        self._reported = set(result.warnings)
        for tree in result.removed_trees:
            log.info("driver mirror: removed unused tree %s", tree)
        if result.changed or not self._built:  # and at the start: which driver the mirror holds
            log.info(
                "driver mirror %s: %s",
                result.driver_version.full if result.driver_version else "(no libcuda found)",
                ", ".join(f"{v.path} -> {v.tree.name}" + (" (new)" if v.built else "") for v in result.volumes),
            )
        return self._use(result)

    def _new_error(self, error: str) -> bool:
        """Record a failed build's ``error``; whether to log it: not the first build's, which the agent
        reports itself when :meth:`build` returns False, and not the same failure again at each recheck."""
        repeated = error == self.error
        self.error = error
        return self._thread is not None and not repeated

    def _use(self, result: VdriverResult) -> bool:
        """Answer Allocate with the trees ``result`` describes; True."""
        self.nvidia = str(result.nvidia or DEFAULT_VDRIVER / "nvidia")
        self.origin = str(result.origin or DEFAULT_VDRIVER / "origin")
        self.error = ""
        if result.share_problem and result.share_problem != self._mirror_problem:
            log.error("driver mirror: %s", result.share_problem)
        elif self._mirror_problem and not result.share_problem:
            log.info("driver mirror: shared containers get the interceptor again")
        self._mirror_problem = result.share_problem
        self._built = True
        return True

    def _wait_for_install(self, result: VdriverResult) -> bool:
        """The driver is being installed: keep what is published, look again soon, say so once."""
        why = result.install_in_progress
        if not self.install_in_progress:
            log.warning("driver mirror: %s; the published trees are kept, checking again every %g s", why, self._retry)
        else:
            log.debug("driver mirror: still waiting: %s", why)
        self.install_in_progress = why
        self.next_check = self._retry
        if self._built:
            return True  # the trees of the last build stay in use, as they are
        if not result.volumes:
            self.error = f"driver install in progress: {why}"
            self._configured_paths()
            return False
        # First build of this agent: the trees an earlier run published stay in use meanwhile.
        return self._use(result)

    def _configured_paths(self) -> None:
        """After a failed build: report the mount paths volume.conf names (an earlier tree may lie
        there, and the next build publishes there), not the default base, unless a build succeeded."""
        if self._built:
            return
        from gpumanager.volume.config import load_volume_config, mount_sources

        try:
            nvidia, origin = mount_sources(load_volume_config(Path(self._config)))
        except VolumeError:
            return
        self.nvidia = str(nvidia or DEFAULT_VDRIVER / "nvidia")
        self.origin = str(origin or DEFAULT_VDRIVER / "origin")

    def start(self) -> None:
        """Recheck in the background every period (and on :meth:`wake`)."""
        if not self._config:
            log.warning(
                "--volume-config is not set: no driver mirror is built; containers mount %s", (self.nvidia, self.origin)
            )
            return
        self._thread = threading.Thread(target=self._run, name="volume-check", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Check now."""
        self._wake.set()

    def stop(self) -> None:
        """End the loop."""
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.next_check)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.build()
            except Exception:
                log.exception("driver mirror check failed; trying again later")


#: A program of the driver the mirror did not find (gpumanager.volume.discovery's warning).
_MISSING_BINARY = re.compile(r"^binary ('[^']*') not found on the PATH of driver root (.*); skipped\Z")


def _grouped(warnings: Sequence[str]) -> list[str]:
    """The warnings to log, the programs missing under one driver root in one line (a host without MPS,
    debugdump or persistenced lacks several)."""
    missing: dict[str, list[str]] = {}
    out: list[str] = []
    for warning in warnings:
        match = _MISSING_BINARY.match(warning)
        if match is None:
            out.append(warning)
        else:
            missing.setdefault(match.group(2), []).append(match.group(1))
    for root, names in missing.items():
        what = "binary" if len(names) == 1 else "binaries"
        out.append(f"{what} {', '.join(names)} not found on the PATH of driver root {root}; skipped")
    return out
