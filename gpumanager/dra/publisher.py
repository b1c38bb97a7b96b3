"""Keeps the node's ResourceSlice in the API server equal to what the node has.

One slice, ``<node>-<driver>``, holds every GPU (one pool named after the node).
A sync lists the slices of this node and driver (field selectors
``spec.nodeName`` and ``spec.driver``, the only ones the server offers besides
the name), deletes any other (stale ones, from an earlier version or another
node name), and creates or replaces ours when its content differs: quantities
are compared by value, never as strings (the server answers ``81920Mi`` as
``80Gi``). Every change of content bumps the pool's generation. A server whose
feature gate is off drops the fields it guards (``taints`` without
``DRADeviceTaints``, ``allowMultipleAllocations`` and ``requestPolicy`` without
``DRAConsumableCapacity``): what it stored for our content is remembered and counts
as published, with one warning naming what was dropped, instead of a write (and a
new generation) on every watch event of our own write. The gates found off so are
:attr:`SlicePublisher.gates_off`, told to ``on_gates`` at each change (the agent reports them in its
log, /healthz and metrics: a slice without consumable capacity gives each GPU to one claim, whole).
Whether the server keeps device taints is found out at the first sync, whatever the GPUs' health:
our content is written as a dry run (``dryRun=All``: the server drops fields as it would, stores
nothing; the same RBAC verbs as the write), with a probe taint on one device where none is tainted,
and the gate counts as off where the taints do not come back. While a gate is off (taints dropped, or
other fields not kept), every sync does that one dry run again (one for all such gates), and where the
server keeps it all now (the gate turned on, or the server upgraded, while the agent runs) the slice
is written whole again and the gate no longer counts as off; a sync with every gate known on costs no
call but the list. A server that drops device taints
(``DRADeviceTaints`` off, as in Kubernetes 1.35) has a scheduler that ignores them too: a tainted
(unhealthy) GPU would still take new claims, each refused at Prepare. So tainted devices are left
out of the slice instead (warned once per set of devices), and put back when their GPU is healthy
again (published tainted once the server keeps taints). Before a write whose content has a tainted
device while the server is believed to keep taints, the write is tried as a dry run too: no unhealthy
GPU is ever stored untainted. A write that comes back without the taints all the same (the server
changed between the two) is done again without the tainted devices. A server that refuses dry runs
(an admission webhook that does not declare ``sideEffects: None``) is warned about; whether it keeps
taints is then told by the first write of a tainted device. Not seen: a gate turned off while the
agent runs and believes it on, until a GPU is unhealthy (the dry run before that write finds it),
nor while the stored slice holds taints (the server keeps fields the stored object already uses),
until that slice is written without taints once.

The slice names the node's Node object as its owner (``ownerReferences``, read
when the slice is written), so the garbage collector deletes it with the node; a
node not found yet (or not readable) leaves the slice without an owner until a
later sync finds it.

A sync runs at start, whenever the content changes (a GPU's health), whenever a
watch on those slices shows someone else's change (the kubelet deletes its
node's slices when it starts), and every ``resync_period`` seconds. Failures
are retried with a capped backoff and reported through ``on_error``.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpumanager.dra import constants as c
from gpumanager.dra.apierror import describe, plain
from gpumanager.dra.quantity import QuantityError, parse
from gpumanager.kube.apierror import unknown_node
from gpumanager.kube.reflector import event_lines
from gpumanager.kube.rest import ApiException, KubeRest, segment

log = logging.getLogger(__name__)

JSON = dict[str, Any]
#: Seconds any one API call may take (a hanging API server must not stop the loop).
REQUEST_TIMEOUT = 10.0
#: The ResourceSlice collection.
SLICES = f"/apis/{c.RESOURCE_API}/resourceslices"
_BACKOFF_START = 0.2
_BACKOFF_MAX = 10.0
#: A watch that ends sooner with no event is an error, retried after the backoff.
_SHORT_WATCH_SECONDS = 1.0


def _comparable(spec: JSON) -> Any:
    """The spec without the generation, capacity quantities as exact values."""
    out = copy.deepcopy(spec)
    (out.get("pool") or {}).pop("generation", None)
    for dev in out.get("devices") or []:
        for cap in (dev.get("capacity") or {}).values():
            if not isinstance(cap, dict):
                continue
            _to_value(cap, "value")
            policy = cap.get("requestPolicy") or {}
            _to_value(policy, "default")
            for key in ("min", "max", "step"):
                _to_value(policy.get("validRange") or {}, key)
        for taint in dev.get("taints") or []:
            taint.pop("timeAdded", None)
    return out


def _dropped(want: Any, have: Any, path: str = "spec") -> list[str]:
    """Paths of ``want`` that ``have`` lacks or holds otherwise (at most a few)."""
    if isinstance(want, dict) and isinstance(have, dict):
        out: list[str] = []
        for key, value in want.items():
            if key not in have:
                out.append(f"{path}.{key}")
            else:
                out.extend(_dropped(value, have[key], f"{path}.{key}"))
        return out[:8]
    if isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        return [p for i, (a, b) in enumerate(zip(want, have, strict=True)) for p in _dropped(a, b, f"{path}[{i}]")][:8]
    return [] if want == have else [path]


#: The feature gates whose fields the API server drops from a ResourceSlice when they are off, and
#: what an operator loses then.
CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
DEVICE_TAINTS = "DRADeviceTaints"
GATES = (CONSUMABLE_CAPACITY, DEVICE_TAINTS)


def _gates(paths: list[str]) -> set[str]:
    """The feature gates that guard the dropped ``paths`` (as :func:`_dropped` names them)."""
    out: set[str] = set()
    for path in paths:
        if path.endswith(".allowMultipleAllocations") or ".requestPolicy" in path:
            out.add(CONSUMABLE_CAPACITY)
        elif ".taints" in path:
            out.add(DEVICE_TAINTS)
    return out


def gates_message(slice_name: str, gates: frozenset[str]) -> str:
    """What the API server's feature gates that are off cost, in one line (for the log and /healthz)."""
    parts = []
    if CONSUMABLE_CAPACITY in gates:
        parts.append(
            f"the API server drops allowMultipleAllocations and requestPolicy from ResourceSlice {slice_name}: "
            f"feature gate {CONSUMABLE_CAPACITY} is off (Kubernetes 1.34, or 1.35 without the gate on "
            "kube-apiserver, kube-scheduler and kubelet), so the scheduler gives each GPU to one claim only, "
            "whole, and the cores and memory a claim asks for are not shared out"
        )
    if DEVICE_TAINTS in gates:
        parts.append(
            f"the API server drops device taints from ResourceSlice {slice_name}: feature gate {DEVICE_TAINTS} "
            "is off, so unhealthy GPUs are left out of the slice instead of published tainted"
        )
    return "; ".join(parts)


