"""The versions of one file, oldest first: from a git repository's history, or from a folder of copies.

A version is what the suite runs: the file's bytes, plus what names it on the page (an id, a date and a
title). Reading git goes through the ``git`` command line, so any repository git can read works.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import subprocess
from dataclasses import dataclass


class HistoryError(Exception):
    """A problem with the tool's input or output: the message names the repository, path or file."""


@dataclass
class Version:
    index: int  # position in commit (or name, or manifest) order, from 0
    id: str  # short commit sha, or the file name
    date: str  # ISO 8601, or "" when unknown
    title: str  # the commit's subject, or the manifest's title, or the file name
    path: str  # the file's path in the repository at that commit, or the file's path on disk
    commit: str | None  # the full sha (git input only)
    content: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    def describe(self) -> dict:
        """What history.json says of the version (everything but its bytes)."""
        return {"index": self.index, "id": self.id, "commit": self.commit, "date": self.date, "title": self.title,
                "path": self.path, "sha256": self.sha256, "size": len(self.content)}


def _git(repo: str, *args: str, binary: bool = False):
    try:
        proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, timeout=300)
    except FileNotFoundError:
        raise HistoryError("git is not installed (no `git` on PATH): --repo needs it") from None
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip() or f"exit status {proc.returncode}"
        raise HistoryError(f"{repo}: git {' '.join(args[:3])}...: {err}")
    return proc.stdout if binary else proc.stdout.decode("utf-8", "replace")


class EmptyRange(HistoryError):
    """A --rev-range none of whose commits changed the file (or that has no commits): nothing to run."""


def _root(repo: str) -> str:
    """The repository's root (a work tree's top folder, or a bare repository's git directory)."""
    if not os.path.isdir(repo):
        raise HistoryError(f"{repo}: no such directory")
    try:
        inside = subprocess.run(["git", "-C", repo, "rev-parse", "--is-bare-repository", "--show-toplevel"],
                                capture_output=True, text=True)
    except FileNotFoundError:
        raise HistoryError("git is not installed (no `git` on PATH): --repo needs it") from None
    lines = inside.stdout.split()
    if lines[:1] == ["true"]:
        return _git(repo, "rev-parse", "--absolute-git-dir").strip()
    if inside.returncode != 0:
        raise HistoryError(f"{repo}: not a git repository ({inside.stderr.strip() or 'git rev-parse failed'})")
    return lines[1] if len(lines) > 1 else repo  # paths are the repository root's, whatever folder was given


def _commit_line(repo: str, rev: str) -> tuple[str, str, str, str]:
    """(sha, short sha, committer date, subject) of ``rev``."""
    head = _git(repo, "log", "-1", "--format=%H%x1f%h%x1f%cI%x1f%s", rev, "--").strip()
    sha, short, date, subject = (head.split("\x1f") + ["", "", "", ""])[:4]
    return sha, short, date, subject


def range_ends(rev_range: str) -> tuple[str, str] | None:
    """(A, B) of ``A..B`` or ``A...B`` (an empty end is HEAD); None for a single revision."""
    for sep in ("...", ".."):
        if sep in rev_range:
            a, _, b = rev_range.partition(sep)
            return a or "HEAD", b or "HEAD"
    return None


