"""What a dead run of ours left behind, swept when the next run starts.

A SIGKILLed orchestrator cannot clean up: its run directory stays in TMPDIR, and whatever its processes
created in /dev/shm stays there too. Everything this project creates carries the project's prefix and the
creating process's pid in its name, so a leftover proves whose it is and whether its owner is dead:

* ``/dev/shm/wscf_{pid}_{hex}``: a segment (``wire.handles.Segment.create``);
* ``/dev/shm/model_weights_status.wscf{pid}x{n}``: a status cell (``fixtures.status_cell.Cell``);
* ``$TMPDIR/wscf-sim-{pid}-*`` and ``$TMPDIR/wscf-ranks-{pid}-*``: the run directory of ``python -m sim``
  and ``python -m sim.ranks``.

Only entries of this user whose pid is not a live process are removed; anything else, a live run's
included, is left alone.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile

from weightsync.wire.handles import PREFIX, SHM_DIR

SHM_NAMES = (re.compile(rf"^{PREFIX}_(\d+)_[0-9a-f]+$"), re.compile(rf"^model_weights_status\.{PREFIX}(\d+)x\d+$"))
RUN_DIR_NAME = re.compile(rf"^{PREFIX}-(?:sim|ranks)-(\d+)-")


def run_dir_prefix(kind: str) -> str:
    """The ``tempfile.mkdtemp`` prefix of this process's run directory (``kind``: sim or ranks)."""
    return f"{PREFIX}-{kind}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """A process with this pid exists (another user's counts: it is not ours to judge)."""
    if pid <= 0:
        return True  # never a process of ours: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_owner(directory: str, name: str, patterns) -> bool:
    for pattern in patterns:
        m = pattern.match(name)
        if m:
            try:
                mine = os.lstat(os.path.join(directory, name)).st_uid == os.getuid()
            except FileNotFoundError:
                return False
            return mine and not pid_alive(int(m.group(1)))
    return False


def sweep_pid(pid: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments and status cells of one process of ours that is dead (a forked child its parent
    reaped, killed before it could unlink them); returns the paths removed. A live pid's are left alone."""
    if pid_alive(pid):
        return []
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        if not any((m := pattern.match(name)) and int(m.group(1)) == pid for pattern in SHM_NAMES):
            continue
        path = os.path.join(shm_dir, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def sweep_dead_runs(shm_dir: str = SHM_DIR, tmp_dir: str | None = None) -> list[str]:
    """Remove the segments, status cells and run directories of our runs whose process is dead; returns
    the paths removed."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed = []
    for directory, patterns, is_dir in ((shm_dir, SHM_NAMES, False), (tmp_dir, (RUN_DIR_NAME,), True)):
        try:
            names = sorted(os.listdir(directory))
        except FileNotFoundError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if not _dead_owner(directory, name, patterns) or os.path.isdir(path) != is_dir or os.path.islink(path):
                continue
            try:
                if is_dir:
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass  # swept by another run meanwhile
            except OSError:
                pass  # not ours to force; the next run tries again
    return removed
