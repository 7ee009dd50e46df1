"""What a benchmark ran on: command, date, machine (cores, memory, load), package versions, commit."""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGES = ("jax", "jaxlib", "flax", "optax", "ortools", "numpy")


@dataclass(frozen=True)
class Machine:
    command: str
    date: str  # ISO 8601, UTC
    host: str  # platform string
    cpus: int
    memory_gib: float
    load_before: tuple[float, float, float]  # 1, 5, 15 minute load averages when the run started
    versions: dict[str, str]
    commit: str  # git HEAD, "+dirty" when the working tree has changes

    def load_now(self) -> tuple[float, float, float]:
        return os.getloadavg()


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


SIDE_OUTPUTS = ("--json", "--plans")  # options naming files written beside a report: not part of its command


def recorded_args(argv: Sequence[str]) -> list[str]:
    """A command line as a report records it: without the side outputs' paths (``SIDE_OUTPUTS``), which are
    often outside the repository and change nothing the report says."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in SIDE_OUTPUTS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in SIDE_OUTPUTS)):
            kept.append(arg)
    return kept


def describe(argv: list[str] | None = None) -> Machine:
    argv = sys.argv if argv is None else argv
    module = "python -m benchmarks.run" if argv and argv[0].endswith("run.py") else " ".join(argv[:1])
    return Machine(
        command=" ".join([module, *recorded_args(argv[1:])]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=f"{platform.system()} {platform.release()} {platform.machine()}, Python {platform.python_version()}",
        cpus=os.cpu_count() or 0,
        memory_gib=_memory_gib(),
        load_before=os.getloadavg(),
        versions={name: _version(name) for name in PACKAGES},
        commit=_commit(),
    )


@dataclass
class LoadSampler:
    """Samples the 1-minute load average every ``period_s`` on a daemon thread while a run lasts."""

    period_s: float = 15.0
    samples: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> LoadSampler:
        self.samples.append(os.getloadavg()[0])
        threading.Thread(target=self._loop, daemon=True, name="load-sampler").start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self.samples.append(os.getloadavg()[0])

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> str:
        if not self.samples:
            return "not sampled"
        mean = sum(self.samples) / len(self.samples)
        low, high = min(self.samples), max(self.samples)
        return f"mean {mean:.1f}, min {low:.1f}, max {high:.1f} ({len(self.samples)} samples)"


def cells_main(argv: Sequence[str] | None, *, description: str, default_cells: Sequence[str], cell_help: str,
               default_time_limit: float, measure: Callable[[str, float], Any], say: Callable[[Any], str],
               markdown: Callable[[list[Any], str, float], str]) -> int:
    """The command line of a per-cell fidelity benchmark: ``--cells``, ``--time-limit`` and ``--out``; each cell
    measured (``measure(cell, time_limit)``) and reported in one line (``say``), then the markdown printed
    (and written to ``--out``). Exit status 1 when a row is not ``ok``."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("--cells", nargs="+", default=list(default_cells), help=cell_help)
    parser.add_argument("--time-limit", type=float, default=default_time_limit, help="solver seconds per solve")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown here")
    args = parser.parse_args(argv)
    rows = []
    for cell in args.cells:
        row = measure(cell, args.time_limit)
        print(say(row), flush=True)
        rows.append(row)
    text = markdown(rows, " ".join(f"{x:.1f}" for x in os.getloadavg()), args.time_limit)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return 0 if all(r.ok for r in rows) else 1
