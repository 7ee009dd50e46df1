"""Progress lines for long work (loading, tracing, each solve, compiling), for the CLI and scripts.

    with progress_lines(console, "planning gpt-small") as say:
        say("tracing")                        # pass `say` as `progress=` to autoshard.plan / @autoshard
        ...

On a terminal: one rich spinner line, ``planning gpt-small: tracing  0:00:01``, replaced by each ``say``
and gone when the block ends. Anywhere else (a pipe, a log file, CI) a spinner would print nothing until
the end, so each ``say`` is one line on stderr as it happens, with the seconds since the block started:
``[  1.2s] planning gpt-small: tracing``. Either way a line appears as each phase starts.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

__all__ = ["progress_lines"]


@contextlib.contextmanager
def progress_lines(console: Console, what: str) -> Iterator[Callable[[str], None]]:
    """A spinner (terminal) or timestamped stderr lines (elsewhere); the yielded function reports a phase."""
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task(what, total=None)
            yield lambda text: progress.update(task, description=f"{what}: {text}")
        return
    log = Console(stderr=True, soft_wrap=True, highlight=False)
    start = time.perf_counter()

    def say(text: str) -> None:
        log.print(f"[{time.perf_counter() - start:6.1f}s] {what}: {text}", markup=False)

    yield say
