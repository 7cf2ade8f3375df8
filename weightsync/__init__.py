"""The suite's internal packages under one name of their own: ``weightsync.reference`` (the reference loader),
``weightsync.fixtures`` (the independent writers of test data) and ``weightsync.wire`` (what trainer and receiver
agree on). The suite (``conformance``, ``sim``) imports them by these names only, so that an installed suite
neither shadows nor is shadowed by a project's own ``reference``, ``fixtures`` or ``wire`` package: both run in
one pytest process (tests/test_install.py).

Two layouts, one set of names:

* **Installed** (the wheel): ``weightsync/reference/``, ``weightsync/fixtures/`` and ``weightsync/wire/`` are real
  subpackages (pyproject.toml maps the checkout's folders there), imported the ordinary way.
* **The checkout** (and an editable install of it): the folders stay at the repository root, imported under
  their own names (``reference.manager``): mutation testing names a mutant by its file's path
  (``reference.manager.x_update__mutmut_47`` in mutation/justified.toml) and activates it only in the module of
  that ``__name__``; the project's tests patch ``reference.adapter.WeightManager``. Here ``weightsync.reference``
  *is* the package ``reference`` of the folder beside this one (the same module objects under both names,
  never a second copy), found through ``_CheckoutAlias``. A copy of the tree (mutmut's ``mutants/``) resolves to
  its own folders, since the folder is this file's own parent.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

INTERNAL = ("reference", "fixtures", "wire")
HERE = os.path.dirname(os.path.abspath(__file__))
CHECKOUT = os.path.dirname(HERE)  # where the internal packages live in the checkout: beside this package


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _checkout_package(top: str):
    """The checkout's top-level package ``top`` (the folder ``CHECKOUT/top``), imported under its own name.
    ImportError naming both when another package of that name was imported first: in the checkout the
    internal packages keep their own names, so a project with its own ``top`` needs the wheel."""
    folder = os.path.join(CHECKOUT, top)
    module = sys.modules.get(top)
    if module is None:
        # Another ``top`` first on sys.path would be the one a plain ``import top`` gets: two packages under one
        # name (a project's own beside an editable install; a copy of the tree without this package beside it,
        # whose imports would reach the original tree's folders). Said, never resolved silently.
        first = importlib.machinery.PathFinder.find_spec(top)
        elsewhere = list(first.submodule_search_locations or [first.origin]) if first is not None else []
        if elsewhere and not any(_same(p, folder) for p in elsewhere if p):
            raise ImportError(
                f"{__name__}.{top} is the checkout's {folder}, but {top!r} on sys.path is {elsewhere[0]}. A checkout "
                f"(or an editable install) keeps its internal packages under their own names; install the wheel "
                f"(pip install .) to run the suite beside a project with its own {top!r}, and copy {HERE} with the "
                f"tree (mutmut's also_copy).", name=f"{__name__}.{top}")
        spec = importlib.machinery.PathFinder.find_spec(top, [CHECKOUT])
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{__name__}.{top}: no package {top!r} in {CHECKOUT}", name=f"{__name__}.{top}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[top] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(top, None)
            raise
        return module
    where = list(getattr(module, "__path__", None) or [])
    if not any(_same(p, folder) for p in where):
        raise ImportError(
            f"{__name__}.{top} is the checkout's {folder}, but another package {top!r} was imported first "
            f"({getattr(module, '__file__', None) or where}). A checkout (or an editable install) keeps its internal "
            f"packages under their own names; install the wheel (pip install .) to run the suite beside a project "
            f"with its own {top!r}.", name=f"{__name__}.{top}")
    return module


class _CheckoutAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``weightsync.X[.sub]`` -> the checkout's module ``X[.sub]`` itself (X in INTERNAL)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, rest = fullname.partition(".")
        if prefix != __name__ or rest.split(".")[0] not in INTERNAL:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        name = spec.name.partition(".")[2]
        _checkout_package(name.split(".")[0])
        module = importlib.import_module(name)
        spec.loader_state = module.__spec__  # the import system sets __spec__ to ours; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state


def _installed() -> bool:
    return all(os.path.isfile(os.path.join(HERE, name, "__init__.py")) for name in INTERNAL)


if not _installed() and not any(isinstance(f, _CheckoutAlias) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutAlias())
