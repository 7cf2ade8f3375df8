"""One suite run per distinct content: the command, the cache, and running many at once.

A run is ``python -m pytest conformance --impl=NAME --impl-opt source=FILE --conformance-report R.json``
in a child process (the same interpreter, in the suite's repository), so a version that crashes,
hangs or leaks cannot harm the tool or the other runs. Results are cached by the file's sha256 and a
hash of everything else that decides a verdict: the suite (its code, SPEC.md), the adapter (its files
and the local modules they import, adapter_probe.py), the command's options and the files they name,
and the libraries it runs on: a rerun resumes, and a change to any of them runs again. Each cache entry
is one JSON file written to a temporary name and renamed into place, so an interrupted run leaves whole
entries or none; beside it a small ``.meta.json`` names the content, the hash without the ``--rule``
selection and the selection, so that a bisection can read a verdict a wider run already has.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from importlib import metadata

from .adapter_probe import AdapterInfo
from .versions import HistoryError

# The suite's checkout, or the folder the installed suite's packages are in (site-packages).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the suite's verdicts depend on besides the version: its code and the rules' text. Installed, fixtures and
# wire are weightsync/fixtures and weightsync/wire, and SPEC.md is conformance/SPEC.md.
SUITE_TREES = ("conformance", "fixtures", "sim", "wire")
SUITE_FILES = ("SPEC.md", "conftest.py", "pyproject.toml")
INSTALLED_UNDER = "weightsync"
LIBRARIES = ("paddlepaddle", "paddlepaddle-gpu", "numpy", "safetensors", "pyzmq", "msgpack", "pytest")
CACHE_FORMAT = 2  # 2: the key covers the adapter's files; entries have a .meta.json
TOOL = os.path.join("conformance", "history")  # this tool: not the suite
USAGE_ERROR = 4  # pytest's exit status for a usage error (the adapter cannot drive the file)
REPORTED = (0, 1, 5)  # all passed, some failed, nothing tested: the suite wrote its report
OUTCOMES = ("report", "usage_error", "crashed", "timed_out")
CACHED_OUTCOMES = ("report", "usage_error")  # what the content decides; a crash or timeout may be the machine's
KILL_GRACE_S = 5.0


def checkout() -> bool:
    """Whether the suite runs from its checkout (SPEC.md at ROOT) rather than from an install."""
    return os.path.isfile(os.path.join(ROOT, "SPEC.md"))


def run_dir() -> str:
    """Where each suite run starts, and what the options' relative paths (``--expectations FILE``) are relative
    to: the checkout's root, or, installed, the directory the tool was started in."""
    return ROOT if checkout() else os.getcwd()


def without_rules(extra) -> list[str]:
    """The pytest arguments less the ``--rule`` selection (``--rule X`` and ``--rule=X``)."""
    out, skip = [], False
    for arg in extra:
        if skip:
            skip = False
        elif arg == "--rule":
            skip = True
        elif not arg.startswith("--rule="):
            out.append(arg)
    return out


def _hash_file(h, name: str, path: str) -> None:
    h.update(name.encode() + b"\0")
    with open(path, "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())


def _tree_files(top: str, skip: str | None = None) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith(".")
                             and os.path.join(dirpath, d) != skip)
        found += [os.path.join(dirpath, n) for n in sorted(filenames) if not n.endswith((".pyc", ".pyo"))]
    return found


def _named(path: str) -> str:
    """A file's name in the hash: relative to the suite's root when under it (the same tree checked out
    elsewhere hashes the same), else absolute."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith(os.pardir) else rel


def option_paths(extra) -> list[str]:
    """The files and folders the pytest arguments name: an argument's value (``--expectations FILE``, a
    ``KEY=VALUE`` of ``--impl-opt``, ``--opt=VALUE``) that is a path, as the suite's runs (from ``run_dir()``) read it."""
    found = []
    for arg in extra:
        for candidate in {arg, arg.split("=", 1)[-1]}:
            if candidate and not candidate.startswith("-"):
                path = os.path.join(run_dir(), os.path.expanduser(candidate))
                if os.path.exists(path) and os.path.realpath(path) != os.path.realpath(run_dir()):
                    found.append(os.path.abspath(path))
    return sorted(set(found))


