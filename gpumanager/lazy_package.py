"""Importing parts of a package without running its ``__init__`` first, and packages deferred whole.

Two packages cost the agent's start far more than the part of them it uses:

- ``import kubernetes.client.rest`` runs ``kubernetes/__init__.py`` before anything else, and that
  imports the whole client library: the kubeconfig loader (YAML, OAuth), the dynamic client (and
  ``jsonschema`` where ``kubernetes-validate`` is installed), the websocket streams, watch, leader
  election, informers and utilities. The agent uses the request path (``ApiClient``, its
  ``Configuration``, ``rest`` and ``exceptions``), one configuration loader and ``parse_quantity``;
  the rest costs about 0.25 s of CPU at start and 10 MiB that it never gives back.
- ``import grpc`` ends by importing ``grpc.aio``, whose class annotations load ``asyncio`` (with
  ``ssl``): about 50 ms before the first registration with the kubelet, which uses neither. Only
  the per-pod ``vcuda.sock`` servers, started later in the background, use them.
- protobuf's descriptor pool imports its pure-Python message implementation (with ``text_format``,
  ``datetime``, ``pickle``; 17 ms) even where the upb backend, which the agent uses, serves every
  message.

:func:`import_module` imports a submodule with each of its parent packages that is not loaded yet
standing in as a bare package; :func:`defer` makes such stand-ins of whole packages and modules. A stand-in's
``__path__`` and spec are the real ones, so submodules load from the real files, but its
``__init__`` is not run. The first time anything asks such a package for a name it does not have
(``kubernetes.__version__``, ``from kubernetes import watch``, ``asyncio.get_running_loop``), its
real ``__init__`` runs in place and the name is looked up again, so code that imports the package
the ordinary way later still gets the whole package, with the names its ``__init__`` binds. Another
thread that asks while the ``__init__`` runs waits for it; an ``__init__`` that fails runs again
when the next name is asked. A submodule imported before its package was used (``from
asyncio.base_events import BaseEventLoop``) loads as it does while an ``__init__`` runs: its
``from . import sibling`` loads the sibling and leaves the package's ``__init__`` for later. A
dotted name deferred before its parents were loaded is deferred when the import system loads it
(a finder on ``sys.meta_path``), so that its parents are loaded first and it is bound on them.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader

log = logging.getLogger(__name__)

_LOCK = threading.RLock()  # import_module's and defer's bookkeeping
_LOCKS: dict[str, threading.RLock] = {}  # module name -> the lock its deferred code runs under
_DEFERRED = "__gpumanager_deferred_init__"


def import_module(name: str) -> types.ModuleType:
    """Import ``name`` (a dotted module name) without running the ``__init__`` of any parent package
    that is not imported yet; those run when first asked for a name they define."""
    with _LOCK:
        parts = name.split(".")
        for end in range(1, len(parts)):
            _defer_package(".".join(parts[:end]))
        return importlib.import_module(name)


def defer(*names: str) -> None:
    """Let each of ``names`` (dotted names of modules or packages) be imported without running its
    code (a package's ``__init__``): it runs when the module is first asked for a name. A module
    already imported stays as it is, and so does a name that is not installed; the parent of a
    dotted name is not imported (nor deferred) by this: a name whose parent is not loaded yet is
    deferred when the import system loads it, after its parents, which it is bound on as usual."""
    with _LOCK:
        for name in names:
            spec = find_spec(name)
            if name in sys.modules or spec is None or spec.loader is None:
                continue
            parent = name.rpartition(".")[0]
            if not parent or parent in sys.modules:
                _stand_in(name, spec, spec.loader)
            else:
                # In sys.modules without its parents, ``import a.b.c`` would find it there and
                # import only ``a``: ``a.b`` would be missing, and ``c`` would not be ``a.b.c``.
                _PENDING.add(name)
                if _FINDER not in sys.meta_path:
                    sys.meta_path.insert(0, _FINDER)  # for the import system's load of it


def is_deferred(package: str) -> bool:
    """Whether ``package`` stands in loaded without its ``__init__`` having run yet."""
    module = sys.modules.get(package)
    return module is not None and vars(module).get(_DEFERRED) is True


def _defer_package(name: str) -> None:
    if name in sys.modules:
        return
    spec = find_spec(name)
    if spec is None or spec.loader is None or not _is_package(spec):
        importlib.import_module(name)  # not a package: nothing to defer, import it as it is
        return
    _stand_in(name, spec, spec.loader)


def _stand_in(name: str, spec: importlib.machinery.ModuleSpec, loader: Loader) -> None:
    """Put a module of ``spec`` whose code has not run into sys.modules; it runs when first asked for a name."""
    module = importlib.util.module_from_spec(spec)
    _hold(module, loader)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    # else the parent binds it when it imports it (``from grpc import aio`` finds it in sys.modules)


def _hold(module: types.ModuleType, loader: Loader) -> None:
    """Leave ``module`` (created, its code not run) to run ``loader``'s code when first asked for a name."""
    name = module.__name__
    # A lock of its own: a thread that asks another deferred module for a name while importing a
    # submodule (grpc.aio._call's class body reads asyncio.AbstractEventLoop) must not wait for
    # this one's __init__, which may be waiting for that submodule.
    lock = _LOCKS.setdefault(name, threading.RLock())

    def complete(attribute: str) -> Any:
        if _importing_submodule_of(name) and _is_submodule(module, attribute):
            # ``from . import sibling`` in a submodule imported before the package was used (or
            # while another thread runs its __init__, which may be waiting for this very import):
            # the import system loads the sibling, as it does while an __init__ runs. Running the
            # __init__ here would run it in the middle of that submodule (which the __init__ needs
            # whole), or wait for it while holding that submodule's import lock.
            raise AttributeError(f"module {name!r} has no attribute {attribute!r}")
        # Every other name, a submodule's too: the __init__ may bind a submodule's name to something
        # else (kubernetes.utils binds create_from_yaml to the function of that name).
        run(attribute)
        if attribute in vars(module):
            return vars(module)[attribute]
        own = vars(module).get("__getattr__")  # a package may provide names lazily itself
        if own is not None and own is not complete:
            return own(attribute)
        raise AttributeError(f"module {name!r} has no attribute {attribute!r}")

    def listing() -> list[str]:
        run("__dir__")
        own = vars(module).get("__dir__")
        if own is not None and own is not listing:
            return list(own())
        return sorted(vars(module))

    def run(attribute: str) -> None:
        with lock:  # another thread asking while the __init__ runs waits for it to finish
            if not vars(module).get(_DEFERRED):
                return
            log.debug("running the deferred __init__ of %s for %r", name, attribute)
            vars(module)[_DEFERRED] = False  # running: a name the __init__ asks of itself is not there yet
            try:
                loader.exec_module(module)
            except BaseException as exc:
                # As a failed import is not cached: the next name asked runs the __init__ again.
                vars(module).update({_DEFERRED: True, "__getattr__": complete, "__dir__": listing})
                if isinstance(exc, AttributeError):
                    # Out of __getattr__ that would read "no such name" (hasattr() False, ``from
                    # ... import`` "cannot import name"): say that the module failed, and why.
                    raise ImportError(f"{name}: its deferred code failed: {exc}", name=name) from exc
                raise
            del vars(module)[_DEFERRED]
            for hook, ours in (("__getattr__", complete), ("__dir__", listing)):
                if vars(module).get(hook) is ours:
                    del vars(module)[hook]

    vars(module).update({_DEFERRED: True, "__getattr__": complete, "__dir__": listing})
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)  # for importlib.reload of the module


