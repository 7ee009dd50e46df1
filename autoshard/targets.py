"""CLI targets: the train step a file, module or ``MODULE:FUNCTION`` names (what plans record as their origin).

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns an object with ``step`` and ``args`` (and optionally
``name`` and ``init``). ``init(seed)``, when present, builds the arguments
traceably, so a launch bundle can create them directly in a plan's layouts.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.errors import PlanningError


class TargetError(PlanningError):
    """A CLI target or its config cannot be loaded; the message says what is wrong and what to give."""


@dataclass(frozen=True)
class LoadedTarget:
    step: Any
    args: tuple[Any, ...]
    name: str
    init: Any = None  # init(seed) -> args, traceable; None when the target offers none


def _import(target: str) -> Any:
    path = Path(target)
    if path.suffix == ".py" or path.exists():
        if not path.exists():
            raise TargetError(f"{target} does not exist")
        root = str(path.resolve().parent.parent)
        if root not in sys.path:
            sys.path.insert(0, root)
        package = path.resolve().parent.name
        try:
            return importlib.import_module(f"{package}.{path.stem}")
        except ImportError:
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(target)


def load_target(target: str, config: str, *, abstract: bool) -> LoadedTarget:
    """The step, arguments, name and initializer of a CLI target; TargetError says what is wrong with the
    target or the config."""
    module_name, _, func = target.partition(":")
    try:
        module = _import(module_name)
    except ImportError as err:
        raise TargetError(f"cannot import {module_name!r} ({type(err).__name__}: {err}); TARGET is a .py file, a "
                          "module importable from here, or MODULE:FUNCTION") from None
    if func:
        made_by = getattr(module, func, None)
        if not callable(made_by):
            names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise TargetError(f"{module_name} has no function {func!r}; it has {', '.join(names[:12]) or 'none'}")
        made = made_by()
        if not (hasattr(made, "step") and hasattr(made, "args")):
            raise TargetError(f"{target}() returned a {type(made).__name__}; it must return an object with .step "
                              "(the train step) and .args (its arguments)")
        return LoadedTarget(made.step, tuple(made.args), getattr(made, "name", func), getattr(made, "init", None))
    if not hasattr(module, "workload"):
        raise TargetError(f"{module_name} has no workload(config, abstract=...) function; name one with "
                          "MODULE:FUNCTION")
    configs = getattr(module, "CONFIGS", None)
    if isinstance(configs, dict) and config not in configs:
        raise TargetError(f"unknown --config {config!r} for {module_name}; choose one of {', '.join(configs)}")
    try:
        made = module.workload(config, abstract=abstract)
    except (KeyError, ValueError) as err:
        raise TargetError(f"{module_name}.workload({config!r}) refused: {err}") from None
    return LoadedTarget(made.step, tuple(made.args), made.name, getattr(made, "init", None))


def load_workload(target: str, config: str, *, abstract: bool) -> tuple[Any, tuple[Any, ...], str]:
    """(step, args, name) of a CLI target."""
    loaded = load_target(target, config, abstract=abstract)
    return loaded.step, loaded.args, loaded.name