@dataclass(frozen=True)
class Suite:
    """How each version is run: the implementation name, the extra pytest arguments, and what the adapter
    is made of (adapter_probe.probe, for the cache key)."""
    impl: str = "fastdeploy"
    extra: tuple[str, ...] = ()
    timeout_s: float | None = None
    adapter: AdapterInfo | None = None

    def command(self, source: str, report: str) -> list[str]:
        """The checkout's suite runs as ``pytest conformance`` in the checkout (its configuration), the installed
        one as ``pytest --pyargs conformance`` in the directory the tool was started in (``run_dir``)."""
        where = ["conformance"] if checkout() else ["--pyargs", "conformance"]
        return [sys.executable, "-m", "pytest", *where, f"--impl={self.impl}", "--impl-opt",
                f"source={source}", "--conformance-report", report, "-p", "no:cacheprovider", "-q", *self.extra]

    def fingerprint(self, rules: bool = True) -> str:
        """sha256 of what decides a verdict besides the version: the suite's files (not this tool's), the
        adapter's files and the local modules they import, the options, the contents of the files and
        folders the options name (an --expectations file, an --impl-opt path), the versions of Python, of
        the libraries the suite runs on and of the distributions the adapter imports. ``rules=False``: all
        of it but the ``--rule`` selection (what a bisection may share with a wider run)."""
        h = hashlib.sha256()
        extra = list(self.extra) if rules else without_rules(self.extra)
        paths = [os.path.join(ROOT, f) for f in SUITE_FILES]
        for tree in SUITE_TREES:
            top = os.path.join(ROOT, tree)
            if not os.path.isdir(top):
                top = os.path.join(ROOT, INSTALLED_UNDER, tree)
            paths += _tree_files(top, skip=os.path.join(ROOT, TOOL))
        for path in paths:
            if os.path.isfile(path):
                _hash_file(h, os.path.relpath(path, ROOT), path)
        h.update(json.dumps([CACHE_FORMAT, self.impl, extra, sys.version]).encode())
        for path in option_paths(extra):
            for name in ([path] if os.path.isfile(path) else _tree_files(path)):
                if os.path.isfile(name):
                    _hash_file(h, "option:" + _named(name), name)
        if self.adapter is not None:
            h.update(f"adapter:{self.adapter.where}".encode())
            for path in self.adapter.files:
                if os.path.isfile(path):
                    _hash_file(h, "adapter:" + _named(path), path)
                else:
                    h.update(f"adapter:{_named(path)}:absent".encode())
            h.update(json.dumps(self.adapter.distributions, sort_keys=True).encode())
        for lib in LIBRARIES:
            try:
                h.update(f"{lib}={metadata.version(lib)}".encode())
            except metadata.PackageNotFoundError:
                h.update(f"{lib}=absent".encode())
        return h.hexdigest()


@dataclass
class Result:
    """One suite run of one content: its outcome and, when the suite wrote one, its report."""
    key: str
    sha256: str
    outcome: str  # one of OUTCOMES
    exit_status: int | None
    message: str  # the usage error, or the end of a crashed run's output; "" for a report
    duration_s: float
    report: dict | None
    cached: bool = False

    def to_json(self) -> dict:
        return {"format": CACHE_FORMAT, "key": self.key, "sha256": self.sha256, "outcome": self.outcome,
                "exit_status": self.exit_status, "message": self.message, "duration_s": round(self.duration_s, 2),
                "report": self.report}


