"""A deferred package must look, to code that imports it the ordinary way, like the package itself.

Each test builds a small package of its own under ``tmp_path`` (so that what runs its ``__init__``
and when can be controlled), plus one check on the Kubernetes package in a fresh interpreter.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import lazy_package
from gpumanager.cli import DEFERRED_AT_START
from tests.package_fixtures import importable, write


@pytest.fixture
def packages(tmp_path: Path) -> Iterator[Path]:
    """A directory on ``sys.path`` for the test's packages; what they loaded is forgotten afterwards."""
    with importable(tmp_path, "lz_") as root:
        yield root


def test_a_name_the_init_binds_over_a_submodule_of_that_name_is_the_inits(packages: Path) -> None:
    # As kubernetes.utils does with create_from_yaml: the package's __init__ re-exports a function
    # under the name of the module that defines it.
    write(
        packages,
        {
            "lz_rebind/__init__.py": "from .maker import maker\n",
            "lz_rebind/maker.py": "def maker():\n    return 'made'\n",
            "lz_rebind/light.py": "X = 1\n",
        },
    )
    lazy_package.import_module("lz_rebind.light")
    assert lazy_package.is_deferred("lz_rebind")

    from lz_rebind import maker  # type: ignore[import-not-found]

    assert callable(maker), f"from lz_rebind import maker gave {maker!r}"
    assert maker() == "made"


