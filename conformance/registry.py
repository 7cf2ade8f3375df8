"""Resolve ``--impl NAME`` to an adapter instance.

NAME is one of: a built-in name (``reference``, ``fastdeploy``); ``package.module:attr``;
``path/to/file.py:attr``; or a name registered under the ``conformance.impls`` entry-point group.
``attr`` is a factory (class or function) called with the ``--impl-opt`` key/values, or an adapter
instance. An unknown name is an error, never an empty run.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from importlib.metadata import entry_points

from .adapter import LoaderAdapter
from .capabilities import validate

ENTRY_POINT_GROUP = "conformance.impls"
BUILTIN = {
    "reference": "weightsync.reference.adapter:ReferenceAdapter",
    "fastdeploy": "conformance.impls.fastdeploy:FastDeployAdapter",
}


class ImplError(Exception):
    """--impl could not be resolved to a valid adapter."""


def _raised_at(exc: BaseException, prefer: str | None = None) -> str:
    """Where ``exc`` was raised, as ``FILE, line N``: the innermost frame in ``prefer`` (the adapter's
    own file) when there is one, with the innermost frame of all after it when that lies elsewhere."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "(no traceback)"
    inner = frames[-1]
    mine = [f for f in frames if prefer and os.path.abspath(f.filename) == prefer]
    shown = mine[-1] if mine else inner
    where = f"{shown.filename}, line {shown.lineno}"
    if shown is not inner:
        where += f" (raised in {inner.filename}, line {inner.lineno})"
    return where


def _failure(exc: BaseException, prefer: str | None = None) -> str:
    """``SyntaxError: MSG at FILE, line N`` for a failure to import or build an adapter."""
    if isinstance(exc, SyntaxError):  # its location is the file being compiled, not a frame
        return f"{type(exc).__name__}: {exc.msg} at {exc.filename}, line {exc.lineno}"
    return f"{type(exc).__name__}: {exc} at {_raised_at(exc, prefer)}"


def _import_target(target: str):
    module_part, _, attr = target.rpartition(":")
    if not module_part or not attr:
        raise ImplError(f"--impl {target!r}: expected 'module:attr' or 'path/file.py:attr'")
    if module_part.endswith(".py") or os.sep in module_part:
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise ImplError(f"--impl {target!r}: adapter file {path} does not exist")
        name = f"_conformance_impl_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # a broken adapter file is a usage error naming the file and the line
            sys.modules.pop(name, None)
            raise ImplError(f"--impl {target!r}: adapter file {path} failed to import: {_failure(e, path)}") from None
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ImplError(f"--impl {target!r}: cannot import {module_part} ({e})") from e
        except Exception as e:
            raise ImplError(f"--impl {target!r}: importing {module_part} failed: {_failure(e)}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImplError(f"--impl {target!r}: {module_part} has no attribute {attr!r}") from None


def _entry_points() -> dict:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_names() -> list[str]:
    return sorted(set(BUILTIN) | set(_entry_points()))


def resolve(name: str, options: dict[str, str] | None = None) -> tuple[LoaderAdapter, str]:
    """Return (adapter, where it came from)."""
    options = options or {}
    if name in BUILTIN:
        where = BUILTIN[name]
        factory = _import_target(where)
    elif ":" in name:
        where = name
        factory = _import_target(name)
    else:
        eps = _entry_points()
        if name not in eps:
            raise ImplError(
                f"unknown implementation {name!r}; known names: {', '.join(available_names())}; "
                "or pass 'module:attr' / 'path/to/file.py:attr'"
            )
        where = f"entry point {ENTRY_POINT_GROUP}:{name} = {eps[name].value}"
        try:
            factory = eps[name].load()
        except Exception as e:
            raise ImplError(f"--impl {name!r}: loading {where} failed: {_failure(e)}") from None
    if isinstance(factory, type) or (callable(factory) and not hasattr(factory, "open")):
        try:
            adapter = factory(**options)
        except ImplError:
            raise  # the adapter's own usage error (the FastDeploy adapter's checks) says it best
        except Exception as e:
            given = ", ".join(f"{k}={v!r}" for k, v in options.items())
            source = getattr(sys.modules.get(getattr(factory, "__module__", "")), "__file__", None)
            raise ImplError(f"--impl {name!r} ({where}): the adapter factory "
                            f"{getattr(factory, '__qualname__', factory)!s}({given}) raised "
                            f"{_failure(e, os.path.abspath(source) if source else None)}") from None
    elif options:
        raise ImplError(f"--impl {name!r} ({where}) is an adapter instance; it takes no --impl-opt")
    else:
        adapter = factory
    missing = [a for a in ("name", "version", "capabilities", "open") if not hasattr(adapter, a)]
    if missing or not isinstance(adapter, LoaderAdapter):
        raise ImplError(f"--impl {name!r} ({where}) is not a LoaderAdapter: missing {', '.join(missing) or 'protocol members'}")
    try:
        adapter.capabilities = validate(adapter.capabilities)
    except ValueError as e:
        raise ImplError(f"--impl {name!r} ({where}): {e}") from None
    return adapter, where