def atomic_write(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, flushed, then renamed over it."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class Cache:
    """Results by key (sha256 of the content and of the suite), one JSON file each with its ``.meta.json``,
    and the sources the runs read (``sources/<sha256>/<name>``), kept so a report's paths stay valid.
    ``read=False`` (--no-cache): nothing is read from it; what runs is written as usual."""

    def __init__(self, folder: str, suite_hash: str, base_hash: str | None = None, rules=(), read: bool = True):
        self.folder = folder
        self.suite_hash = suite_hash
        self.base_hash = base_hash  # the suite hash without the --rule selection
        self.rules = list(rules)  # the --rule values of this run ([]: every rule)
        self.read = read
        try:
            os.makedirs(os.path.join(folder, "results"), exist_ok=True)
            os.makedirs(os.path.join(folder, "sources"), exist_ok=True)
        except OSError as e:
            raise HistoryError(f"{folder}: cannot create the cache: {e.strerror or e}") from None
        for name in os.listdir(os.path.join(folder, "results")):
            if name.startswith(".tmp-"):  # left by a run killed mid-write (SIGKILL): never an entry
                try:
                    os.unlink(os.path.join(folder, "results", name))
                except OSError:
                    pass

    def key(self, sha256: str) -> str:
        return hashlib.sha256(f"{sha256}:{self.suite_hash}".encode()).hexdigest()

    def _entry(self, key: str) -> str:
        return os.path.join(self.folder, "results", f"{key}.json")

    def get(self, sha256: str) -> Result | None:
        return self._load(self.key(sha256), sha256) if self.read else None

    def _load(self, key: str, sha256: str) -> Result | None:
        try:
            with open(self._entry(key), encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None  # unreadable: run it again (the new entry replaces it)
        if not isinstance(data, dict) or data.get("key") != key or data.get("format") != CACHE_FORMAT \
                or data.get("sha256") != sha256 or data.get("outcome") not in CACHED_OUTCOMES:
            return None
        return Result(key, sha256, data["outcome"], data.get("exit_status"), data.get("message") or "",
                      float(data.get("duration_s") or 0.0), data.get("report"), cached=True)

    def find(self, sha256: str, rule: str) -> Result | None:
        """This run's entry for the content, else one a run with another ``--rule`` selection wrote, all
        else the same (the hash without the selection), whose selection has ``rule`` and whose report
        judged it: a bisection reads what a full run or an area's run already knows."""
        hit = self.get(sha256)
        if hit is not None or not self.read or self.base_hash is None:
            return hit
        folder = os.path.join(self.folder, "results")
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".meta.json"):
                continue
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict) or meta.get("sha256") != sha256 or meta.get("base") != self.base_hash:
                continue
            wanted = meta.get("rules") or []
            if wanted and not any(v == rule or rule.startswith(v + "-") for v in wanted):
                continue
            found = self._load(name[: -len(".meta.json")], sha256)
            if found is None:
                continue
            if found.outcome == "report" and not any(r.get("id") == rule for r in found.report.get("rules", [])):
                continue
            return found
        return None

    def put(self, result: Result) -> None:
        if result.outcome in CACHED_OUTCOMES:
            atomic_write(self._entry(result.key), json.dumps(result.to_json()).encode())
            meta = {"format": CACHE_FORMAT, "sha256": result.sha256, "base": self.base_hash, "rules": self.rules}
            atomic_write(os.path.join(self.folder, "results", f"{result.key}.meta.json"), json.dumps(meta).encode())

    def source(self, sha256: str, name: str, content: bytes) -> str:
        path = os.path.join(self.folder, "sources", sha256, name)
        if not os.path.isfile(path):
            atomic_write(path, content)
        return path


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def usage_message(output: str) -> str:
    """pytest's ``ERROR: ...`` lines of a usage error (the adapter's reason), else the output's end."""
    found, collecting = [], False
    for line in output.splitlines():
        if line.startswith("ERROR: "):
            found.append(line[len("ERROR: "):])
            collecting = True
        elif collecting and line.startswith("  "):
            found.append(line.strip())
        else:
            collecting = False
    return "\n".join(found) if found else _tail(output)


