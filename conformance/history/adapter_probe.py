"""The adapter named by ``--impl``, looked at before any suite run: does it load, and what is it made of.

A verdict depends on the adapter as much as on the version it drives, so the cache key covers its code:
``probe(impl, options)`` runs ``python -m conformance.history.adapter_probe`` in a child process, as a
suite run would import the adapter (same interpreter, from the suite's root). The child resolves ``--impl``
to its factory the way ``conformance.registry`` does (a built-in name, ``module:attr``,
``path/file.py:attr``, an entry point), without calling it (the factory is called per version, with
``--impl-opt source=FILE``), checks that the factory takes the options every run passes, and lists:

* ``files``: every local file of the adapter: the modules that importing it loaded, and, read from their
  source (``import`` statements anywhere, those inside functions too, so that a module imported lazily is
  not missed), the local modules they import in turn. The suite's own trees are walked the same way (a
  suite module may import a local one: ``sim`` imports ``reference``). Local means neither the standard
  library nor an installed distribution (site-packages); the suite's trees (hashed whole) and this tool
  are left out of the list;
* ``distributions``: the installed distributions whose modules the import loaded, with their versions.

An adapter that cannot be loaded (a missing file, an import error, no such attribute, a factory that does
not take the options) is an ``AdapterError`` naming the reason: the tool stops with exit status 4 before
any version runs, instead of recording the same usage error for every version.
"""
from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import json
import os
import site
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field

from .versions import HistoryError

PROBE_TIMEOUT_S = 600.0


class AdapterError(HistoryError):
    """--impl cannot be loaded, or cannot take what every run passes it: a usage error (exit status 4)."""


@dataclass(frozen=True)
class AdapterInfo:
    impl: str
    where: str  # what --impl resolved to (registry's wording)
    files: tuple[str, ...]  # absolute paths, sorted
    distributions: dict = field(default_factory=dict)  # name -> version


def is_file_impl(impl: str) -> bool:
    """``path/file.py:attr`` (as conformance.registry tells it from ``module:attr``)."""
    module_part, _, attr = impl.rpartition(":")
    return bool(module_part and attr) and (module_part.endswith(".py") or os.sep in module_part)


def absolute_impl(impl: str, cwd: str | None = None) -> str:
    """``--impl`` with a file's path made absolute (relative to ``cwd``, default the current directory):
    the suite runs from its own root, not from where the tool was started."""
    if not is_file_impl(impl):
        return impl
    module_part, _, attr = impl.rpartition(":")
    return f"{os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(module_part)))}:{attr}"