def _unserved(exc: BaseException) -> bool:
    """Whether an API answer is the 404 of a resource the server does not serve (its Status names no
    object, as a 404 for a missing object does)."""
    if getattr(exc, "status", None) != 404:
        return False
    body = getattr(exc, "body", None)
    try:
        data = json.loads(body) if isinstance(body, (str, bytes)) and body else {}
    except ValueError:
        return True  # a plain "404 page not found": no such path at all
    details = data.get("details") if isinstance(data, dict) else None
    return not (isinstance(details, dict) and details.get("name"))


def _owned(item: JSON, node: str) -> bool:
    """Whether a slice names the Node ``node`` as its owner."""
    refs = (item.get("metadata") or {}).get("ownerReferences") or []
    return any(isinstance(r, dict) and r.get("kind") == "Node" and r.get("name") == node for r in refs)


def _tainted(spec: JSON) -> set[str]:
    """Names of the devices of a slice spec that have taints."""
    return {str(d.get("name")) for d in spec.get("devices") or [] if isinstance(d, dict) and d.get("taints")}


def _untainted(spec: JSON) -> JSON:
    """``spec`` without its devices' taints."""
    out = copy.deepcopy(spec)
    for dev in out.get("devices") or []:
        if isinstance(dev, dict):
            dev.pop("taints", None)
    return out


#: Value of the taint that a dry run puts on one device to find out whether the server keeps taints.
PROBE_TAINT_VALUE = "feature-gate-probe"


def _with_probe_taint(spec: JSON, driver: str) -> JSON:
    """``spec`` with a taint on its first device (as is where it has no device): only ever written as a
    dry run, to see whether the server keeps device taints."""
    out = copy.deepcopy(spec)
    devs = [d for d in out.get("devices") or [] if isinstance(d, dict)]
    if devs:
        devs[0]["taints"] = [{"key": c.taint_key(driver), "value": PROBE_TAINT_VALUE, "effect": c.TAINT_EFFECT}]
    return out


