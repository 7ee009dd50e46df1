"""The ``autoshard`` command line (argparse + rich).

    autoshard trace examples/gpt.py [--config large]      graph summary of a workload's train step
    autoshard plan  examples/gpt.py --mesh 2x4 --cluster 1x8-a100 [--out plan.json]

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns an object with ``step`` and ``args``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

console = Console()


def _import(target: str) -> Any:
    path = Path(target)
    if path.suffix == ".py" or path.exists():
        if not path.exists():
            raise SystemExit(f"error: {target} does not exist")
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


def load_workload(target: str, config: str, *, abstract: bool) -> tuple[Any, tuple[Any, ...], str]:
    """(step, args, name) of a CLI target."""
    module_name, _, func = target.partition(":")
    module = _import(module_name)
    if func:
        made = getattr(module, func)()
        return made.step, tuple(made.args), getattr(made, "name", func)
    if not hasattr(module, "workload"):
        raise SystemExit(f"error: {module_name} has no workload(config, abstract=...) function; "
                         f"name one with MODULE:FUNCTION")
    made = module.workload(config, abstract=abstract)
    return made.step, tuple(made.args), made.name


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise SystemExit(f"error: --mesh takes sizes like 2x4, got {text!r}") from None


def _ensure_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def cmd_trace(args: argparse.Namespace) -> int:
    from autoshard.compiler.trace import trace

    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    start = time.perf_counter()
    graph = trace(step, *step_args)
    seconds = time.perf_counter() - start
    console.print(f"[bold]{name}[/bold] traced in {seconds:.2f}s")
    console.print(graph.summary(), markup=False, highlight=False)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from autoshard.compiler.driver import plan_step

    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    budget = args.memory_budget_gib * 2**30 if args.memory_budget_gib else None
    with console.status(f"planning {name}..."):
        planned = plan_step(step, step_args, mesh=_parse_mesh(args.mesh), cluster=args.cluster,
                            memory_budget=budget, num_devices=args.devices, name=name)
    console.print(str(planned.plan), markup=False, highlight=False)
    if args.out:
        planned.plan.save(args.out)
        console.print(f"plan written to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="trace a workload's train step and print the graph summary")
    p.add_argument("target")
    p.add_argument("--config", default="small")
    p.set_defaults(func=cmd_trace)
    p = sub.add_parser("plan", help="plan a workload on a mesh and cluster")
    p.add_argument("target")
    p.add_argument("--config", default="small")
    p.add_argument("--mesh", help="logical mesh shape, e.g. 2x4 (default: searched)")
    p.add_argument("--cluster", default=None, help="preset name or .json/.toml ClusterSpec file")
    p.add_argument("--devices", type=int, default=None, help="device count when --mesh is not given")
    p.add_argument("--memory-budget-gib", type=float, default=None)
    p.add_argument("--out", help="write the plan file here")
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _ensure_devices(getattr(args, "devices", None) or 8)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
