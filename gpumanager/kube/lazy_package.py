"""Importing parts of the Kubernetes client without running its packages' ``__init__`` first.

``import kubernetes.client.rest`` runs ``kubernetes/__init__.py`` before anything else, and that
imports the whole client library: the kubeconfig loader (YAML, OAuth), the dynamic client (and
``jsonschema`` where ``kubernetes-validate`` is installed), the websocket streams, watch, leader
election, informers and utilities. The agent uses the request path (``ApiClient``, its
``Configuration``, ``rest`` and ``exceptions``), one configuration loader and ``parse_quantity``;
the rest costs about 0.25 s of CPU at start and 10 MiB that it never gives back.

:func:`import_module` imports a submodule with each of its parent packages that is not loaded yet
standing in as a bare package: its ``__path__`` and spec are the real ones, so submodules load from
the real files, but its ``__init__`` is not run. The first time anything asks such a package for
a name it does not have (``kubernetes.__version__``, ``from kubernetes import config`` of a
package that defines it in ``__init__``, ``from kubernetes.utils import parse_quantity``), its real
``__init__`` runs in place and the name is looked up again, so code that imports the package the
ordinary way later still gets the whole package.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import threading
import types
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.RLock()
_DEFERRED = "__gpumanager_deferred_init__"


def import_module(name: str) -> types.ModuleType:
    """Import ``name`` (a dotted module name) without running the ``__init__`` of any parent package
    that is not imported yet; those run when first asked for a name they define."""
    with _LOCK:
        parts = name.split(".")
        for end in range(1, len(parts)):
            _defer_package(".".join(parts[:end]))
        return importlib.import_module(name)


def is_deferred(package: str) -> bool:
    """Whether ``package`` stands in loaded without its ``__init__`` having run yet."""
    module = sys.modules.get(package)
    return module is not None and _DEFERRED in vars(module)


def _defer_package(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None or spec.loader is None:
        importlib.import_module(name)  # not a package: nothing to defer, import it as it is
        return
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def complete(attribute: str) -> Any:
        if not attribute.startswith("__") and importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")  # a submodule: no need for __init__
        with _LOCK:
            if vars(module).pop(_DEFERRED, None) is not None:
                log.debug("running the deferred __init__ of %s for %r", name, attribute)
                vars(module).pop("__getattr__", None)
                loader.exec_module(module)
        if attribute in vars(module):
            return vars(module)[attribute]
        own = vars(module).get("__getattr__")  # a package may provide names lazily itself
        if own is not None and own is not complete:
            return own(attribute)
        raise AttributeError(f"module {name!r} has no attribute {attribute!r}")

    vars(module)[_DEFERRED] = True
    vars(module)["__getattr__"] = complete
    sys.modules[name] = module
    if "." in name:
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)
