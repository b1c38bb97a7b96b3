"""NodePrepareResources and NodeUnprepareResources, without gRPC types.

Prepare, per claim: a claim already prepared answers what it answered before (its
files are rewritten if missing; the API server is not needed). A new claim is read
from the API server (its UID checked), its results of this driver and pool are
checked against the node, recorded in the allocation state (which occupies the
topology tree and writes the checkpoint), then its limit files and CDI spec are
written, and only then is the answer given. A failure leaves nothing behind and
is reported for that claim alone; the other claims of the request proceed.

Unprepare, per claim: frees it, removes its CDI spec and directory; a claim that
is not prepared succeeds (the kubelet retries). A release the checkpoint cannot
take fails, the claim left prepared with its files, so that the kubelet's retry
writes it (answered done unwritten, the claim would come back at the next start,
held for good). Recording and file changes are
serialized, but the API server is asked with no lock held: a claim whose GET
hangs holds up its own Prepare only. A claim unprepared while its GET is in
flight is not prepared by that GET's answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpumanager.allocation import dra_claims
from gpumanager.allocation.allocator import AllocationError, Allocator
from gpumanager.allocation.claims import ClaimAllocation, uid_problem
from gpumanager.device.types import GPUInfo
from gpumanager.dra import cdi, sharing
from gpumanager.dra import constants as c
from gpumanager.dra.apierror import describe, plain
from gpumanager.dra.claims import ClaimError, ClaimNotFound, ClaimRef, config_problem, parse_claim
from gpumanager.dra.quantity import shown
from gpumanager.dra.reads import get_within
from gpumanager.faults import crash_point
from gpumanager.vmanager import claims as claim_files

log = logging.getLogger(__name__)

JSON = dict[str, Any]
ClaimReader = Callable[[str, str], JSON]
"""``(namespace, name) -> claim`` as JSON; raises ClaimError when it cannot be read."""
RunningCheck = Callable[[ClaimAllocation], tuple[list[str], list[str]]]
"""``claim -> (what of its containers still runs, what cannot be told)``, each as the log names it: a prepared claim
the API server no longer has is freed only when both are empty (the rule of the periodic leaked-claim check)."""


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim as the kubelet is told."""

    request: str
    pool: str
    device: str
    cdi_id: str
    share_id: str


#: Seconds a NodePrepareResources is answered within: below the kubelet's 45 s call timeout (k/k
#: pkg/kubelet/cm/dra/plugin, defaultClientCallTimeout), past which it sees no claim's answer.
PREPARE_ANSWER_WITHIN = 30.0


@dataclass
class _Call:
    """One NodePrepareResources: when it is answered, whether it was (no claim is recorded after), and
    the claims it recorded. ``closed`` and ``recorded`` change under the preparer's lock."""

    deadline: float
    closed: bool = False
    recorded: set[str] = field(default_factory=set)