class _DeferringFinder:
    """On sys.meta_path: the modules :func:`defer` named before their parents were loaded are
    loaded by the import system (parents first, bound on them) without their code running."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _PENDING and not (target is not None and _DEFERRED in vars(target)):
            return None  # neither deferred nor importlib.reload of a module held by _hold
        spec = find_spec_elsewhere(self, fullname, path, target)
        if spec is not None and spec.loader is not None and not isinstance(spec.loader, _DeferringLoader):
            spec.loader = cast("Loader", _DeferringLoader(spec.loader))
        return spec


def find_spec_elsewhere(
    finder: object, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
) -> importlib.machinery.ModuleSpec | None:
    """The spec that the finders on ``sys.meta_path`` other than ``finder`` give ``fullname``: what
    a finder that only wraps their loaders answers with."""
    for other in sys.meta_path:
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _DeferringLoader:
    """Creates the module as its own loader does and leaves its code to :func:`_hold`."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        _PENDING.discard(module.__name__)
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        if _DEFERRED not in vars(module):
            _hold(module, self.loader)
            return
        # importlib.reload: its code runs now, as a reload does, and not again when first asked.
        with _LOCKS.setdefault(module.__name__, threading.RLock()):
            hooks = {hook: vars(module).get(hook) for hook in ("__getattr__", "__dir__")}
            deferred = vars(module)[_DEFERRED]
            vars(module)[_DEFERRED] = False  # running: a name its code asks of itself is not there yet
            try:
                self.loader.exec_module(module)
            except BaseException:
                vars(module)[_DEFERRED] = deferred
                raise
            vars(module).pop(_DEFERRED, None)
            for hook, ours in hooks.items():
                if ours is not None and vars(module).get(hook) is ours:
                    del vars(module)[hook]

    def __getattr__(self, attribute: str) -> Any:  # get_source, get_resource_reader, is_package...
        return getattr(self.loader, attribute)


_PENDING: set[str] = set()
_FINDER = _DeferringFinder()


def _importing_submodule_of(package: str) -> bool:
    """Whether this thread is running the code of a submodule of ``package`` (importing it)."""
    prefix = package + "."
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and str(frame.f_globals.get("__name__", "")).startswith(prefix):
            return True
        frame = frame.f_back
    return False


def _is_submodule(module: types.ModuleType, attribute: str) -> bool:
    path = vars(module).get("__path__")
    if path is None:
        return False
    return importlib.machinery.PathFinder.find_spec(f"{module.__name__}.{attribute}", list(path)) is not None


def _is_package(spec: importlib.machinery.ModuleSpec) -> bool:
    return spec.submodule_search_locations is not None


def find_spec(name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of ``name`` (None: not installed), found without importing its parent packages (the import system's own
    lookup would run their ``__init__``)."""
    parent, _, _ = name.rpartition(".")
    if not parent or parent in sys.modules:
        return importlib.util.find_spec(name)
    parent_spec = find_spec(parent)
    if parent_spec is None or parent_spec.submodule_search_locations is None:
        return None
    return importlib.machinery.PathFinder.find_spec(name, list(parent_spec.submodule_search_locations))