def baseline(repo: str, path: str, rev_range: str, first: Version | None) -> Version | None:
    """The file as the range starts from, for a gate: at the merge base of ``A`` and ``B`` (the commit a
    pull request branched from: what the base branch gained since is not the request's), under the name
    it had before the range's first version (renames followed); None when the range is a single revision
    or the file did not exist there (the request adds it)."""
    ends = range_ends(rev_range)
    if ends is None:
        return None
    repo = _root(repo)
    for rev in ends:
        found = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                               capture_output=True, text=True)
        if found.returncode != 0:
            raise HistoryError(f"{repo}: --rev-range {rev_range}: {rev!r} names no commit")
    proc = subprocess.run(["git", "-C", repo, "merge-base", *ends], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HistoryError(f"{repo}: {ends[0]} and {ends[1]} have no common ancestor: no base to compare with")
    base = proc.stdout.strip()
    name = path.replace(os.sep, "/").lstrip("/") if first is None else first.path
    if first is not None and first.commit:
        try:
            renamed = _git(repo, "diff", "--name-status", "-M", f"{first.commit}^", first.commit, "--").splitlines()
        except HistoryError:
            renamed = []  # a root commit: nothing before it
        for line in renamed:
            fields = line.split("\t")
            if fields[0].startswith("R") and len(fields) == 3 and fields[2] == first.path:
                name = fields[1]
    try:
        content = _git(repo, "cat-file", "blob", f"{base}:{name}", binary=True)
    except HistoryError:
        return None
    sha, short, date, subject = _commit_line(repo, base)
    return Version(0, short, date, subject, name, sha, content)


def from_git(repo: str, path: str, rev_range: str | None = None, all_branches: bool = False) -> list[Version]:
    """Every commit that changed ``path`` (followed across renames), oldest first in topological order:
    the first-parent line of ``rev_range`` (default HEAD), or every branch with ``all_branches``. A commit
    that deletes the file is not a version. A range no commit of which changed the file is an EmptyRange
    that says so (and how many commits it has); a path no commit ever had, a HistoryError."""
    repo = _root(repo)
    if all_branches and rev_range:
        raise HistoryError("--all and --rev-range exclude each other: --all reads every branch")
    path = path.replace(os.sep, "/").lstrip("/")
    revs = ["--all"] if all_branches else ["--first-parent", rev_range or "HEAD"]
    # One record per commit: \x1e, the fields separated by \x1f, then --name-status lines.
    log = _git(repo, "log", "--topo-order", "--follow", "--name-status", "--diff-merges=first-parent",
               "--format=%x1e%H%x1f%h%x1f%cI%x1f%s", *revs, "--", path)
    records = [r for r in log.split("\x1e") if r.strip()]
    if not records:
        ever = _git(repo, "log", "--all", "-1", "--format=%h", "--", path).strip()
        if rev_range and ever:
            count = int(_git(repo, "rev-list", "--count", "--first-parent", rev_range, "--").strip() or 0)
            if count == 0:
                raise EmptyRange(f"{rev_range}: the range is empty (no commits) in {repo}: no version of {path} to run")
            raise EmptyRange(f"{rev_range}: none of its {count} commit(s) (first-parent line) changed {path} in {repo}: "
                             "no version to run")
        where = "every branch" if all_branches else (rev_range or "HEAD")
        raise HistoryError(f"{path}: never in the history of {repo} ({where}); give the path relative to the "
                           "repository's root")
    found = []
    current = path  # newest first: the file's name at the commit being read
    for record in records:
        head, _, rest = record.partition("\n")
        sha, short, date, subject = (head.split("\x1f") + ["", "", "", ""])[:4]
        status_lines = [line.split("\t") for line in rest.splitlines() if line.strip()]
        deleted, older = False, current
        for fields in status_lines:
            code = fields[0]
            if code.startswith("R") and len(fields) == 3 and fields[2] == current:
                older = fields[1]  # renamed here: older commits have the old name
            elif code == "D" and fields[-1] == current:
                deleted = True
        if not deleted:
            found.append((sha, short, date, subject, current))
        current = older
    versions = []
    for sha, short, date, subject, at in reversed(found):
        try:
            content = _git(repo, "cat-file", "blob", f"{sha}:{at}", binary=True)
        except HistoryError:
            continue  # not at that name at that commit (a merge's other side): no version here
        versions.append(Version(len(versions), short, date, subject, at, sha, content))
    if not versions:
        raise HistoryError(f"{path}: no readable version in the history of {repo}")
    return versions


def _natural(name: str):
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _mtime(path: str) -> str:
    stamp = os.stat(path).st_mtime
    return _dt.datetime.fromtimestamp(stamp, _dt.timezone.utc).replace(microsecond=0).isoformat()


def from_folder(folder: str, manifest: str | None = None) -> list[Version]:
    """The files of ``folder`` in natural name order (``v2`` before ``v10``; hidden files and folders left
    out), or the files a manifest lists in its order. A manifest is a JSON list whose entries are a file
    name (relative to ``folder``) or ``{"file": ..., "id": ..., "date": ..., "title": ...}``."""
    if not os.path.isdir(folder):
        raise HistoryError(f"{folder}: no such directory")
    entries: list[dict] = []
    if manifest is not None:
        try:
            with open(manifest, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise HistoryError(f"{manifest}: cannot read the manifest: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise HistoryError(f"{manifest}: not a JSON manifest: {e}") from None
        if not isinstance(data, list):
            raise HistoryError(f"{manifest}: a manifest is a JSON list of file names or objects with \"file\"")
        for i, entry in enumerate(data):
            if isinstance(entry, str):
                entry = {"file": entry}
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not entry["file"]:
                raise HistoryError(f"{manifest}: entry {i} is neither a file name nor an object with \"file\"")
            for key in ("id", "date", "title"):
                if key in entry and not isinstance(entry[key], str):
                    raise HistoryError(f"{manifest}: entry {i} ({entry['file']}): \"{key}\" is not a string")
            entries.append(entry)
    else:
        names = sorted((n for n in os.listdir(folder)
                        if not n.startswith(".") and os.path.isfile(os.path.join(folder, n))), key=_natural)
        entries = [{"file": n} for n in names]
    if not entries:
        raise HistoryError(f"{folder}: no versions (the folder has no files)" if manifest is None
                           else f"{manifest}: no versions (the manifest is empty)")
    versions = []
    for entry in entries:
        path = os.path.join(folder, entry["file"])
        try:
            with open(path, "rb") as f:
                content = f.read()
        except OSError as e:
            raise HistoryError(f"{path}: cannot read this version: {e.strerror or e}") from None
        name = os.path.basename(entry["file"])
        versions.append(Version(len(versions), entry.get("id") or name, entry.get("date") or _mtime(path),
                                entry.get("title") or name, path, None, content))
    return versions