def _to_value(holder: JSON, key: str) -> None:
    if key in holder:
        try:
            holder[key] = parse(holder[key])
        except QuantityError:
            pass


class SlicePublisher:
    """Publishes and repairs the node's ResourceSlice (thread-safe)."""

    def __init__(
        self,
        api_client: Any,
        *,
        node: str,
        driver: str,
        content: Callable[[int], JSON],
        resync_period: float = 60.0,
        on_error: Callable[[str], None] = lambda _m: None,
        on_ok: Callable[[], None] = lambda: None,
        on_gates: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self._rest = KubeRest(api_client)
        self.node = node
        self.driver = driver
        self.name = c.slice_name(node, driver)
        self._content = content
        self._resync = resync_period
        self._on_error = on_error
        self._on_ok = on_ok
        self._on_gates = on_gates
        # Feature gates the API server was seen to have off (it dropped the fields they guard from a
        # write of ours); told to ``on_gates`` at each change.
        self.gates_off: frozenset[str] = frozenset()
        self._selector = f"spec.nodeName={node},spec.driver={driver}"
        self._generation = 0
        # (our content, what the server stored of it), both comparable, when the server did not
        # keep all of it (a feature gate off): that stored slice counts as ours.
        self._kept: tuple[Any, Any] | None = None
        # The server dropped the device taints of a write (DRADeviceTaints off): tainted devices
        # are then left out of the slice, since its scheduler would place claims on them.
        self.drops_taints = False
        # Whether :attr:`drops_taints` was found out (a dry run or a write with a taint), so that a
        # server keeping taints costs no call per sync.
        self._taints_known = False
        self._left_out: tuple[str, ...] = ()
        self._rewrite = False  # the last write must be done again (the server dropped its taints)
        self._owner_problem = ""
        self._dry_run_problem = ""  # why the last dry run was refused (warned once per reason)
        self._lock = threading.Lock()
        self._withdrawn = False  # withdraw() deleted the slice: no sync writes it again
        self._held = ""  # why the slice is withdrawn for now (hold()); '' while it is published
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.syncs = 0
        self.writes = 0
        self.published = threading.Event()
        self.last_error = ""
        self.started = False
        self._start_lock = threading.Lock()

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Sync once now (errors are retried in the background), then keep syncing. Idempotent."""
        with self._start_lock:
            if self.started:
                return
            self.started = True
        self._sync_logged()
        for name, target in (("slice-sync", self._sync_loop), ("slice-watch", self._watch_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop syncing (the slice stays: the node's devices are still there)."""
        self._stop.set()
        self._wake.set()

    def changed(self) -> None:
        """The content changed (health): sync soon."""
        self._wake.set()

    def hold(self, why: str) -> None:
        """Withdraw the slice for now: the driver cannot prepare claims (``why``). Syncs delete it (soon, and
        whenever it is written again: the kubelet's start, an operator) instead of writing it, until
        :meth:`release`."""
        self._held = why
        self.published.clear()
        self._wake.set()

    def release(self) -> None:
        """Publish the slice again after :meth:`hold` (soon)."""
        self._held = ""
        self._wake.set()

    @property
    def held(self) -> str:
        """Why the slice is withdrawn for now ('' when it is not)."""
        return self._held

    def _sync_held(self, items: list[JSON]) -> bool:
        """A sync while the slice is held back: delete every slice of this node and driver (ours, and stale
        ones, which offer the same GPUs). Returns whether one was deleted; raises what a delete raises."""
        self.published.clear()
        deleted = False
        for item in items:
            name = str((item.get("metadata") or {}).get("name"))
            try:
                self._rest.delete_object(f"{SLICES}/{segment(name)}", timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue
            log.info("deleted ResourceSlice %s: withdrawn while the driver cannot prepare claims", name)
            deleted = True
        return deleted

    def withdraw(self, why: str) -> None:
        """Stop syncing and delete the node's slice: the driver serves no claim (``why``), so no GPU of this
        node may be offered (each claim placed there would fail its Prepare for good, while the scheduler
        could place it on another node). A delete that fails is logged; the kubelet deletes the slices of a
        driver it does not have registered when it starts."""
        self.stop()
        with self._lock:  # after a sync in progress, which may have written the slice again
            self._withdrawn = True
            self.published.clear()
            try:
                self._rest.delete_object(f"{SLICES}/{segment(self.name)}", timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status != 404:
                    log.error("cannot delete ResourceSlice %s (%s): %s", self.name, why, describe(exc))
                    return
            except Exception as exc:  # a connection error, a timeout
                log.error("cannot delete ResourceSlice %s (%s): %s", self.name, why, exc)
                return
        log.warning("deleted ResourceSlice %s: %s, so none of this node's GPUs is offered", self.name, why)

    # -- sync ---------------------------------------------------------------------------------

    def _sync_logged(self) -> bool:
        try:
            self.sync()
        except (ApiException, OSError, ValueError) as exc:
            doing = "withdraw" if self._held else "publish"
            message = f"cannot {doing} ResourceSlice {self.name}: {describe(exc)}"
            if _unserved(exc):
                message += (
                    f": the API server does not serve {c.RESOURCE_API}, which DRA mode needs (Kubernetes 1.34 or "
                    f"later, with {c.RESOURCE_API} not turned off by --runtime-config); on an older cluster run "
                    "the node with --mode=device-plugin"
                )
            if message != self.last_error:
                log.warning("%s (retrying)", message)
            self.last_error = message
            self._on_error(message)
            return False
        except Exception as exc:  # urllib3 errors and the like: keep going
            self.last_error = f"cannot publish ResourceSlice {self.name}: {plain(exc)}"
            log.warning("%s (retrying)", self.last_error)
            self._on_error(self.last_error)
            return False
        if self.last_error:
            log.info("ResourceSlice %s published again after: %s", self.name, self.last_error)
        self.last_error = ""
        self._on_ok()
        return True

    def sync(self) -> bool:
        """One pass; returns whether it wrote. Raises ApiException and connection errors."""
        with self._lock:
            if self._withdrawn:  # a sync that waited for the lock while the slice was withdrawn
                return False
            self.syncs += 1
            listed = self._rest.list_objects(SLICES, field_selector=self._selector, timeout=REQUEST_TIMEOUT)
            items = (listed or {}).get("items") or []
            if self._held:
                return self._sync_held(items)
            ours: JSON | None = None
            stale: list[str] = []
            newest_other = 0  # the newest generation of another slice of this node and driver
            for item in items:
                meta = item.get("metadata") or {}
                gen = int(((item.get("spec") or {}).get("pool") or {}).get("generation") or 0)
                self._generation = max(self._generation, gen)
                if meta.get("name") == self.name:
                    ours = item
                else:
                    newest_other = max(newest_other, gen)
                    stale.append(str(meta.get("name")))
            ours_gen = int((((ours or {}).get("spec") or {}).get("pool") or {}).get("generation") or 0)
            wrote = False
            content = self._content(self._generation)
            checked = self._recheck(ours, content)  # a gate not known on may be on now
            self._set_gates()
            desired = self._offered(content)
            current = False
            if ours is not None:
                want, have = _comparable(desired), _comparable(ours.get("spec") or {})
                current = (have == want or self._kept == (want, have)) and (
                    _owned(ours, self.node) or not self._owner()
                )
            if not current:
                stored = self._write(ours, probe=not checked)
                wrote = True
                if self._rewrite:  # the server dropped the taints: again, without the tainted devices
                    self._write(stored)
            elif stale and ours_gen <= newest_other:
                # Consumers take only the newest generation of a pool: ours goes above the stale
                # slices' first, so they count for nothing even if deleting them fails.
                self._write(ours, force=True)
                wrote = True
            # Ours is published (above every stale one) before any stale one is deleted: a stale
            # slice the server will not delete must not keep the node's GPUs unpublished.
            failed: ApiException | None = None
            for name in stale:
                log.info("deleting stale ResourceSlice %s of node %s", name, self.node)
                try:
                    self._rest.delete_object(f"{SLICES}/{segment(name)}", timeout=REQUEST_TIMEOUT)
                except ApiException as exc:
                    if exc.status != 404 and failed is None:
                        failed = exc
                    continue
                wrote = True
            self.published.set()
            if failed is not None:
                raise failed
            return wrote

    def _owner(self) -> list[JSON]:
        """``ownerReferences`` naming the node's Node object (read now), or none when it cannot be read."""
        try:
            node = self._rest.get_object(f"/api/v1/nodes/{segment(self.node)}", timeout=REQUEST_TIMEOUT)
            uid = str(((node or {}).get("metadata") or {}).get("uid") or "")
        except Exception as exc:  # 404 (not registered yet), 403, a hanging server: publish without
            uid = ""
            problem = describe(exc)
            if getattr(exc, "status", None) == 404:
                problem += f"; if no Node has that name, {unknown_node(self.node)}"
        else:
            problem = "" if uid else "it has no UID"
        if problem:
            if problem != self._owner_problem:
                log.warning(
                    "ResourceSlice %s is published without its Node as owner (the garbage collector will not "
                    "delete it with the node): cannot read node %s: %s",
                    self.name,
                    self.node,
                    problem,
                )
            self._owner_problem = problem
            return []
        self._owner_problem = ""
        return [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True}]

    def _write(self, ours: JSON | None, *, force: bool = False, probe: bool = False) -> JSON:
        """Create or replace our slice with the content of the next generation; returns it as stored.

        ``probe``: where the content has a tainted device and the server is not known to drop
        taints, find out first with a dry run (no unhealthy GPU is stored untainted)."""
        self._generation += 1
        content = self._content(self._generation)
        if probe and not self.drops_taints and _tainted(content):
            self._try_taints(ours, content)
        body: JSON = {
            "apiVersion": c.RESOURCE_API,
            "kind": "ResourceSlice",
            "metadata": {"name": self.name},
            "spec": self._offered(content),
        }
        owner = self._owner()
        if owner:
            body["metadata"]["ownerReferences"] = owner
        if ours is None:
            stored = self._rest.create_object(SLICES, body, timeout=REQUEST_TIMEOUT)
            log.info("published ResourceSlice %s (generation %d)", self.name, self._generation)
        else:
            body["metadata"]["resourceVersion"] = (ours.get("metadata") or {}).get("resourceVersion")
            stored = self._rest.replace_object(f"{SLICES}/{segment(self.name)}", body, timeout=REQUEST_TIMEOUT)
            log.info(
                "%s ResourceSlice %s (generation %d)",
                "re-versioned" if force else "updated",
                self.name,
                self._generation,
            )
        self.writes += 1
        self.published.set()
        stored = stored if isinstance(stored, dict) else {}
        self._rewrite = self._taints_dropped(body["spec"], stored.get("spec") or {})
        if _tainted(body["spec"]):
            self._taints_known = True
        if self._rewrite:
            self.drops_taints = True
        else:
            self._note_kept(body["spec"], stored.get("spec") or {})
        self._set_gates()
        return stored

    def _set_gates(self) -> None:
        """:attr:`gates_off` from what the server kept of our writes; ``on_gates`` when it changed."""
        gates = set()
        if self._kept is not None:
            gates |= _gates(_dropped(*self._kept))
        if self.drops_taints:
            gates.add(DEVICE_TAINTS)
        found = frozenset(gates)
        if found == self.gates_off:
            return
        self.gates_off = found
        if self._on_gates is not None:
            self._on_gates(found)

    def _try_taints(self, ours: JSON | None, spec: JSON) -> None:
        """Write ``spec`` (which has tainted devices) as a dry run, and set :attr:`drops_taints` from
        whether the server kept the taints. A server that refuses the dry run itself (an admission
        webhook that does not declare ``sideEffects: None`` refuses every dry run with 400) leaves
        :attr:`drops_taints` as it was: the write that follows tells. Raises what the write would
        (connection errors, a conflict, throttling, a server error)."""
        answer = self._dry_run(
            ours,
            spec,
            "device taints",
            "the write itself shows it (an unhealthy device may be offered untainted until the write that follows)",
        )
        if answer is not None:
            self._learn_taints(spec, answer.get("spec") or {}, probe=False)

    def _recheck(self, ours: JSON | None, content: JSON) -> bool:
        """Find out, with one dry run of ``content`` (``dryRun=All``, nothing stored), whatever is not known
        to be on: whether the server keeps device taints (at the first sync, then at each sync while it
        drops them; where no device is tainted, one gets a probe taint for the dry run only), and the
        fields of another feature gate it did not keep (:attr:`gates_off`; where it keeps them now, what
        it kept before is forgotten, so this sync writes the slice whole again). Nothing to find out
        (every gate known on) costs no call. Returns whether this sync's write needs no dry run of its
        taints first (this one kept them, or the server refused it). Raises what the write would
        (connection errors, forbidden, a conflict, throttling, a server error)."""
        taints = not self._taints_known or self.drops_taints
        spec = content
        probe = taints and not _tainted(spec)
        if probe:
            spec = _with_probe_taint(spec, self.driver)
            taints = bool(_tainted(spec))  # a slice without devices has nothing to probe with
        kept_gates = _gates(_dropped(*self._kept)) if ours is not None and self._kept is not None else set()
        if not taints and not kept_gates:
            return False
        checking = [f"the fields of feature gate {' and '.join(sorted(kept_gates))}"] if kept_gates else []
        if taints:
            checking.insert(0, "device taints")
        if self.drops_taints:
            otherwise = "unhealthy devices stay left out of it"
        elif taints and probe:
            otherwise = "whether it does is known at the first write of an unhealthy GPU"
        elif taints:
            otherwise = "the write itself shows it (an unhealthy device may be offered untainted until the write "
            otherwise += "that follows)"
        else:
            otherwise = "the slice stays as it was kept"
        answer = self._dry_run(ours, spec, " and ".join(checking), otherwise)
        if answer is None:
            if taints and not self.drops_taints:
                self._taints_known = True  # not again at each sync: the first tainted write tells
            return taints  # no second dry run before this sync's write: it would be refused the same
        got = answer.get("spec") or {}
        kept = bool(_tainted(spec)) and self._learn_taints(spec, got, probe=probe)
        if kept_gates and _comparable(_untainted(got)) == _comparable(_untainted(spec)):
            log.info(
                "the API server keeps the fields of feature gate %s now: ResourceSlice %s is written whole again",
                " and ".join(sorted(kept_gates)),
                self.name,
            )
            self._kept = None
        return kept

    def _learn_taints(self, spec: JSON, got: JSON, *, probe: bool) -> bool:
        """Set :attr:`drops_taints` from a dry run of ``spec`` (with tainted devices) answered ``got``;
        ``probe``: its only taint is the probe's. Returns whether the server kept the taints."""
        kept = not self._taints_dropped(spec, got)
        if kept and self.drops_taints:
            what = "unhealthy GPUs are" if probe else f"device(s) {', '.join(sorted(_tainted(spec)))} are"
            log.info(
                "the API server keeps device taints now (feature gate DRADeviceTaints on): %s published tainted in "
                "ResourceSlice %s",
                what,
                self.name,
            )
            self._left_out = ()
        self.drops_taints = not kept
        self._taints_known = True
        return kept

    def _dry_run(self, ours: JSON | None, spec: JSON, what: str, otherwise: str) -> JSON | None:
        """The slice as the server would store ``spec`` (a dry run: ``dryRun=All``, nothing stored), or
        None where it refuses the dry run itself (an admission webhook that does not declare
        ``sideEffects: None`` refuses every dry run with 400; warned once per reason, naming ``what``
        it was to find out and ``otherwise``, what follows). Raises what the write would (connection
        errors, forbidden, a conflict, throttling, a server error)."""
        body: JSON = {"apiVersion": c.RESOURCE_API, "kind": "ResourceSlice", "metadata": {"name": self.name}}
        body["spec"] = spec
        dry = [("dryRun", "All")]
        try:
            if ours is None:
                answer = self._rest.json(
                    "POST", SLICES, query=dry, body=body, content_type="application/json", timeout=REQUEST_TIMEOUT
                )
            else:
                body["metadata"]["resourceVersion"] = (ours.get("metadata") or {}).get("resourceVersion")
                answer = self._rest.json(
                    "PUT",
                    f"{SLICES}/{segment(self.name)}",
                    query=dry,
                    body=body,
                    content_type="application/json",
                    timeout=REQUEST_TIMEOUT,
                )
        except ApiException as exc:
            status = int(exc.status or 0)
            if not 400 <= status < 500 or status in (403, 409, 429):
                raise  # 403: RBAC decides a dry run as the write itself (same verb), so the write fails too
            problem = describe(exc)
            if problem != self._dry_run_problem:
                log.warning(
                    "cannot try ResourceSlice %s as a dry run to see whether the API server keeps %s (%s); %s",
                    self.name,
                    what,
                    problem,
                    otherwise,
                )
            self._dry_run_problem = problem
            return None
        self._dry_run_problem = ""
        return answer if isinstance(answer, dict) else {}

    def _offered(self, spec: JSON) -> JSON:
        """``spec`` as published: without its tainted devices when the server drops taints."""
        if not self.drops_taints:
            return spec
        kept = [d for d in spec.get("devices") or [] if not (isinstance(d, dict) and d.get("taints"))]
        left_out = tuple(
            str(d.get("name")) for d in spec.get("devices") or [] if isinstance(d, dict) and d.get("taints")
        )
        if left_out and left_out != self._left_out:
            log.warning(
                "the API server drops device taints (feature gate DRADeviceTaints off), and its scheduler "
                "ignores them: unhealthy device(s) %s are left out of ResourceSlice %s until healthy again, "
                "so that no new claim is placed on them",
                ", ".join(left_out),
                self.name,
            )
        elif not left_out and self._left_out:
            log.info("device(s) %s are healthy again: back in ResourceSlice %s", ", ".join(self._left_out), self.name)
        self._left_out = left_out
        return {**spec, "devices": kept}

    def _taints_dropped(self, written: JSON, stored: JSON) -> bool:
        """Whether a write of ``written`` (with device taints) came back as ``stored`` without them."""
        return bool(_tainted(written) - _tainted(stored))

    def _note_kept(self, written: JSON, stored: JSON) -> None:
        """Remember what the server kept of a write that it did not keep whole; warn once per such content."""
        want, have = _comparable(written), _comparable(stored)
        if want == have:
            self._kept = None
            return
        if self._kept is not None and self._kept[0] == want:
            self._kept = (want, have)
            return
        self._kept = (want, have)
        dropped = _dropped(want, have)
        gates = _gates(dropped)
        log.warning(
            "the API server did not keep %s of ResourceSlice %s (%s); published as it was kept",
            ", ".join(dropped) or "all",
            self.name,
            f"feature gate {' and '.join(sorted(gates))} off"
            if gates
            else "a feature gate that is off: DRADeviceTaints for taints, DRAConsumableCapacity for "
            "allowMultipleAllocations and requestPolicy",
        )

    def _sync_loop(self) -> None:
        backoff = _BACKOFF_START
        while not self._stop.is_set():
            woken = self._wake.wait(self._resync)
            if self._stop.is_set():
                return
            self._wake.clear()
            if not woken:
                log.debug("periodic ResourceSlice resync")
            if self._sync_logged():
                backoff = _BACKOFF_START
                continue
            self._stop.wait(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)
            self._wake.set()

    # -- watch --------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        backoff = _BACKOFF_START
        while not self._stop.is_set():
            try:
                listed = self._rest.list_objects(SLICES, field_selector=self._selector, timeout=REQUEST_TIMEOUT) or {}
                rv = str((listed.get("metadata") or {}).get("resourceVersion") or "")
                self._wake.set()
                response = self._rest.watch_objects(
                    SLICES,
                    field_selector=self._selector,
                    resource_version=rv,
                    timeout_seconds=300,
                    timeout=(REQUEST_TIMEOUT, 330),
                )
                opened, events = time.monotonic(), 0
                try:
                    for line in event_lines(response):
                        if self._stop.is_set():
                            return
                        events += 1
                        event = json.loads(line)
                        etype = event.get("type")
                        if etype == "ERROR":
                            raise RuntimeError(str((event.get("object") or {}).get("message", "watch error")))
                        if etype in ("ADDED", "MODIFIED", "DELETED"):
                            name = ((event.get("object") or {}).get("metadata") or {}).get("name", "?")
                            log.debug("ResourceSlice %s %s", name, etype)
                            self._wake.set()
                finally:
                    response.release_conn()
                if not events and not self._stop.is_set() and time.monotonic() - opened < _SHORT_WATCH_SECONDS:
                    # An API server (or a proxy that does not stream) ending every watch at once must not be
                    # listed and watched again in a hot loop (client-go's "very short watch").
                    raise RuntimeError(f"very short watch: ended within {_SHORT_WATCH_SECONDS:g} s with no event")
                backoff = _BACKOFF_START
            except Exception as exc:
                if self._stop.is_set():
                    return
                log.debug("ResourceSlice watch ended: %s; watching again in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
