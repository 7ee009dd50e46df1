"""CLI targets: the train step a file, module or ``MODULE:FUNCTION`` names (what plans record as their origin).

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns a Workload: an object with ``step`` (the train step)
and ``args`` (a tuple of its arguments), and optionally ``name`` and ``init``
(``examples/common.Workload`` is one). Both forms are checked when loaded.
``init(seed)``, when present, builds the arguments traceably, so a launch
bundle can create them directly in a plan's layouts.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
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


WORKLOAD_FORM = ("FUNCTION takes no arguments and returns a Workload: an object with .step (the train step) and "
                 ".args (a tuple of its arguments, arrays or jax.ShapeDtypeStructs), as examples/common.Workload")


def _made(made_by: Any, target: str) -> LoadedTarget:
    """What a ``MODULE:FUNCTION`` target's function returns, checked: called with no arguments, it must give
    a Workload (``WORKLOAD_FORM``); TargetError says what it takes or what it gave instead."""
    try:
        required = [p.name for p in inspect.signature(made_by).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):  # a builtin without a signature: let the call say
        required = []
    if required:
        raise TargetError(f"{target} takes arguments ({', '.join(required)}): it looks like a train step, not what "
                          f"a TARGET names; {WORKLOAD_FORM}")
    made = made_by()
    step, args = getattr(made, "step", None), getattr(made, "args", None)
    if not callable(step) or not isinstance(args, (tuple, list)):
        got = f"a {type(made).__name__}" + ("" if made is None else f" with .step={type(step).__name__}, "
                                                                    f".args={type(args).__name__}")
        raise TargetError(f"{target}() returned {got}; {WORKLOAD_FORM}")
    return LoadedTarget(step, tuple(args), getattr(made, "name", target.partition(":")[2]), getattr(made, "init", None))


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
        return _made(made_by, target)
    if not hasattr(module, "workload"):
        raise TargetError(f"{module_name} has no workload(config, abstract=...) function; name another with "
                          f"{module_name}:FUNCTION, where {WORKLOAD_FORM}")
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
