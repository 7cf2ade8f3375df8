"""Progress of the suite runs: a rich progress bar on a terminal, one plain line per run otherwise."""
from __future__ import annotations

import sys
import time


class PlainProgress:
    def __init__(self, total: int, what: str, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.started = time.monotonic()
        print(f"{total} {what} to do (cached ones first)", file=self.stream, flush=True)

    def advance(self, line: str) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {line}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class RichProgress:
    def __init__(self, total: int, what: str):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.progress.start()
        self.task = self.progress.add_task(what, total=total)

    def advance(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)
        self.progress.advance(self.task)

    def close(self) -> None:
        self.progress.stop()


def progress_for(total: int, what: str):
    return RichProgress(total, what) if sys.stderr.isatty() else PlainProgress(total, what)