def probe(impl: str, options: dict[str, str], root: str, suite_trees, excluded=(),
          timeout_s: float = PROBE_TIMEOUT_S) -> AdapterInfo:
    """Load ``impl`` in a child process run from ``root`` (module docstring); AdapterError if it cannot be."""
    fd, out = tempfile.mkstemp(prefix="adapter-probe-", suffix=".json")
    os.close(fd)
    request = {"impl": impl, "options": options, "root": root, "trees": list(suite_trees), "excluded": list(excluded)}
    try:
        try:
            proc = subprocess.run([sys.executable, "-m", "conformance.history.adapter_probe", json.dumps(request), out],
                                  cwd=root, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise AdapterError(f"--impl {impl!r}: importing the adapter did not finish within {timeout_s:g} s") from None
        try:
            with open(out, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = None
    finally:
        try:
            os.unlink(out)
        except OSError:
            pass
    if not isinstance(data, dict):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise AdapterError(f"--impl {impl!r}: loading the adapter failed (exit status {proc.returncode}):\n{tail}")
    if data.get("error"):
        raise AdapterError(data["error"])
    return AdapterInfo(impl, data["where"], tuple(data["files"]), dict(data["distributions"]))


# -- the child ------------------------------------------------------------------------------------------

def _not_local_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        roots += site.getsitepackages()
    except AttributeError:  # an old virtualenv's site module
        pass
    try:
        roots.append(site.getusersitepackages())
    except AttributeError:
        pass
    return sorted({os.path.realpath(r) for r in roots if r})


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class Walk:
    """The local files reached from the modules loaded and from files' import statements."""

    def __init__(self, root: str, trees, excluded):
        self.not_local = _not_local_roots()
        self.trees = [os.path.realpath(os.path.join(root, t)) for t in trees]
        self.excluded = [os.path.realpath(os.path.join(root, e)) for e in excluded]
        self.files: set[str] = set()  # local, outside the suite's trees
        self.seen: set[str] = set()

    def local(self, path: str | None) -> str | None:
        if not path:
            return None
        real = os.path.realpath(path)
        if not os.path.isfile(real) or _under(real, self.not_local) or _under(real, self.excluded):
            return None
        if any(part in ("site-packages", "dist-packages") for part in real.split(os.sep)):
            return None
        return real

    def add(self, path: str | None, module: str | None) -> None:
        real = self.local(path)
        if real is None or real in self.seen:
            return
        self.seen.add(real)
        if not _under(real, self.trees):
            self.files.add(real)
        if real.endswith(".py"):
            self.imports(real, module, os.path.basename(real) == "__init__.py")

    def imports(self, path: str, module: str | None, is_package: bool) -> None:
        try:
            with open(path, "rb") as f:
                tree = ast.parse(f.read(), filename=path)
        except (OSError, SyntaxError, ValueError):
            return
        package = (module if is_package else (module or "").rpartition(".")[0]) or None
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    if not package:
                        continue
                    parts = package.split(".")
                    if node.level - 1 > len(parts) - 1:
                        continue
                    anchor = ".".join(parts[: len(parts) - (node.level - 1)])
                    base = f"{anchor}.{base}" if base else anchor
                names = [base] + [f"{base}.{a.name}" for a in node.names if a.name != "*"]
            for name in names:
                self.module(name)

    def module(self, name: str) -> None:
        """Add the local file of module ``name``: found on the search path as the import system would, without
        importing anything (an installed package is never loaded to find it)."""
        path = self.locate(name)
        if path is not None:
            self.add(path, name)

    def locate(self, name: str) -> str | None:
        if not name or name.startswith("."):
            return None
        top, *rest = name.split(".")
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported to find it
        except (ImportError, ValueError, AttributeError):
            return None
        if spec is None:
            return None
        path = spec.origin if spec.has_location else None
        places = [p for p in (spec.submodule_search_locations or []) if os.path.isdir(p)]
        if self.local(path) is None and not any(self.local(os.path.join(p, "__init__.py")) or
                                                (not _under(os.path.realpath(p), self.not_local)) for p in places):
            return None  # the standard library, site-packages or built in: not walked
        for part in rest:
            found = None
            for place in places:
                folder = os.path.join(place, part)
                if os.path.isdir(folder):
                    init = os.path.join(folder, "__init__.py")
                    found = (init if os.path.isfile(init) else None, [folder])
                    break
                for suffix in importlib.machinery.all_suffixes():
                    if os.path.isfile(folder + suffix):
                        found = (folder + suffix, [])
                        break
                if found:
                    break
            if found is None:
                return path  # ``from package import name``: a name in the package, not a module
            path, places = found
        return path


def _factory(impl: str):
    from conformance import registry

    if impl in registry.BUILTIN:
        return registry._import_target(registry.BUILTIN[impl]), registry.BUILTIN[impl]
    if ":" in impl:
        return registry._import_target(impl), impl
    eps = registry._entry_points()
    if impl not in eps:
        raise registry.ImplError(f"unknown implementation {impl!r}; known names: {', '.join(registry.available_names())}; "
                                 "or pass 'module:attr' / 'path/to/file.py:attr'")
    where = f"entry point {registry.ENTRY_POINT_GROUP}:{impl} = {eps[impl].value}"
    try:
        return eps[impl].load(), where
    except Exception as e:  # noqa: BLE001
        raise registry.ImplError(f"--impl {impl!r}: loading {where} failed: {registry._failure(e)}") from None


def _takes(factory, impl: str, where: str, options: dict[str, str]) -> None:
    from conformance import registry

    given = ", ".join(f"{k}={v!r}" for k, v in options.items())
    if not (isinstance(factory, type) or (callable(factory) and not hasattr(factory, "open"))):
        raise registry.ImplError(f"--impl {impl!r} ({where}) is an adapter instance: it takes no --impl-opt, and "
                                 f"every run passes it {given} (give a factory: a class or a function)")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin or C callable: the first run says
    try:
        signature.bind(**options)
    except TypeError as e:
        raise registry.ImplError(f"--impl {impl!r} ({where}): the adapter factory "
                                 f"{getattr(factory, '__qualname__', factory)!s}{signature} cannot be called with "
                                 f"{given}, which every run passes it ({e})") from None


def _distributions(walk: Walk) -> dict[str, str]:
    from importlib import metadata

    tops = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if path and walk.local(path) is None and not _under(os.path.realpath(path), walk.trees):
            tops.add(name.split(".")[0])
    try:
        owners = metadata.packages_distributions()
    except Exception:  # noqa: BLE001
        owners = {}
    found = {}
    for top in sorted(tops):
        for dist in owners.get(top, []):
            try:
                found[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    return dict(sorted(found.items()))


def main(argv: list[str]) -> int:
    request, out = json.loads(argv[0]), argv[1]
    from conformance import registry

    result: dict
    try:
        factory, where = _factory(request["impl"])
        _takes(factory, request["impl"], where, request["options"])
    except registry.ImplError as e:
        result = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 (anything else the import raised)
        result = {"error": f"--impl {request['impl']!r}: loading the adapter failed: {registry._failure(e)}"}
    else:
        walk = Walk(request["root"], request["trees"], request["excluded"])
        for name, module in sorted(sys.modules.items()):
            path = getattr(module, "__file__", None)
            walk.add(path, name)
        module = sys.modules.get(getattr(factory, "__module__", "") or "")
        walk.add(getattr(module, "__file__", None), getattr(module, "__name__", None))
        for tree in request["trees"]:
            top = os.path.join(request["root"], tree)
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
                for n in sorted(filenames):
                    if n.endswith(".py"):
                        path = os.path.join(dirpath, n)
                        rel = os.path.relpath(path, request["root"])[:-3].replace(os.sep, ".")
                        walk.add(path, rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)
        result = {"where": where, "files": sorted(walk.files), "distributions": _distributions(walk)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 4 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
