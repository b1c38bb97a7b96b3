"""Imports deferred in one module (gpumanager.lazy_imports): bound there to stand-ins, loaded at first use.

Each test builds small modules of its own under ``tmp_path``, so what loads and when can be seen.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpumanager import lazy_imports, lazy_package
from tests.package_fixtures import importable, write


@pytest.fixture
def packages(tmp_path: Path) -> Iterator[Path]:
    """A directory on ``sys.path`` for the test's modules; what they loaded is forgotten afterwards."""
    with importable(tmp_path, "li_") as root:
        yield root


HEAVY = {
    "li_heavy/__init__.py": "from .session import Session\nLOADED = True\n",
    "li_heavy/session.py": """\
        class Session:
            def __init__(self, who):
                self.who = who
            @staticmethod
            def kind():
                return 'session'
        """,
    "li_heavy/errors.py": "class Refused(Exception):\n    pass\n",
    "li_light.py": "class Config:\n    pass\n",
}

IMPORTER = """\
import li_heavy.errors
from li_heavy import Session
from li_light import Config
try:
    import li_absent.thing
    ABSENT_AVAILABLE = True
except ImportError:
    ABSENT_AVAILABLE = False

def open_session(who):
    return Session(who)

def refused():
    try:
        raise li_heavy.errors.Refused('no')
    except li_heavy.errors.Refused as exc:
        return exc

def later():
    from li_heavy.session import Session as Later
    return Later
"""


def test_deferred_imports_load_at_first_use_and_only_in_the_importer(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user.py": IMPORTER})
    assert lazy_imports.defer_imports("li_user", "li_heavy", "li_heavy.errors")
    import li_user  # type: ignore[import-not-found]

    assert "li_heavy" not in sys.modules and "li_heavy.errors" not in sys.modules
    assert "li_light" in sys.modules and li_user.Config is sys.modules["li_light"].Config  # not deferred: real
    assert li_user.ABSENT_AVAILABLE is False  # a module that is not installed fails at the import, as before
    assert "imported at first use" in repr(li_user.Session)

    session = li_user.open_session("agent")  # first use: the module loads, the real class is called
    assert "li_heavy" in sys.modules
    import li_heavy  # type: ignore[import-not-found]

    assert type(session) is li_heavy.Session and session.who == "agent"
    assert li_heavy.LOADED is True and li_heavy.Session is not li_user.Session  # the module itself is untouched
    assert isinstance(session, li_user.Session) and issubclass(li_heavy.Session, li_user.Session)
    assert li_user.Session.kind() == "session"  # an attribute of the stand-in is the class's

    class Mine(li_user.Session):  # type: ignore[misc,name-defined]
        pass

    assert Mine.__mro__[1] is li_heavy.Session
    assert isinstance(li_user.refused(), sys.modules["li_heavy.errors"].Refused)  # import a.b; except a.b.C
    assert li_user.later() is li_heavy.Session  # from a.b import C of a module not deferred: real


def test_an_import_statement_binds_a_stand_in_until_an_attribute_is_asked(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user2.py": "import li_heavy.errors\n"})
    lazy_imports.defer_imports("li_user2", "li_heavy.errors")
    import li_user2  # type: ignore[import-not-found]

    assert "li_heavy.errors" not in sys.modules
    assert li_user2.li_heavy.errors.Refused.__name__ == "Refused"
    assert li_user2.li_heavy.LOADED is True
    assert "li_heavy.errors" in sys.modules


def test_a_single_name_is_deferred_and_the_others_of_the_same_import_are_not(packages: Path) -> None:
    write(
        packages,
        {
            "li_pair/__init__.py": "def __getattr__(name):\n    import importlib\n"
            "    return getattr(importlib.import_module('li_pair.' + name.lower()), name)\n",
            "li_pair/heavy.py": "class Heavy:\n    pass\n",
            "li_pair/light.py": "class Light:\n    pass\n",
            "li_user3.py": "from li_pair import Heavy, Light\n",
        },
    )
    lazy_imports.defer_imports("li_user3", "li_pair:Heavy")
    import li_user3  # type: ignore[import-not-found]

    assert "li_pair.light" in sys.modules and li_user3.Light is sys.modules["li_pair.light"].Light
    assert "li_pair.heavy" not in sys.modules
    assert isinstance(li_user3.Heavy(), sys.modules["li_pair.heavy"].Heavy)


def test_a_name_the_module_lacks_is_an_import_error_at_first_use(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user4.py": "from li_heavy import Missing\n"})
    lazy_imports.defer_imports("li_user4", "li_heavy")
    import li_user4  # type: ignore[import-not-found]

    with pytest.raises(ImportError, match="cannot import name 'Missing' from 'li_heavy'"):
        li_user4.Missing()


def test_imports_already_done_are_bound_as_they_are(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user5.py": "import li_heavy.errors\nfrom li_heavy import Session\n"})
    import li_heavy.errors  # type: ignore[import-not-found]

    lazy_imports.defer_imports("li_user5", "li_heavy", "li_heavy.errors")
    import li_user5  # type: ignore[import-not-found]

    assert li_user5.Session is li_heavy.Session and li_user5.li_heavy is li_heavy


def test_an_importer_already_imported_is_left_as_it_is(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user6.py": "from li_heavy import Session\n"})
    import li_user6  # type: ignore[import-not-found]

    assert lazy_imports.defer_imports("li_user6", "li_heavy") is False
    assert li_user6.Session is sys.modules["li_heavy"].Session


def test_an_importer_whose_package_is_deferred_defers_its_imports_too(packages: Path) -> None:
    write(packages, {**HEAVY, "li_pkg/__init__.py": "raise RuntimeError('not run')\n", "li_pkg/user.py": IMPORTER})
    lazy_imports.defer_imports("li_pkg.user", "li_heavy", "li_heavy.errors")
    user = lazy_package.import_module("li_pkg.user")

    assert lazy_package.is_deferred("li_pkg")
    assert "li_heavy" not in sys.modules
    assert user.open_session("x").who == "x"


def test_an_importer_held_by_lazy_package_gets_its_stand_ins_when_its_code_runs(packages: Path) -> None:
    write(packages, {**HEAVY, "li_user7.py": IMPORTER})
    lazy_package.defer("li_user7")
    assert lazy_package.is_deferred("li_user7")
    assert lazy_imports.defer_imports("li_user7", "li_heavy", "li_heavy.errors")
    import li_user7  # type: ignore[import-not-found]

    assert li_user7.Config is sys.modules["li_light"].Config  # its code runs here, with the stand-ins
    assert "li_heavy" not in sys.modules
    assert li_user7.open_session("y").who == "y"
    assert "li_heavy" in sys.modules