def test_kubernetes_utils_create_from_yaml_is_the_function_after_the_agent_parsed_a_quantity() -> None:
    code = (
        "from gpumanager.dra.quantity import parse\n"
        "parse('1Gi')\n"
        "from kubernetes.utils import create_from_yaml\n"
        "print(callable(create_from_yaml), create_from_yaml)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.startswith("True "), done.stdout


def test_a_name_asked_while_another_thread_runs_the_deferred_init_waits_for_it(packages: Path) -> None:
    write(
        packages,
        {
            "lz_gate.py": "import threading\nstarted = threading.Event()\nrelease = threading.Event()\n",
            "lz_slow/__init__.py": """
                import lz_gate
                lz_gate.started.set()
                lz_gate.release.wait(30)
                VALUE = 42
            """,
            "lz_slow/light.py": "X = 1\n",
        },
    )
    import lz_gate  # type: ignore[import-not-found]

    lazy_package.import_module("lz_slow.light")
    package = sys.modules["lz_slow"]
    got: dict[str, object] = {}

    def first() -> None:
        got["first"] = package.VALUE

    def second() -> None:
        try:
            from lz_slow import VALUE  # type: ignore[import-not-found]

            got["second"] = VALUE
        except Exception as exc:  # what the test reports
            got["second"] = exc

    runner = threading.Thread(target=first)
    runner.start()
    try:
        assert lz_gate.started.wait(30)
        asker = threading.Thread(target=second)
        asker.start()
        asker.join(0.5)  # it must still be waiting for the __init__ that is running
    finally:
        lz_gate.release.set()
        runner.join(30)
    asker.join(30)
    assert got == {"first": 42, "second": 42}


def test_a_deferred_init_that_failed_runs_again_when_next_asked(packages: Path) -> None:
    write(
        packages,
        {
            "lz_flaky/__init__.py": """
                import os
                if os.path.exists(os.path.join(os.path.dirname(__file__), "broken")):
                    raise RuntimeError("lz_flaky cannot start: broken")
                VALUE = 7
            """,
            "lz_flaky/light.py": "X = 1\n",
            "lz_flaky/broken": "",
        },
    )
    lazy_package.import_module("lz_flaky.light")
    package = sys.modules["lz_flaky"]
    with pytest.raises(RuntimeError, match="broken"):
        package.VALUE  # noqa: B018
    with pytest.raises(RuntimeError, match="broken"):  # the same cause, not a bare AttributeError
        package.VALUE  # noqa: B018
    (packages / "lz_flaky" / "broken").unlink()
    assert package.VALUE == 7


def test_a_deferred_subpackage_is_bound_by_its_parent_and_runs_its_init_when_first_used(packages: Path) -> None:
    # As grpc does with grpc.aio: the parent's __init__ ends with ``from parent import sub``, and
    # only the subpackage's __init__ loads the expensive module.
    write(
        packages,
        {
            "lz_host/__init__.py": "VALUE = 1\nfrom lz_host import sub\n",
            "lz_host/sub/__init__.py": "import lz_heavy\nHEAVY = lz_heavy.LOADED\n",
            "lz_heavy/__init__.py": "LOADED = 'heavy'\n",
        },
    )
    lazy_package.defer("lz_heavy", "lz_host.sub")
    assert "lz_host" not in sys.modules, "deferring a subpackage imported its parent"

    import lz_host  # type: ignore[import-not-found]

    assert lz_host.VALUE == 1
    assert lazy_package.is_deferred("lz_host.sub"), "the parent's import ran the subpackage's __init__"
    assert lazy_package.is_deferred("lz_heavy")
    assert lz_host.sub.HEAVY == "heavy"
    assert not lazy_package.is_deferred("lz_host.sub")
    assert not lazy_package.is_deferred("lz_heavy")
    assert sys.modules["lz_heavy"].LOADED == "heavy"


def test_a_deferred_module_runs_when_first_asked_for_a_name(packages: Path) -> None:
    # As protobuf's python_message: imported by name by modules that never use it.
    write(
        packages,
        {
            "lz_lib/__init__.py": "",
            "lz_lib/user.py": "from lz_lib import costly\n",
            "lz_lib/costly.py": "import lz_count\nlz_count.RUNS += 1\nVALUE = 'costly'\n",
            "lz_count.py": "RUNS = 0\n",
        },
    )
    lazy_package.defer("lz_lib.costly")
    import lz_count  # type: ignore[import-not-found]
    import lz_lib.user  # type: ignore[import-not-found]

    assert lz_count.RUNS == 0, "importing a deferred module by name ran it"
    assert lazy_package.is_deferred("lz_lib.costly")
    from lz_lib.costly import VALUE  # type: ignore[import-not-found]

    assert VALUE == "costly"
    assert lz_lib.user.costly.VALUE == "costly"
    assert lz_count.RUNS == 1
    assert not lazy_package.is_deferred("lz_lib.costly")


def test_deferring_what_is_not_installed_or_already_loaded_leaves_it_alone(packages: Path) -> None:
    write(packages, {"lz_loaded.py": "RAN = True\n"})
    import lz_loaded  # type: ignore[import-not-found]

    lazy_package.defer("lz_loaded", "lz_missing", "lz_missing.sub")
    assert sys.modules["lz_loaded"] is lz_loaded and lz_loaded.RAN
    assert not lazy_package.is_deferred("lz_loaded")
    assert "lz_missing" not in sys.modules and "lz_missing.sub" not in sys.modules


def test_the_agent_registers_before_asyncio_is_loaded_and_its_grpc_aio_servers_work(tmp_path: Path) -> None:
    # What the agent defers at start: its gRPC servers and its registration with the kubelet
    # must neither need them nor run their __init__; the per-pod vcuda.sock servers (grpc.aio on
    # an asyncio loop) still work once they run.
    code = textwrap.dedent(
        f"""
        import json, sys
        from gpumanager import cli, lazy_package
        lazy_package.defer(*cli.DEFERRED_AT_START)
        import grpc
        from concurrent import futures
        from gpumanager.api import deviceplugin_v1beta1_pb2 as pb
        from gpumanager.deviceplugin import registration, server
        sent = pb.ListAndWatchResponse(devices=[pb.Device(ID="GPU-0", health="Healthy")])
        assert pb.ListAndWatchResponse.FromString(sent.SerializeToString()) == sent
        srv = grpc.server(futures.ThreadPoolExecutor(1))
        srv.add_insecure_port("unix:{tmp_path}/plain.sock")
        srv.start()
        grpc.channel_ready_future(grpc.insecure_channel("unix:{tmp_path}/plain.sock")).result(timeout=10)
        before = {{name: lazy_package.is_deferred(name) for name in cli.DEFERRED_AT_START}}
        loaded_before = "ssl" in sys.modules

        import asyncio
        async def serve_and_call():
            aio_server = grpc.aio.server()
            aio_server.add_insecure_port("unix:{tmp_path}/aio.sock")
            await aio_server.start()
            async with grpc.aio.insecure_channel("unix:{tmp_path}/aio.sock") as channel:
                await asyncio.wait_for(channel.channel_ready(), 10)
            await aio_server.stop(None)
            return True
        served = asyncio.run(serve_and_call())
        after = {{name: lazy_package.is_deferred(name) for name in cli.DEFERRED_AT_START}}
        print(json.dumps({{"before": before, "ssl_before": loaded_before, "served": served, "after": after}}))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["before"] == dict.fromkeys(DEFERRED_AT_START, True)
    assert result["ssl_before"] is False
    assert result["served"] is True
    assert result["after"]["asyncio"] is False and result["after"]["grpc.aio"] is False


def test_a_submodule_imported_before_its_deferred_package_was_used_loads(packages: Path) -> None:
    # As ``from asyncio.base_events import BaseEventLoop`` with asyncio deferred: the submodule asks
    # the package for its siblings (``from . import consts``) before it defines anything, and the
    # package's __init__ needs the submodule whole (``from .base import *``, ``base.__all__``).
    write(
        packages,
        {
            "lz_sib/__init__.py": "from .base import *\nfrom .other import *\n__all__ = base.__all__ + other.__all__\n",
            "lz_sib/base.py": "from . import consts\n__all__ = ['Base']\nclass Base:\n    X = consts.X\n",
            "lz_sib/consts.py": "X = 1\n",
            "lz_sib/other.py": "__all__ = ['Other']\nclass Other:\n    pass\n",
        },
    )
    lazy_package.defer("lz_sib")
    from lz_sib.base import Base  # type: ignore[import-not-found]

    assert Base.X == 1
    package = sys.modules["lz_sib"]
    assert package.__all__ == ["Base", "Other"]
    assert package.Base is Base, "the submodule ran twice"
    assert not lazy_package.is_deferred("lz_sib")


def test_a_thread_importing_a_submodule_while_another_runs_the_deferred_init_does_not_deadlock(tmp_path: Path) -> None:
    # Thread A runs the package's __init__, which imports ``sub``; thread B is inside ``sub``'s own
    # import (holding the import system's lock on it) and asks the package for a sibling. Neither
    # may wait for the other for ever (a fresh interpreter: a deadlock would hold the import locks).
    write(
        tmp_path,
        {
            "lz_gate.py": "import threading\nrunning = threading.Event()\ninside = threading.Event()\n",
            "lz_dl/__init__.py": """
                import lz_gate
                lz_gate.running.set()
                lz_gate.inside.wait(10)
                from .sub import SUB
                VALUE = SUB + 1
            """,
            "lz_dl/sub.py": """
                import lz_gate
                lz_gate.running.wait(10)
                lz_gate.inside.set()
                from . import helper
                SUB = helper.H
            """,
            "lz_dl/helper.py": "H = 2\n",
        },
    )
    done = _use_and_import_sub_at_once(tmp_path, "lz_dl", "lz_dl")
    assert done.stdout.strip() == "[('sub', 2), ('value', 3)]", (done.stdout, done.stderr)


def test_asyncio_and_grpc_aio_submodules_imported_first_load_when_the_agent_deferred_them() -> None:
    code = textwrap.dedent(
        """
        from gpumanager import cli, lazy_package
        lazy_package.defer(*cli.DEFERRED_AT_START)
        from asyncio.base_events import BaseEventLoop
        import grpc.aio._channel
        import asyncio, grpc
        assert asyncio.BaseEventLoop is BaseEventLoop
        assert grpc.aio.insecure_channel is grpc.aio._channel.insecure_channel
        print(asyncio.run(asyncio.sleep(0, "ran")))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"


def test_a_deferred_module_whose_parents_were_not_loaded_is_reached_through_them(packages: Path) -> None:
    # ``import a.b.c`` finds a.b.c in sys.modules and then imports only ``a``: a module deferred
    # before its parents were imported must still be their attribute, as an imported one is.
    write(
        packages,
        {
            "lz_outer/__init__.py": "",
            "lz_outer/inner/__init__.py": "",
            "lz_outer/inner/costly.py": "VALUE = 'costly'\n",
        },
    )
    lazy_package.defer("lz_outer.inner.costly")
    import lz_outer.inner.costly as costly  # type: ignore[import-not-found]

    assert lazy_package.is_deferred("lz_outer.inner.costly")
    import lz_outer.inner.costly  # type: ignore[import-not-found]

    assert lz_outer.inner.costly is costly
    assert costly.VALUE == "costly"


def test_protobufs_python_messages_are_reached_by_their_full_name_when_the_agent_deferred_them() -> None:
    code = textwrap.dedent(
        """
        from gpumanager import cli, lazy_package
        lazy_package.defer(*cli.DEFERRED_AT_START)
        import google.protobuf.internal.python_message as first
        import gpumanager.app
        import google.protobuf.internal.python_message
        assert google.protobuf.internal.python_message is first
        assert lazy_package.is_deferred("google.protobuf.internal.python_message")
        print(google.protobuf.internal.python_message.GeneratedProtocolMessageType.__name__)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GeneratedProtocolMessageType"


def test_a_deferred_module_reloaded_before_its_first_use_has_run_once(packages: Path) -> None:
    write(
        packages,
        {
            "lz_reloaded.py": "import lz_runs\nlz_runs.RUNS += 1\nclass Thing:\n    pass\n",
            "lz_runs.py": "RUNS = 0\n",
        },
    )
    lazy_package.defer("lz_reloaded")
    import lz_reloaded  # type: ignore[import-not-found]
    import lz_runs  # type: ignore[import-not-found]

    importlib.reload(lz_reloaded)
    thing = lz_reloaded.Thing
    assert not hasattr(lz_reloaded, "missing")
    assert lz_reloaded.Thing is thing, "the module's code ran again after its reload"
    assert lz_runs.RUNS == 1
    assert not lazy_package.is_deferred("lz_reloaded")


def test_a_thread_using_another_deferred_module_inside_a_submodule_import_does_not_deadlock(tmp_path: Path) -> None:
    # As grpc.aio._call's class body reading asyncio.AbstractEventLoop while grpc.aio's __init__,
    # on another thread, waits for grpc.aio._call: completing one deferred module must not wait
    # for another one's __init__.
    write(
        tmp_path,
        {
            "lz_gate.py": "import threading\nrunning = threading.Event()\ninside = threading.Event()\n",
            "lz_other.py": "NAME = 'other'\n",
            "lz_pkg/__init__.py": """
                import lz_gate
                lz_gate.running.set()
                lz_gate.inside.wait(10)
                from .sub import SUB
                VALUE = SUB + '!'
            """,
            "lz_pkg/sub.py": """
                import lz_gate, lz_other
                lz_gate.running.wait(10)
                lz_gate.inside.set()
                SUB = lz_other.NAME
            """,
        },
    )
    done = _use_and_import_sub_at_once(tmp_path, "lz_pkg", "lz_pkg", "lz_other")
    assert done.stdout.strip() == "[('sub', 'other'), ('value', 'other!')]", (done.stdout, done.stderr)


def test_dir_of_a_deferred_module_lists_the_names_its_code_defines(packages: Path) -> None:
    # dir() (inspect.getmembers, mock.create_autospec, completion) asks for every name at once.
    write(packages, {"lz_listed/__init__.py": "VALUE = 1\n\ndef helper():\n    return 2\n"})
    lazy_package.defer("lz_listed")
    import lz_listed  # type: ignore[import-not-found]

    names = dir(lz_listed)
    assert {"VALUE", "helper"} <= set(names), names
    assert not lazy_package.is_deferred("lz_listed")
    assert "__getattr__" not in names and "__dir__" not in names


def test_a_deferred_package_reloaded_before_its_first_use_runs_its_init_once(packages: Path) -> None:
    # Its __init__ asks the package for a submodule (``from . import part``) while the reload runs it.
    write(
        packages,
        {
            "lz_reinit/__init__.py": "import lz_inits\nlz_inits.RUNS += 1\nfrom . import part\n",
            "lz_reinit/part.py": "X = 1\n",
            "lz_inits.py": "RUNS = 0\n",
        },
    )
    lazy_package.defer("lz_reinit")
    import lz_inits  # type: ignore[import-not-found]
    import lz_reinit  # type: ignore[import-not-found]

    importlib.reload(lz_reinit)
    assert lz_reinit.part.X == 1
    assert lz_inits.RUNS == 1


def test_a_deferred_init_that_fails_with_an_attribute_error_says_why(packages: Path) -> None:
    # From a module's __getattr__ an AttributeError means "no such name": hasattr() would say False
    # and ``from package import NAME`` "cannot import name", both hiding the failure.
    write(packages, {"lz_broken/__init__.py": "import os\nVALUE = os.no_such_name\n"})
    lazy_package.defer("lz_broken")
    import lz_broken  # type: ignore[import-not-found]

    with pytest.raises(ImportError, match="no_such_name"):
        hasattr(lz_broken, "VALUE")
    with pytest.raises(ImportError, match="no_such_name"):
        from lz_broken import VALUE  # type: ignore[import-not-found]  # noqa: F401
    assert lazy_package.is_deferred("lz_broken")


def _use_and_import_sub_at_once(root: Path, package: str, *deferred: str) -> subprocess.CompletedProcess[str]:
    """In a fresh interpreter (a deadlock would hold the import locks), with ``deferred`` deferred:
    one thread reads ``package.VALUE`` while another imports ``package.sub`` and reads its ``SUB``.
    Prints the sorted (name, value) pairs both got; the process has exited 0."""
    code = textwrap.dedent(
        f"""
        import sys, threading
        from gpumanager import lazy_package
        lazy_package.defer(*{deferred!r})
        package = sys.modules[{package!r}]
        got = {{}}
        def use():
            got["value"] = package.VALUE
        def import_sub():
            import {package}.sub
            got["sub"] = {package}.sub.SUB
        threads = [threading.Thread(target=use, daemon=True), threading.Thread(target=import_sub, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        print(sorted(got.items()))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done