@dataclass
class Outcome:
    """The answer for one claim: devices, or an error."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str = ""


def api_reader(api_client: Any, timeout: float = 10.0) -> ClaimReader:
    """A ClaimReader over the kubernetes client (GET .../resourceclaims/{name}).

    ``timeout`` bounds the whole answer, not each read of it (:func:`~gpumanager.dra.reads.get_within`):
    past the deadline the claim gets its error.
    """
    from gpumanager.kube.rest import ApiException, KubeRest, segment

    rest = KubeRest(api_client)

    def read(namespace: str, name: str) -> JSON:
        path = f"/apis/{c.RESOURCE_API}/namespaces/{segment(namespace)}/resourceclaims/{segment(name)}"
        try:
            out: JSON = get_within(rest, path, timeout)
        except ApiException as exc:
            if exc.status == 404:
                raise ClaimNotFound(f"claim {namespace}/{name} not found") from None
            raise ClaimError(f"claim {namespace}/{name}: cannot read it: {describe(exc)}") from None
        except Exception as exc:  # connection errors, timeouts, a body that is not JSON
            raise ClaimError(f"claim {namespace}/{name}: cannot read it: {plain(exc)}") from None
        if not isinstance(out, dict):
            raise ClaimError(f"claim {namespace}/{name}: cannot read it: the answer is not an object")
        return out

    return read


def _asks_capacity(request: Any) -> bool:
    """Whether a request (``exactly``, or a ``firstAvailable`` alternative) has ``capacity.requests``
    (any shape: the spec is read only to report on the scheduler, never to fail a claim)."""
    capacity = request.get("capacity") if isinstance(request, Mapping) else None
    return bool(capacity.get("requests")) if isinstance(capacity, Mapping) else False


def ignored_capacity(data: Mapping[str, Any], driver: str) -> list[str] | None:
    """The results of ``driver`` (``request device``) whose request asks for capacity
    (``capacity.requests``, of ``exactly`` or of the chosen ``firstAvailable`` alternative) but which
    carry no ``consumedCapacity``; None when no result of the driver answers such a request. Results
    with admin access consume nothing by design and are left out."""
    spec = data.get("spec")
    spec_devices = spec.get("devices") if isinstance(spec, Mapping) else None
    requests = spec_devices.get("requests") if isinstance(spec_devices, Mapping) else None
    asking: set[str] = set()
    for req in requests if isinstance(requests, list) else []:
        if not isinstance(req, Mapping):
            continue
        name = str(req.get("name") or "")
        if _asks_capacity(req.get("exactly")):
            asking.add(name)
        subs = req.get("firstAvailable")
        for sub in subs if isinstance(subs, list) else []:
            if isinstance(sub, Mapping) and _asks_capacity(sub):
                asking.add(f"{name}/{sub.get('name')}")
    status = data.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    found: list[str] | None = None
    for result in results if isinstance(results, list) else []:
        if not isinstance(result, Mapping) or result.get("driver") != driver or result.get("adminAccess") is True:
            continue
        if str(result.get("request") or "") not in asking:
            continue
        found = found if found is not None else []
        if not result.get("consumedCapacity"):
            found.append(f"{result.get('request')} {result.get('device')}")
    return found


class ClaimPreparer:
    """Prepares and unprepares claims (thread-safe, serialized)."""

    def __init__(
        self,
        *,
        read_claim: ClaimReader,
        allocator: Allocator,
        gpus: Sequence[GPUInfo],
        driver: str,
        pool: str,
        cdi_settings: cdi.CDISettings,
        vm_path: Path,
        driver_version: str,
        sharing_check: sharing.SharingCheck | None = None,
        taints: Callable[[], Mapping[int, str]] | None = None,
        capacity_seen: Callable[[str | None], None] | None = None,
        answer_within: float = PREPARE_ANSWER_WITHIN,
        running: RunningCheck | None = None,
    ) -> None:
        self._read = read_claim
        # What still runs of a claim's containers: a claim in doubt found released is freed only once nothing does.
        self._running = running
        self._kept_said: dict[str, str] = {}  # claim UID in doubt -> why it was last said kept
        self._answer_within = answer_within
        # Told, for each claim prepared whose requests ask for capacity, why the scheduler allocated
        # them without it (its DRAConsumableCapacity gate is off), or None when it allocated it.
        self._capacity_seen = capacity_seen
        # The unhealthy taint's value (its cause) on each tainted GPU, by minor: a result tolerates
        # the taint only if it tolerates that value.
        self._taints = taints
        self._sharing = sharing_check
        self._allocator = allocator
        self._gpus = list(gpus)
        self.driver = driver
        self.pool = pool
        self._cdi = cdi_settings
        self._vm = vm_path
        self._driver_version = driver_version
        # Guards the claims and their files; never held while the API server is asked.
        self._lock = threading.Lock()
        self._reading: dict[str, int] = {}  # claim UID -> Prepares waiting for its GET
        # Claim UID -> the number (of self._unprepares) of its last Unprepare while a Prepare of it
        # waited for its GET: that Prepare, begun before, is refused; one begun after is not.
        self._unprepares = 0
        self._unprepared_while_read: dict[str, int] = {}
        # Claim UIDs the kubelet prepared or unprepared since the start: reconcile() leaves them be.
        self._touched: set[str] = set()
        # Claims with a CDI spec but no record whose rebuild could not ask the API server (or could not write
        # their record), by UID: the GPUs (minors) their spec names. Retried (retry_unreadable) until rebuilt
        # or removed; meanwhile no new claim is prepared on those GPUs (they may be taken).
        self._unreadable: dict[str, frozenset[int]] = {}
        self._had_files: set[str] = set()  # UIDs of every claim restore_local() found so: not new claims

    def _answer(self, claim: ClaimAllocation) -> list[PreparedDevice]:
        # The kubelet gives a container the devices whose request names hold the request the
        # container names, a top-level one: a firstAvailable result ("gpus/share") is answered as
        # its request ("gpus"), as the Go helper does, or the container would get no GPU.
        return [
            PreparedDevice(
                d.request.partition("/")[0], d.pool, d.device, cdi.device_id(self._cdi, claim.uid, d), d.share_id
            )
            for d in claim.devices
        ]

    def _write_files(self, claim: ClaimAllocation) -> None:
        if not claim_files.config_current(self._vm, claim, self._driver_version):
            claim_files.write_config(self._vm, claim, self._driver_version)
        if not cdi.spec_current(self._cdi, claim, self._gpus):
            cdi.write_spec(self._cdi, claim, self._gpus)

    def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, Outcome]:
        """One NodePrepareResources: an outcome for every claim UID of the request, within
        ``answer_within`` seconds.

        The claims are read side by side (each one's reads of the API server wait for no other's), and
        recorded in the request's order (of two claims the scheduler placed on one GPU beyond its
        capacity, the first is prepared).
        A claim not prepared by then is answered with an error naming it, and is not recorded later
        behind the kubelet's back (its retry prepares it): the kubelet gives the whole call 45 s and,
        past that, sees none of the claims' answers.
        """
        call = _Call(deadline=time.monotonic() + self._answer_within)
        done: dict[str, Outcome] = {}
        done_lock = threading.Lock()

        def run(ref: ClaimRef, after: threading.Event | None, finished: threading.Event) -> None:
            try:
                outcome = self._prepare_guarded(ref, call, after)
                with done_lock:
                    done[ref.uid] = outcome
            finally:
                finished.set()

        workers = []
        after: threading.Event | None = None
        for ref in refs:
            finished = threading.Event()
            worker = threading.Thread(target=run, args=(ref, after, finished), name="prepare-claim", daemon=True)
            workers.append((ref, worker))
            after = finished
        for _, worker in workers:
            worker.start()
        for _, worker in workers:
            worker.join(max(0.0, call.deadline - time.monotonic()))
        if any(worker.is_alive() for _, worker in workers):
            with self._lock:  # a claim being recorded now finishes first; none is recorded after this
                call.closed = True
            for ref, worker in workers:
                if ref.uid in call.recorded:  # recorded and its files written: its answer follows at once
                    worker.join()
        with done_lock:
            out = dict(done)
        for ref, _ in workers:
            if ref.uid not in out:
                out[ref.uid] = Outcome(
                    error=f"claim {ref} ({ref.uid}): not prepared within {self._answer_within:g} s (the API server "
                    "is slow to answer the reads its Prepare makes); nothing was recorded, the kubelet retries"
                )
                log.warning("NodePrepareResources: %s", out[ref.uid].error)
        return out

    def _prepare_guarded(self, ref: ClaimRef, call: _Call, after: threading.Event | None) -> Outcome:
        """:meth:`_prepare_one`, every failure as the claim's own error."""
        try:
            return Outcome(self._prepare_one(ref, call, after))
        except (ClaimError, AllocationError) as exc:
            log.warning("NodePrepareResources: %s", exc)
            return Outcome(error=str(exc))
        except OSError as exc:
            message = f"claim {ref} ({ref.uid}): cannot write its files: {exc}"
            log.error("NodePrepareResources: %s", message)
            return Outcome(error=message)
        except Exception as exc:  # a claim no check foresaw: its own error, the others go on
            message = f"claim {ref} ({ref.uid}): cannot be prepared: {type(exc).__name__}: {exc}"
            log.exception("NodePrepareResources: %s", message)
            return Outcome(error=message)

    def _prepare_one(self, ref: ClaimRef, call: _Call, after: threading.Event | None) -> list[PreparedDevice]:
        """Prepare one claim of ``call``: read it, then record it once the claim before it in the
        request is done (``after``), unless the call was answered meanwhile."""
        _check_ref_uid(ref)
        with self._lock:
            self._touched.add(ref.uid)
            self._unreadable.pop(ref.uid, None)  # the kubelet's word is newer: its Prepare records it
            known = self._allocator.claim(ref.uid)
            if known is not None:
                _same_claim(known, ref)
                self._write_files(known)
                log.info("claim %s (%s) is already prepared: same answer", ref, ref.uid)
                return self._answer(known)
            self._reading[ref.uid] = self._reading.get(ref.uid, 0) + 1
            begun = self._unprepares
        try:
            if not ref.name or not ref.namespace:
                raise ClaimError(f"claim {ref!s} ({ref.uid!r}): namespace, name and UID are all required")
            t0 = time.perf_counter()
            # Outside the lock: a GET that hangs holds this claim only, never the other calls.
            data = self._read(ref.namespace, ref.name)
            self._check_sharing(ref, data)
            t1 = time.perf_counter()
            if after is not None:
                after.wait(max(0.0, call.deadline - time.monotonic()))
            with self._lock:
                if call.closed:
                    raise ClaimError(f"claim {ref} ({ref.uid}): answered before its reads ended; not recorded")
                answer = self._record(ref, data, t0, t1, begun)
                call.recorded.add(ref.uid)
                return answer
        finally:
            with self._lock:
                left = self._reading[ref.uid] - 1
                if left:
                    self._reading[ref.uid] = left
                else:
                    del self._reading[ref.uid]
                    self._unprepared_while_read.pop(ref.uid, None)

    def _check_sharing(self, ref: ClaimRef, data: JSON) -> None:
        """ClaimError when a container would use this claim beside another of ours and one is a share."""
        if self._sharing is None:
            return
        try:
            claim, _ = parse_claim(data, ref, driver=self.driver, pool=self.pool, gpus=self._gpus)
        except ClaimError:
            return  # refused with its own reason when it is recorded
        try:
            found = sharing.review(self._sharing, ref, data, claim)
        except ClaimError as exc:  # a pod or claim that cannot be read: no pass unseen, the kubelet retries
            raise ClaimError(f"claim {ref} ({ref.uid}): not prepared: {exc}") from None
        except (AttributeError, TypeError, ValueError, KeyError) as exc:  # an API server's odd answer
            raise ClaimError(
                f"claim {ref} ({ref.uid}): not prepared: a field of the wrong shape in the claim's reservedFor, a "
                f"pod it is reserved for, or another claim of that pod's containers ({shown(str(exc))}); the "
                "containers that use it cannot be checked"
            ) from None
        if found.problem is not None:
            raise ClaimError(found.problem)

    def _record(self, ref: ClaimRef, data: JSON, t0: float, t1: float, begun: int) -> list[PreparedDevice]:
        """Second half of a Prepare, under the lock: check, record, write the files, answer. ``begun``:
        the count of Unprepares when this Prepare began (one of this claim since then refuses it)."""
        if self._unprepared_while_read.get(ref.uid, -1) >= begun:
            raise ClaimError(
                f"claim {ref} ({ref.uid}) was unprepared while the API server was asked for it; not prepared"
            )
        known = self._allocator.claim(ref.uid)
        if known is not None:  # a concurrent Prepare of the same claim recorded it first
            self._write_files(known)
            return self._answer(known)
        claim, tolerant = parse_claim(
            data,
            ref,
            driver=self.driver,
            pool=self.pool,
            gpus=self._gpus,
            taints=self._taints() if self._taints is not None else None,
        )
        problem = config_problem(data, ref, claim, self.driver)
        if problem is not None:
            raise ClaimError(problem)
        self._check_unreadable(claim)
        self._allocator.prepare_claim(claim, allow_unhealthy=tolerant)
        crash_point("prepare-after-checkpoint")
        t2 = time.perf_counter()
        try:
            self._write_files(claim)
        except Exception:  # recorded but not usable: undone, so the kubelet's retry starts afresh
            try:
                self._allocator.unprepare_claim(claim.uid)
            except AllocationError as exc:  # kept prepared: the kubelet's retried Prepare (or its Unprepare) ends it
                log.error("claim %s (%s): undoing its record after its files failed: %s", ref, ref.uid, exc)
            finally:
                try:
                    self._remove_files(claim.uid)
                except OSError as exc:  # the restart's reconcile looks at files without a record again
                    log.error("claim %s (%s): cannot remove what was written of its files: %s", ref, ref.uid, exc)
            raise  # the files' error: why the claim was not prepared
        t3 = time.perf_counter()
        try:  # a report on the scheduler: never fails the claim, recorded and usable now
            self._check_capacity(ref, data)
        except Exception as exc:
            log.error(
                "claim %s (%s): cannot tell whether its capacity was allocated: %s: %s",
                ref,
                ref.uid,
                type(exc).__name__,
                exc,
            )
        log.debug(
            "claim %s prepared: read %.1f ms, recorded and checkpointed %.1f ms, files %.1f ms",
            ref,
            (t1 - t0) * 1000,
            (t2 - t1) * 1000,
            (t3 - t2) * 1000,
        )
        return self._answer(claim)

    def _check_capacity(self, ref: ClaimRef, data: JSON) -> None:
        """Tell ``capacity_seen`` whether the scheduler allocated the capacity the claim's requests ask
        for (nothing for a claim that asks for none)."""
        if self._capacity_seen is None:
            return
        asked = ignored_capacity(data, self.driver)
        if asked is None:
            return
        if not asked:
            self._capacity_seen(None)
            return
        message = (
            f"claim {ref} ({ref.uid}) was allocated {', '.join(asked)} without the capacity it asks for: "
            "kube-scheduler has feature gate DRAConsumableCapacity off (Kubernetes 1.35 needs it on "
            "kube-apiserver, kube-scheduler and kubelet), so it gives each GPU to one claim, whole, whatever "
            "the ResourceSlice offers; prepared as whole GPUs (no limits)"
        )
        self._capacity_seen(message)  # logged there

    def _check_unreadable(self, claim: ClaimAllocation) -> None:
        """ClaimError when a GPU of ``claim`` is named by the spec of a claim whose record was lost and
        which could not be rebuilt yet: it may hold that GPU, so preparing could over-commit it. A claim
        that had files itself (prepared before the restart beside the other) is not new: not refused."""
        if claim.uid in self._had_files:
            return
        held = {uid: minors & set(claim.minors) for uid, minors in self._unreadable.items() if uid != claim.uid}
        held = {uid: minors for uid, minors in held.items() if minors}
        if not held:
            return
        gpus = sorted({m for minors in held.values() for m in minors})
        raise ClaimError(
            f"claim {claim.key} ({claim.uid}): GPU {', '.join(map(str, gpus))} may be held by claim "
            f"{', '.join(sorted(held))}, whose record was lost and which the API server could not be asked "
            "about yet; not prepared until that claim is rebuilt (retried in the background), try again"
        )

    def unreadable(self) -> Mapping[str, frozenset[int]]:
        """Claims with files but no record whose rebuild waits for the API server: UID -> GPUs (minors)."""
        with self._lock:
            return dict(self._unreadable)

    def _remove_files(self, uid: str) -> None:
        """Remove the claim's spec and directory (``uid`` is checked: no path leaves their roots). Each is
        removed whatever became of the other (a spec that cannot be removed must not leave the directory,
        which a restart would take for a claim whose record was lost); the first error is raised after."""
        try:
            cdi.remove_spec(self._cdi, uid)
        finally:
            claim_files.remove(self._vm, uid)

    def free_gone(self, claim: ClaimAllocation, why: str) -> bool:
        """Free a prepared claim the kubelet will never unprepare: the API server no longer has it (``why``) and
        no pod of the node uses it. Its record is released (its GPUs' capacity with it) and its CDI spec and
        directory removed, in one logged line naming it and its GPUs. Nothing is done (False) where the claim
        changed meanwhile (the kubelet unprepared it, or a Prepare of it is under way), or where its release
        cannot be written (logged; tried again at the next check)."""
        gpus = ", ".join(dict.fromkeys(d.device for d in claim.devices)) or "none"
        with self._lock:
            if claim.uid in self._reading or self._allocator.claim(claim.uid) != claim:
                return False
            try:
                self._allocator.unprepare_claim(claim.uid)
            except AllocationError as exc:
                log.error("claim %s (%s) on %s: %s, but it cannot be freed: %s", claim.key, claim.uid, gpus, why, exc)
                return False
            try:
                self._remove_files(claim.uid)
            except OSError as exc:  # the record is freed: a restart removes what is left (a spec without record)
                log.error("claim %s (%s): cannot remove its files: %s", claim.key, claim.uid, exc)
        log.warning(
            "freed claim %s (%s) on %s: %s and no pod of this node uses it, but the kubelet never unprepared it (its "
            "DRA state lost, or the pod force-deleted while it was down); its CDI spec and directory are removed",
            claim.key,
            claim.uid,
            gpus,
            why,
        )
        return True

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """One NodeUnprepareResources: an error text (empty: done) for every claim UID."""
        out: dict[str, str] = {}
        with self._lock:
            for ref in refs:
                problem = uid_problem(ref.uid)
                if problem is not None:
                    out[ref.uid] = f"claim {ref}: {problem}; nothing was removed"
                    log.error("NodeUnprepareResources: %s", out[ref.uid])
                    continue
                known = self._allocator.claim(ref.uid)
                if known is not None and ref.name and (known.namespace, known.name) != (ref.namespace, ref.name):
                    out[ref.uid] = f"claim {ref} ({ref.uid}): that UID is claim {known.key}; nothing was removed"
                    log.error("NodeUnprepareResources: %s", out[ref.uid])
                    continue
                self._touched.add(ref.uid)
                self._unreadable.pop(ref.uid, None)
                self._kept_said.pop(ref.uid, None)
                if ref.uid in self._reading:
                    self._unprepared_while_read[ref.uid] = self._unprepares
                    self._unprepares += 1
                try:
                    freed = self._allocator.unprepare_claim(ref.uid)
                    crash_point("unprepare-after-checkpoint")
                    self._remove_files(ref.uid)
                    if freed is None:
                        log.info("claim %s (%s) was not prepared: nothing to do", ref, ref.uid)
                    out[ref.uid] = ""
                except (AllocationError, OSError) as exc:
                    out[ref.uid] = f"claim {ref} ({ref.uid}): {exc}"
                    log.error("NodeUnprepareResources: %s", out[ref.uid])
        return out

    def restore_files(self, *, verify_recovered: bool = False) -> list[str]:
        """:meth:`restore_local`, then :meth:`reconcile`: the whole restoration in one call."""
        self.restore_local()
        return self.reconcile(verify_recovered=verify_recovered)

    def restore_local(self) -> None:
        """After a restart, before the kubelet is served: remove what a spec write cut short left, and
        rewrite the missing files of every recovered claim. Nothing here asks the API server."""
        with self._lock:
            for leftover in cdi.unfinished_writes(self._cdi):
                log.info("removing %s, left by a write that did not finish", leftover)
                leftover.unlink(missing_ok=True)
            for claim in self._allocator.claims():
                try:
                    self._write_files(claim)
                except Exception as exc:  # one claim's files: the others and the start go on
                    log.error("claim %s (%s): cannot restore its files: %s", claim.key, claim.uid, exc)
            # Claims with files (a spec, or only a directory: an Unprepare cut short between removing the
            # two) but no record wait for reconcile(): until it has rebuilt or removed them, their GPUs
            # take no new claim (they may be held; all of them where no spec says which).
            known = {claim.uid for claim in self._allocator.claims()}
            for uid in self._with_files():
                if uid not in known:
                    self._unreadable[uid] = cdi.spec_gpus(self._cdi, uid, self._gpus)
                    self._had_files.add(uid)

    def reconcile(self, *, verify_recovered: bool = False) -> list[str]:
        """After a restart, while the kubelet is served (the API server may be slow or hang): a claim
        whose spec or directory is on disk but whose record was lost or could not be trusted is rebuilt
        from the API server, and its files removed only when the API server no longer has it, or no longer
        allocates it a device of the driver (nothing can prepare it here again). Returns the
        UIDs removed. A claim the kubelet prepared or unprepared since the start is left as the kubelet
        had it (its word is newer). A claim the API server cannot be asked about now stays in
        :meth:`unreadable` (no new claim on its GPUs) for :meth:`retry_unreadable`.

        ``verify_recovered`` (the checkpoint had damage, so a release may have been lost with it):
        a recovered claim the API server no longer has, or reserves for no pod, is freed and its
        files removed once nothing of its containers runs (kept in doubt until then, looked at again by
        :meth:`retry_unreadable`). A claim still marked in doubt (a check an earlier start could not finish) is
        checked whatever ``verify_recovered``; one whose check cannot conclude now (the API server not
        answering, its release not written) stays in doubt, in the checkpoint too, for
        :meth:`retry_unreadable` and the next start.
        """
        with self._lock:
            known = {c.uid: c for c in self._allocator.claims()}
        check = [uid for uid, c in known.items() if verify_recovered or c.in_doubt]
        removed = [uid for uid in check if self._checked(known[uid])]
        with self._lock:
            unknown = [uid for uid in self._with_files() if uid not in known and uid not in removed]
        removed += self._rebuild_all(unknown)
        return removed

    def _with_files(self) -> list[str]:
        """UIDs of the claims with a CDI spec or a directory on disk."""
        return sorted(set(cdi.specs_on_disk(self._cdi)) | set(_claim_dirs(self._vm)))

    def retry_unreadable(self) -> int:
        """Try again to rebuild the claims whose rebuild could not ask the API server, and to check the
        claims still in doubt (:meth:`unchecked`); returns how many of the first still wait."""
        with self._lock:
            uids = list(self._unreadable)
        if uids:
            self._rebuild_all(uids)
        for claim in self._allocator.claims():
            if claim.in_doubt:
                self._checked(claim)
        with self._lock:
            return len(self._unreadable)

    def unchecked(self) -> list[str]:
        """UIDs of the prepared claims recovered from a damaged checkpoint whose check against the API server
        has not concluded yet (retried by :meth:`retry_unreadable`)."""
        return [c.uid for c in self._allocator.claims() if c.in_doubt]

    def _rebuild_all(self, uids: Sequence[str]) -> list[str]:
        """:meth:`_rebuild` each claim, then write the rebuilt ones' files; returns the UIDs removed.
        A claim the API server could not be asked about is kept in ``_unreadable`` (its spec's GPUs)."""
        removed: list[str] = []
        rebuilt: list[ClaimAllocation] = []
        for uid in uids:
            try:
                outcome, claim = self._rebuild(uid)
            except Exception as exc:  # one odd claim must not stop the others' rebuild
                log.error(
                    "claim %s: cannot rebuild it from the API server (%s: %s); left as it is",
                    uid,
                    type(exc).__name__,
                    exc,
                )
                outcome, claim = "kept", None
            with self._lock:
                if outcome == "unreadable" and uid not in self._touched:
                    self._unreadable[uid] = cdi.spec_gpus(self._cdi, uid, self._gpus)
                else:
                    self._unreadable.pop(uid, None)
            if outcome == "removed":
                removed.append(uid)
            elif claim is not None:
                rebuilt.append(claim)
        with self._lock:
            for claim in rebuilt:
                if self._allocator.claim(claim.uid) != claim:
                    continue  # the kubelet unprepared it (or prepared it anew) meanwhile: its word stands
                try:
                    self._write_files(claim)
                except OSError as exc:
                    log.error("claim %s (%s): cannot restore its files: %s", claim.key, claim.uid, exc)
        return removed

    def _checked(self, claim: ClaimAllocation) -> bool:
        """:meth:`_free_if_gone`, kept on an error no check foresaw (the next claims are checked all the same)."""
        try:
            return self._free_if_gone(claim)
        except Exception as exc:
            log.error("claim %s (%s): cannot check it (%s: %s); kept", claim.key, claim.uid, type(exc).__name__, exc)
            return False

    def _free_if_gone(self, claim: ClaimAllocation) -> bool:
        """Whether a recovered claim was released in a change the damaged checkpoint lost: the API server
        no longer has it (or has another claim of that name), or reserves it for no pod. Then it is
        freed and its files removed, once nothing of its containers runs (the ``running`` check: a process
        its pids.config lists alive, one NVML lists on a GPU it holds whole, or NVML unable to tell; a pod
        force-deleted while the kubelet was down leaves its containers running). A claim kept (reserved, or
        prepared or unprepared by the kubelet since the start) is no longer in doubt; one whose check cannot
        conclude (the API server not answering, its release not written, its containers still running)
        stays in doubt, prepared and its room counted."""
        ref = ClaimRef(claim.namespace, claim.name, claim.uid)
        try:
            data: JSON | None = self._read(claim.namespace, claim.name)
        except ClaimNotFound:
            data = None
        except ClaimError as exc:
            log.warning(
                "claim %s (%s): cannot check it against the API server (%s); kept, checked again later",
                ref,
                claim.uid,
                exc,
            )
            return False
        meta = data.get("metadata") if isinstance(data, dict) else None
        if isinstance(meta, dict) and meta.get("uid") == claim.uid:
            status = data.get("status") if isinstance(data, dict) else None
            if isinstance(status, dict) and status.get("reservedFor"):
                self._kept_said.pop(claim.uid, None)
                dra_claims.settle_doubt(self._allocator, claim.uid)
                return False
            reason = "it is reserved for no pod"
        else:
            reason = "the API server no longer has it"
        if claim.uid not in self._touched and self._still_runs(claim, ref, reason):
            return False
        with self._lock:
            if claim.uid in self._touched:  # the kubelet prepared or unprepared it meanwhile: its word stands
                self._kept_said.pop(claim.uid, None)
                dra_claims.settle_doubt(self._allocator, claim.uid)
                return False
            self._kept_said.pop(claim.uid, None)
            log.warning("claim %s (%s) came back from a damaged checkpoint, but %s: freeing it", ref, claim.uid, reason)
            try:
                self._allocator.unprepare_claim(claim.uid)
            except AllocationError as exc:
                # Kept, files and all, in doubt as the checkpoint has it: checked again once the checkpoint
                # can be written, or at the next start (no kubelet will unprepare it).
                log.error("claim %s (%s): %s; checked again later", ref, claim.uid, exc)
                return False
            self._remove_files(claim.uid)
        return True

    def _still_runs(self, claim: ClaimAllocation, ref: ClaimRef, reason: str) -> bool:
        """Whether a claim in doubt found released must be kept for its containers, which may still run: the
        ``running`` check names what of them runs, or what cannot be told. Why it is kept is logged once while it
        stays the same. Not asked with the preparer's lock held (NVML may be slow to answer)."""
        if self._running is None:
            return False
        running, unknown = self._running(claim)
        if running:
            text = (
                f"claim {ref} ({claim.uid}) came back from a damaged checkpoint and {reason}, but the containers that "
                f"used it may still run: {'; '.join(running)}; kept (prepared, its room counted) and in doubt, looked "
                "at again until nothing runs"
            )
        elif unknown:
            text = (
                f"claim {ref} ({claim.uid}) came back from a damaged checkpoint and {reason}, but whether the "
                f"containers that used it still run processes on the GPUs it holds whole cannot be told: "
                f"{'; '.join(unknown)}; kept (prepared, its room counted) and in doubt, looked at again"
            )
        else:
            return False
        with self._lock:
            if self._kept_said.get(claim.uid) != text:
                log.warning("%s", text)
            self._kept_said[claim.uid] = text
        return True

    def _rebuild(self, uid: str) -> tuple[str, ClaimAllocation | None]:
        """A claim with files but no record: ("rebuilt", claim) from the API server, ("removed", None)
        when the API server no longer has it, ("unreadable", None) when the API server cannot be asked
        now or its record cannot be written now (tried again later), ("kept", None) when it cannot be told
        otherwise."""
        key = claim_files.recorded_key(self._vm, uid)
        if key is None:
            log.warning("claim %s has a CDI spec but no record and no readable vcuda.config: files left", uid)
            return "kept", None
        namespace, _, name = key.partition("/")
        ref = ClaimRef(namespace, name, uid)
        try:
            data = self._read(namespace, name)
        except ClaimNotFound:
            data = None
        except ClaimError as exc:
            log.warning(
                "claim %s (%s) has files but no record, and cannot be rebuilt now (tried again later; "
                "meanwhile its GPUs take no new claim): %s",
                ref,
                uid,
                exc,
            )
            return "unreadable", None
        if data is None or (data.get("metadata") or {}).get("uid") != uid:  # deleted, or recreated
            return self._remove_gone(ref, "the API server no longer has it")
        if not _holds_driver(data, self.driver):
            # Deallocated since (its pod ended while the agent was down, between the Unprepare's record and
            # the removal of its files), or allocated again to another driver: the kubelet prepares only
            # an allocated claim, so nothing can prepare it here again.
            return self._remove_gone(ref, f"it is no longer allocated a device of driver {self.driver}")
        pool = self._pool_of(data)
        try:
            claim, _tolerant = parse_claim(data, ref, driver=self.driver, pool=pool, gpus=self._gpus)
            with self._lock:
                if uid in self._touched:
                    return "kept", None
                self._allocator.prepare_claim(claim, allow_unhealthy=frozenset(claim.minors))
        except AllocationError as exc:
            if exc.kind == "unavailable":  # its record cannot be written now (every GPU's health is tolerated)
                log.error(
                    "claim %s (%s) has files but no record, and cannot be recorded again now (tried again later; "
                    "meanwhile its GPUs take no new claim): %s",
                    ref,
                    uid,
                    exc,
                )
                return "unreadable", None
            log.error("claim %s (%s) has files but no record, and cannot be recorded again: %s", ref, uid, exc)
            return "kept", None
        except ClaimError as exc:
            log.error("claim %s (%s) has files but no record, and cannot be recorded again: %s", ref, uid, exc)
            return "kept", None
        log.warning("claim %s (%s): its record was lost or could not be trusted; rebuilt from the API server", ref, uid)
        if pool != self.pool:
            log.warning(
                "claim %s (%s) was prepared under pool %r, not this node's (%r): the node was renamed? It stays "
                "prepared, its GPUs held and its limits enforced, until the kubelet unprepares it",
                ref,
                uid,
                pool,
                self.pool,
            )
        return "rebuilt", claim

    def _remove_gone(self, ref: ClaimRef, why: str) -> tuple[str, ClaimAllocation | None]:
        """:meth:`_rebuild` of a claim nothing can prepare here again: its files are removed ("removed"),
        unless the kubelet prepared or unprepared it meanwhile ("kept": its word is newer)."""
        with self._lock:
            if ref.uid in self._touched:
                return "kept", None
            log.info("removing the CDI spec and directory of claim %s (%s): %s", ref, ref.uid, why)
            self._remove_files(ref.uid)
        return "removed", None

    def _pool_of(self, data: Mapping[str, Any]) -> str:
        """The pool a claim with this node's files was prepared from: this node's, or, where every result of
        the driver names one other pool, that one (the node's name then: the node was renamed since; the
        files show this node prepared it)."""
        status = data.get("status")
        allocation = status.get("allocation") if isinstance(status, Mapping) else None
        devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
        results = devices.get("results") if isinstance(devices, Mapping) else None
        pools = {
            r.get("pool")
            for r in (results if isinstance(results, list) else [])
            if isinstance(r, Mapping) and r.get("driver") == self.driver
        }
        if len(pools) == 1:
            (pool,) = pools
            if isinstance(pool, str) and pool:
                return pool
        return self.pool

    def claims(self) -> Mapping[str, ClaimAllocation]:
        """Prepared claims by UID."""
        return {c.uid: c for c in self._allocator.claims()}