class Runner:
    """Runs the suite on contents, at most ``jobs`` at a time, each once per cache key. ``stop()`` (from
    the main thread on Ctrl-C) ends every child's process group and starts no new one."""

    def __init__(self, suite: Suite, cache: Cache, jobs: int, work: str, rule: str | None = None):
        self.suite, self.cache, self.jobs, self.work = suite, cache, max(1, jobs), work
        self.rule = rule  # a bisection's rule: a wider run's entry that judged it will do (Cache.find)
        self.executed = 0
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen] = set()
        self._stopping = threading.Event()
        self._ran: dict[str, Result] = {}  # this process's runs (--no-cache reads no entry, but runs a content once)

    def cached(self, sha256: str) -> Result | None:
        with self._lock:
            if sha256 in self._ran:
                return self._ran[sha256]
        return self.cache.get(sha256) if self.rule is None else self.cache.find(sha256, self.rule)

    def run_one(self, sha256: str, name: str, content: bytes) -> Result:
        """The cached result, or a new run (cached when its outcome depends on the content alone)."""
        hit = self.cached(sha256)
        if hit is not None:
            return hit
        source = self.cache.source(sha256, name, content)
        key = self.cache.key(sha256)
        os.makedirs(self.work, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f"run-{sha256[:12]}-", dir=self.work)
        try:
            report_path = os.path.join(scratch, "report.json")
            log_path = os.path.join(scratch, "output.txt")
            started = time.monotonic()
            with open(log_path, "wb") as log:
                with self._lock:
                    if self._stopping.is_set():
                        raise KeyboardInterrupt
                    # Its own session: Ctrl-C reaches the tool, which ends the child's whole group itself.
                    child = subprocess.Popen(self.suite.command(source, report_path), cwd=run_dir(), stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True)
                    self._children.add(child)
                    self.executed += 1
                try:
                    status = child.wait(timeout=self.suite.timeout_s)
                except subprocess.TimeoutExpired:
                    self._end(child)
                    status = None
                except BaseException:  # Ctrl-C while the main thread waits on it (bisect)
                    self._stopping.set()
                    self._end(child)
                    raise
                finally:
                    with self._lock:
                        self._children.discard(child)
            if self._stopping.is_set():
                raise KeyboardInterrupt
            duration = time.monotonic() - started
            with open(log_path, encoding="utf-8", errors="replace") as f:
                output = f.read()
            result = self._result(key, sha256, status, output, report_path, duration)
            self.cache.put(result)
            with self._lock:
                self._ran[sha256] = result
            return result
        finally:
            _remove_tree(scratch)  # a crash's message has the end of its output

    def _result(self, key, sha256, status, output, report_path, duration) -> Result:
        if status is None:
            return Result(key, sha256, "timed_out", None, f"no verdict after {self.suite.timeout_s:g} s: ended "
                          f"(--timeout)\n{_tail(output)}", duration, None)
        if status == USAGE_ERROR:
            return Result(key, sha256, "usage_error", status, usage_message(output), duration, None)
        if status in REPORTED:
            try:
                with open(report_path, encoding="utf-8") as f:
                    return Result(key, sha256, "report", status, "", duration, json.load(f))
            except (OSError, ValueError) as e:
                return Result(key, sha256, "crashed", status, f"exit status {status} but no readable report "
                              f"({e})\n{_tail(output)}", duration, None)
        return Result(key, sha256, "crashed", status, f"exit status {status}\n{_tail(output)}", duration, None)

    def _end(self, child: subprocess.Popen) -> None:
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                child.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            children = list(self._children)
        for child in children:
            self._end(child)

    def run_many(self, items: list[tuple[str, str, bytes]], on_done) -> dict[str, Result]:
        """Run every (sha256, name, content) not cached, ``jobs`` at a time; ``on_done(result)`` after
        each (cached ones first). Ctrl-C ends the children, lets the finished results stand in the cache
        and re-raises KeyboardInterrupt."""
        results: dict[str, Result] = {}
        todo = []
        for sha256, name, content in items:
            if sha256 in results or any(t[0] == sha256 for t in todo):
                continue
            hit = self.cached(sha256)
            if hit is not None:
                results[sha256] = hit
                on_done(hit)
            else:
                todo.append((sha256, name, content))
        if not todo:
            return results
        pool = ThreadPoolExecutor(max_workers=self.jobs, thread_name_prefix="suite-run")
        pending = {pool.submit(self.run_one, *item): item[0] for item in todo}
        try:
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    sha256 = pending.pop(future)
                    results[sha256] = future.result()
                    on_done(results[sha256])
        except BaseException:
            for future in pending:
                future.cancel()
            self.stop()
            pool.shutdown(wait=True)
            raise
        pool.shutdown(wait=True)
        return results


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def default_jobs() -> int:
    """Half the cores this process may use (a suite run keeps about one core busy and Paddle's threads
    the rest), at least 1, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))
