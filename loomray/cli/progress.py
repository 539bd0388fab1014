"""Progress of long commands on stderr, and whether someone is at the terminal to answer a question.

Progress never goes to stdout, so ``--json`` output stays parseable.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import IO, TypeVar

import click
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from loomray.cli.common import err_console

T = TypeVar("T")

progress_option = click.option(
    "--progress", "show_progress", is_flag=True,
    help="Report progress on stderr even when it is not a terminal (on a terminal it always is).")


def _is_tty(stream: IO[str] | None) -> bool:
    try:
        return bool(stream and stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


def stdin_is_tty() -> bool:
    """Whether stdin is a terminal (someone can answer a question)."""
    return _is_tty(sys.stdin)


def run_progress() -> Progress:
    """Progress bars for runs under way: a spinner, the label, a bar, an ``info`` field and the elapsed time."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console, transient=False)


class Activity:
    """Progress of one long command on stderr, never on stdout (``--json`` stays parseable).

    On a terminal: a live spinner with the current step and the elapsed time,
    gone when the work ends. With ``--progress`` elsewhere (a log, CI): one
    plain line per step, with the seconds elapsed. Otherwise nothing.
    """

    def __init__(self, what: str, force: bool = False) -> None:
        self.what = what
        self.live = _is_tty(sys.stderr)  # a live display only where someone watches
        self.enabled = self.live or force
        self._started = time.monotonic()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Activity:
        self._started = time.monotonic()
        if self.live:
            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=err_console, transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.what, total=None)
        return self

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def step(self, text: str) -> None:
        """Report the step now under way."""
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=f"{self.what}: {text}")
        elif self.enabled:
            err_console.print(f"{self.what}: {text} ({self.elapsed():.1f} s)", highlight=False, soft_wrap=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.enabled and not self.live:
            state = "done" if exc_type is None else "stopped"
            err_console.print(f"{self.what}: {state} in {self.elapsed():.1f} s", highlight=False, soft_wrap=True)


def iter_progress(activity: Activity, items: Sequence[T], label: str) -> Iterator[T]:
    """``items`` while reporting ``label i/n`` on ``activity`` (plain lines at most ~20 times)."""
    n = len(items)
    every = 1 if activity.live else max(1, n // 20)
    for i, item in enumerate(items, 1):
        if i == 1 or i == n or i % every == 0:
            activity.step(f"{label} {i}/{n}")
        yield item
