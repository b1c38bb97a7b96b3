"""What one module imports, bound in that module to stand-ins that import it at first use.

:func:`gpumanager.lazy_package.defer` keeps a module's code from running until someone asks it
for a name, but ``from requests_oauthlib import OAuth2Session`` asks at once. The Kubernetes
client's kubeconfig loader imports so, at its top, for authentication that only some kubeconfigs
use: OIDC token refresh (OAuth2 over ``requests``, and the typed ``ApiClient``, whose module loads
pydantic) and Google credentials, about 16 MiB for good that a kubeconfig with a token or a client
certificate never needs. :func:`defer_imports` names a module (the importer) and which of its
imports to defer; when the importer is imported next, each of those binds, in the importer alone,
a stand-in:

- ``import a.b`` binds ``a`` to a stand-in whose first attribute asked imports ``a.b``; it
  answers with the real ``a``'s attributes from then on;
- ``from a.b import C`` binds ``C`` to a stand-in that imports ``a.b`` and takes its ``C`` the first
  time it is called, asked for an attribute, used with ``isinstance`` or ``issubclass``, or used as
  a base class. It is not ``C`` itself (``is``, ``==`` and ``except C`` see the stand-in), so defer
  only names that the importer calls.

A module that is not installed is imported as before (``import google.auth`` inside a ``try``
still raises ImportError at once); a name the module turns out not to have raises ImportError at
first use. Nothing else changes: ``sys.modules`` and every other module get the real modules, and
an import already done is bound as it is. The importer's code runs with a copy of the builtins of
the time it is imported, whose ``__import__`` does the above (for imports inside its functions too).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpumanager import lazy_package

log = logging.getLogger(__name__)

_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Deferred:
    """What of its imports one importer defers: whole modules, and single names of a module."""

    modules: frozenset[str] = field(default_factory=frozenset)
    names: frozenset[tuple[str, str]] = field(default_factory=frozenset)


_IMPORTERS: dict[str, _Deferred] = {}


def defer_imports(importer: str, *targets: str) -> bool:
    """The next time module ``importer`` is imported, bind each of ``targets`` that its code imports
    to a stand-in that imports it at first use (see the module's description). A target is
    ``"a.b"`` (``import a.b``, and every name of ``from a.b import ...``) or ``"a.b:C"`` (only
    ``from a.b import C``). Whether it will be done: not where ``importer`` is imported already."""
    modules = frozenset(t for t in targets if ":" not in t)
    names = frozenset(cast("tuple[str, str]", tuple(t.split(":", 1))) for t in targets if ":" in t)
    deferred = _Deferred(modules, names)
    with _LOCK:
        held = sys.modules.get(importer)
        if held is not None:
            if not lazy_package.is_deferred(importer):
                log.debug("%s is imported already: its imports are bound as they are", importer)
                return False
            _give_builtins(held, deferred)  # loaded, its code not run yet (gpumanager.lazy_package)
            return True
        _IMPORTERS[importer] = deferred
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
    return True


class _ModuleStandIn:
    """Bound by ``import a.b`` in place of ``a``: imports ``a.b`` when first asked for an attribute."""

    __slots__ = ("_imports", "_top")

    def __init__(self, imports: str) -> None:
        self._imports = imports
        self._top: types.ModuleType | None = None

    def _module(self) -> types.ModuleType:
        if self._top is None:
            importlib.import_module(self._imports)
            self._top = sys.modules[self._imports.partition(".")[0]]
        return self._top

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._module(), attribute)

    def __repr__(self) -> str:
        return f"<stand-in for {self._imports!r}, imported at first use>"


class _NameStandIn:
    """Bound by ``from a.b import C`` in place of ``C``: imports ``a.b`` and takes its ``C`` at first use."""

    __slots__ = ("_module", "_name", "_value")

    def __init__(self, module: str, name: str) -> None:
        self._module = module
        self._name = name
        self._value: Any = None

    def _target(self) -> Any:
        if self._value is None:
            module = importlib.import_module(self._module)
            try:
                self._value = getattr(module, self._name)
            except AttributeError as exc:
                raise ImportError(f"cannot import name {self._name!r} from {self._module!r}: {exc}") from exc
        return self._value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._target(), attribute)

    def __instancecheck__(self, instance: Any) -> bool:
        return isinstance(instance, self._target())

    def __subclasscheck__(self, cls: type) -> bool:
        return issubclass(cls, self._target())

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[Any, ...]:
        return (self._target(),)

    def __repr__(self) -> str:
        return f"<stand-in for {self._module}.{self._name}, imported at first use>"


def _loaded(module: str) -> types.ModuleType | None:
    """``module`` if its code has run."""
    found = sys.modules.get(module)
    return None if found is None or lazy_package.is_deferred(module) else found


def _absolute(name: str, globals_: Mapping[str, Any] | None, level: int) -> str | None:
    if level == 0:
        return name
    package = (globals_ or {}).get("__package__")
    if not package:
        return None  # let the import system say what is wrong
    try:
        return importlib.util.resolve_name("." * level + name, package)
    except ImportError:
        return None


def _importer_import(deferred: _Deferred) -> Callable[..., Any]:
    """The ``__import__`` of an importer that defers ``deferred``."""

    def import_(
        name: str,
        globals_: Mapping[str, Any] | None = None,
        locals_: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> Any:
        def real(names: Sequence[str] | None = fromlist) -> Any:
            return builtins.__import__(name, globals_, locals_, names, level)

        module = _absolute(name, globals_, level)
        if module is None or "*" in (fromlist or ()):
            return real()
        if not fromlist:  # import a.b: binds a
            if module not in deferred.modules or _loaded(module) is not None:
                return real()
            if lazy_package.find_spec(module) is None:
                return real()  # not installed: its ImportError, now
            return _ModuleStandIn(module)
        lazy = [n for n in fromlist if module in deferred.modules or (module, n) in deferred.names]
        loaded = _loaded(module)
        if loaded is not None:
            lazy = [n for n in lazy if n not in vars(loaded)]
        if not lazy or lazy_package.find_spec(module) is None:
            return real()
        bound = types.SimpleNamespace(**{n: _NameStandIn(module, n) for n in lazy})
        rest = [n for n in fromlist if n not in lazy]
        if rest:
            got = real(rest)
            for n in rest:
                setattr(bound, n, getattr(got, n))
        return bound

    return import_


def _give_builtins(module: types.ModuleType, deferred: _Deferred) -> None:
    """Let ``module``'s code, when it runs, import through an ``__import__`` that defers ``deferred``."""
    own = dict(vars(builtins))
    own["__import__"] = _importer_import(deferred)
    vars(module)["__builtins__"] = own


class _ImporterFinder:
    """On sys.meta_path: gives the modules :func:`defer_imports` named a loader that sets their builtins."""

    _busy = threading.local()  # names being looked up in this thread (other finders may ask us again)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        busy: set[str] = self._busy.__dict__.setdefault("names", set())
        if fullname not in _IMPORTERS or fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = lazy_package.find_spec_elsewhere(self, fullname, path, target)
        finally:
            busy.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = cast("importlib.abc.Loader", _ImporterLoader(spec.loader, fullname))
        return spec


class _ImporterLoader:
    """Loads as its own loader does, the module's builtins given an ``__import__`` that defers."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        deferred = _IMPORTERS.get(self.name)
        if deferred is not None:
            _give_builtins(module, deferred)
        self.loader.exec_module(module)

    def __getattr__(self, attribute: str) -> Any:  # get_source, is_package...
        return getattr(self.loader, attribute)


_FINDER = _ImporterFinder()