def _claim_dirs(vm_path: Path) -> list[str]:
    """UIDs of the claim directories under ``vm_path``: those whose own vcuda.config names a claim
    (``<namespace>/<name>``; a device-plugin pod's directory holds one per container, a level below)."""
    try:
        entries = sorted(p.name for p in vm_path.iterdir() if p.is_dir())
    except OSError:
        return []
    return [u for u in entries if uid_problem(u) is None and claim_files.recorded_key(vm_path, u) is not None]


def _holds_driver(data: Mapping[str, Any], driver: str) -> bool:
    """Whether the claim as the API server has it is allocated a device of ``driver``."""
    status = data.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    listed = results if isinstance(results, list) else []
    return any(isinstance(r, Mapping) and r.get("driver") == driver for r in listed)


def _same_claim(known: ClaimAllocation, ref: ClaimRef) -> None:
    """ClaimError when the kubelet names a prepared claim's UID with another namespace or name."""
    if (known.namespace, known.name) != (ref.namespace, ref.name):
        raise ClaimError(f"claim {ref} ({ref.uid}): that UID is claim {known.key}, prepared on this node; not answered")


def _check_ref_uid(ref: ClaimRef) -> None:
    """ClaimError when the kubelet's UID cannot name a directory and a CDI spec."""
    problem = uid_problem(ref.uid)
    if problem is not None:
        raise ClaimError(f"claim {ref}: {problem}")
