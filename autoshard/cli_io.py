"""What the command line's commands share: its console, its errors, and the parsing and checking of flags."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from autoshard.progress import progress_lines

# pipes and logs get wide tables, so that no spec or path wraps onto a line of its own
console = Console() if sys.stdout.isatty() else Console(width=300)


class CliError(Exception):
    """Bad input to a command; ``main`` prints the message (what to change) and exits with status 2."""


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that never takes a prefix of a flag for the flag (``allow_abbrev=False``): one meaning
    per flag (``--memory-budget 1000`` is not ``--memory-budget-gib 1000``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise CliError(f"--mesh takes sizes like 2x4, got {text!r}") from None
    if any(s < 1 for s in shape):
        raise CliError(f"--mesh sizes must be positive, got {text!r}")
    return shape


def positive(text: str) -> float:
    """argparse type of --time-limit: a positive number (0 is not 'the default')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r} (leave the flag out for the "
                                         "default)")
    return value


def check_writable(path: str | None, flag: str) -> None:
    """Fail before any work when ``path`` (an output flag's file) cannot be written."""
    if not path:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise CliError(f"{flag} {path} is a directory; give a file name")
    if not folder.is_dir():
        raise CliError(f"{flag} {path}: the directory {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CliError(f"{flag} {path} is not writable; write elsewhere")


def write_or_fail(path: str, write: Callable[[], None], flag: str) -> None:
    try:
        write()
    except OSError as err:
        raise CliError(f"could not write {flag} {path}: {err.strerror or err}") from None


def ensure_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def devices_needed(args: argparse.Namespace) -> int:
    """Simulated devices to ask for before jax starts: the mesh's, a plan file's, or 8."""
    if getattr(args, "devices", None):
        return int(args.devices)
    mesh = parse_mesh(getattr(args, "mesh", None))
    if mesh:
        return max(8, prod(mesh))
    target = getattr(args, "target", None) or getattr(args, "plan", None)
    if target and str(target).endswith(".json") and Path(target).exists():
        with contextlib.suppress(Exception):
            return max(8, prod(json.loads(Path(target).read_text())["mesh"]["shape"]))
    return 8


def positive_int(text: str) -> int:
    """argparse type of --devices: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def prod(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def check_flags(args: argparse.Namespace) -> None:
    """Every planning flag checked at once, before any target is loaded or traced (``autoshard/arguments.py``,
    errors naming the flags); ``--memory-budget`` is kept in bytes as ``args.memory_budget_bytes``."""
    from autoshard.arguments import CLI_NAMES, check_arguments

    if getattr(args, "memory_budget_gib", None) is not None:
        raise CliError(f"--memory-budget-gib is gone: the budget flag takes a unit, --memory-budget "
                       f"{args.memory_budget_gib}GiB")
    if getattr(args, "command", None) == "validate":  # the mesh and cluster a plan will run on: validate's checks
        names = ("memory_budget",)
    else:
        names = ("mesh", "cluster", "memory_budget", "stages", "microbatches", "while_trip_count", "devices")
    given = {k: getattr(args, k, None) for k in names}
    checked = check_arguments(mesh=parse_mesh(given.get("mesh")), cluster=given.get("cluster"),
                              memory_budget=given["memory_budget"], num_stages=given.get("stages"),
                              num_microbatches=given.get("microbatches"),
                              while_trip_count=given.get("while_trip_count"), num_devices=given.get("devices"),
                              names=CLI_NAMES)
    args.memory_budget_bytes = checked.memory_budget


def memory_budget(args: argparse.Namespace) -> float | None:
    """The per-device budget in bytes (``check_flags`` parsed ``--memory-budget``), None for the default."""
    return getattr(args, "memory_budget_bytes", None)


def intra_op_options(args: argparse.Namespace) -> Any:
    from autoshard.passes.intra_op import IntraOpOptions

    limit = getattr(args, "time_limit", None)
    return IntraOpOptions(time_limit_s=limit) if limit is not None else None


def progress(what: str) -> contextlib.AbstractContextManager[Callable[[str], None]]:
    return progress_lines(console, what)


def print_all(*renderables: Any) -> None:
    for r in renderables:
        console.print(r)


def origin(args: argparse.Namespace) -> dict[str, str]:
    """How to rebuild the step: a file target is recorded by absolute path, so `verify` works from anywhere."""
    module, _, func = args.target.partition(":")
    if Path(module).exists():
        module = str(Path(module).resolve())
    return {"target": module + (f":{func}" if func else ""), "config": args.config}
