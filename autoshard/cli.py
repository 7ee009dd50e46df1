"""The ``autoshard`` command line (argparse + rich).

    autoshard trace    TARGET [--config small]                       graph summary of a workload's train step
    autoshard plan     TARGET --mesh 2x4 --cluster 1x8-a100 [--out plan.json]
    autoshard explain  plan.json [--op N] [--html report.html | --png report.png]
    autoshard compare  TARGET --mesh 2x4 --cluster 1x8-a100 [--out plan.json]
    autoshard validate plan.json --cluster 2x8-a100 [--mesh 2x8] [--memory-budget-gib 40]
    autoshard export   plan.json --format flax-rules [--python] [--out rules.json]
    autoshard verify   plan.json | TARGET [--mesh 2x4]

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns an object with ``step`` and ``args``. Plans record
their target, so ``verify plan.json`` rebuilds the step. Exit status: 0 when
all is well, 1 when ``validate`` or ``verify`` finds a problem, 2 on an error.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from autoshard.progress import progress_lines

# pipes and logs get wide tables, so that no spec or path wraps onto a line of its own
console = Console() if sys.stdout.isatty() else Console(width=300)


class CliError(Exception):
    """Bad input to a command; ``main`` prints the message (what to change) and exits with status 2."""


def _import(target: str) -> Any:
    path = Path(target)
    if path.suffix == ".py" or path.exists():
        if not path.exists():
            raise CliError(f"{target} does not exist")
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
    """(step, args, name) of a CLI target; CliError says what is wrong with the target or the config."""
    module_name, _, func = target.partition(":")
    try:
        module = _import(module_name)
    except ImportError as err:
        raise CliError(f"cannot import {module_name!r} ({type(err).__name__}: {err}); TARGET is a .py file, a "
                       f"module importable from here, or MODULE:FUNCTION") from None
    if func:
        made_by = getattr(module, func, None)
        if not callable(made_by):
            names = sorted(n for n in vars(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise CliError(f"{module_name} has no function {func!r}; it has {', '.join(names[:12]) or 'none'}")
        made = made_by()
        if not (hasattr(made, "step") and hasattr(made, "args")):
            raise CliError(f"{target}() returned a {type(made).__name__}; it must return an object with .step "
                           "(the train step) and .args (its arguments)")
        return made.step, tuple(made.args), getattr(made, "name", func)
    if not hasattr(module, "workload"):
        raise CliError(f"{module_name} has no workload(config, abstract=...) function; name one with MODULE:FUNCTION")
    configs = getattr(module, "CONFIGS", None)
    if isinstance(configs, dict) and config not in configs:
        raise CliError(f"unknown --config {config!r} for {module_name}; choose one of {', '.join(configs)}")
    try:
        made = module.workload(config, abstract=abstract)
    except (KeyError, ValueError) as err:
        raise CliError(f"{module_name}.workload({config!r}) refused: {err}") from None
    return made.step, tuple(made.args), made.name


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise CliError(f"--mesh takes sizes like 2x4, got {text!r}") from None
    if any(s < 1 for s in shape):
        raise CliError(f"--mesh sizes must be positive, got {text!r}")
    return shape


def _positive(text: str) -> float:
    """argparse type of --memory-budget-gib and --time-limit: a positive number (0 is not 'the default')."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r} (leave the flag out for the "
                                         "default)")
    return value


def _writable(path: str | None, flag: str) -> None:
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


def _write(path: str, write: Callable[[], None], flag: str) -> None:
    try:
        write()
    except OSError as err:
        raise CliError(f"could not write {flag} {path}: {err.strerror or err}") from None


def _ensure_devices(count: int) -> None:
    flag = f"--xla_force_host_platform_device_count={count}"
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _devices_needed(args: argparse.Namespace) -> int:
    """Simulated devices to ask for before jax starts: the mesh's, a plan file's, or 8."""
    if getattr(args, "devices", None):
        return int(args.devices)
    mesh = _parse_mesh(getattr(args, "mesh", None))
    if mesh:
        return max(8, _prod(mesh))
    target = getattr(args, "target", None) or getattr(args, "plan", None)
    if target and str(target).endswith(".json") and Path(target).exists():
        with contextlib.suppress(Exception):
            return max(8, _prod(json.loads(Path(target).read_text())["mesh"]["shape"]))
    return 8


def _count(text: str) -> int:
    """argparse type of --devices: a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _prod(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _budget(args: argparse.Namespace) -> float | None:
    gib = getattr(args, "memory_budget_gib", None)
    return gib * 2**30 if gib is not None else None


def _options(args: argparse.Namespace) -> Any:
    from autoshard.passes.intra_op import IntraOpOptions

    limit = getattr(args, "time_limit", None)
    return IntraOpOptions(time_limit_s=limit) if limit is not None else None


def _progress(what: str) -> contextlib.AbstractContextManager[Callable[[str], None]]:
    return progress_lines(console, what)


def _print(*renderables: Any) -> None:
    for r in renderables:
        console.print(r)


# ----------------------------------------------------------------------------- commands


def cmd_trace(args: argparse.Namespace) -> int:
    with _progress("trace") as say:
        say(f"loading {args.target}")
        step, step_args, name = load_workload(args.target, args.config, abstract=True)
        from autoshard.ir.trace import trace

        say(f"tracing {name}")
        start = time.perf_counter()
        graph = trace(step, *step_args)
        seconds = time.perf_counter() - start
    console.print(f"[bold]{name}[/bold] traced in {seconds:.2f}s")
    console.print(graph.summary(), markup=False, highlight=False)
    return 0


def _plan_target(args: argparse.Namespace, say: Callable[[str], None]) -> Any:
    """Trace and plan a TARGET; returns the PlannedStep with the plan's origin recorded."""
    from dataclasses import replace

    say(f"loading {args.target}")
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    from autoshard.compiler.driver import plan_graph
    from autoshard.ir.trace import trace

    say(f"tracing {name}")
    start = time.perf_counter()
    graph = trace(step, *step_args)
    timings = {"trace": time.perf_counter() - start}
    planned = plan_graph(graph, mesh=_parse_mesh(args.mesh), cluster=args.cluster, memory_budget=_budget(args),
                         num_devices=getattr(args, "devices", None), options=_options(args), timings=timings,
                         name=name, progress=say)
    return replace(planned, plan=replace(planned.plan, origin=_origin(args))), step, step_args


def _origin(args: argparse.Namespace) -> dict[str, str]:
    """How to rebuild the step: a file target is recorded by absolute path, so `verify` works from anywhere."""
    module, _, func = args.target.partition(":")
    if Path(module).exists():
        module = str(Path(module).resolve())
    return {"target": module + (f":{func}" if func else ""), "config": args.config}


def cmd_plan(args: argparse.Namespace) -> int:
    _writable(args.out, "--out")
    with _progress("plan") as say:
        planned, _step, _args = _plan_target(args, say)
    from autoshard.report import ledger_table, parameter_table

    _print(ledger_table(planned.plan), parameter_table(planned.plan))
    if args.out:
        _write(args.out, lambda: planned.plan.save(args.out), "--out")
        console.print(f"plan written to {args.out}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.figures import write_html, write_png
    from autoshard.report import explain_renderables

    _writable(args.html, "--html")
    _writable(args.png, "--png")
    plan = load_plan(args.plan)
    if args.op is not None and not 0 <= args.op < plan.num_ops:
        raise CliError(f"--op {args.op} is out of range: the plan has ops 0..{plan.num_ops - 1}")
    renderables = explain_renderables(plan, args.op)
    _print(*renderables)
    if args.html:
        _write(args.html, lambda: write_html(plan, args.html, renderables), "--html")
        console.print(f"report written to {args.html}")
    if args.png:
        _write(args.png, lambda: write_png(plan, args.png), "--png")
        console.print(f"picture written to {args.png}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from autoshard.passes.classic import ALL_BASELINES, Baseline  # light: no jax

    kinds = ALL_BASELINES
    if args.baselines:
        try:
            kinds = tuple(Baseline(k.strip()) for k in args.baselines.split(","))
        except ValueError:
            raise CliError(f"--baselines takes a comma list of {', '.join(b.value for b in Baseline)}") from None
    _writable(args.out, "--out")
    with _progress("compare") as say:
        say(f"loading {args.target}")
        step, step_args, name = load_workload(args.target, args.config, abstract=True)
        from autoshard.compiler.baselines import compare

        result = compare(step, step_args, _parse_mesh(args.mesh), args.cluster,
                         memory_budget=_budget(args), options=_options(args), baselines=kinds,
                         progress=lambda line: say(f"{name}: {line}"))
    from autoshard.report import comparison_table

    _print(comparison_table(result))
    console.print(f"compared in {result.seconds:.1f}s")
    if args.out:
        plan = replace(result.autoshard.plan, origin=_origin(args),
                       baselines=result.summary_dict())
        _write(args.out, lambda: plan.save(args.out), "--out")
        console.print(f"autoshard's plan (with the comparison) written to {args.out}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.plans.planfile import read_header
    from autoshard.plans.validate import validate_plan
    from autoshard.meshes.cluster import get_cluster
    from autoshard.report import findings_table

    plan = load_plan(args.plan)
    cluster = get_cluster(args.cluster) if args.cluster else None
    findings = validate_plan(plan, cluster=cluster, mesh_shape=_parse_mesh(args.mesh),
                             memory_budget_bytes=_budget(args),
                             file_versions=read_header(args.plan))
    _print(findings_table(findings))
    failed = [f for f in findings if f.failed]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed[/bold red]: " + "; ".join(f.check for f in failed))
        return 1
    console.print("[green]the plan passes every check[/green]")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from autoshard.plans.export import dumps, flax_rules, flax_rules_python
    from autoshard.plans.plan import load_plan

    if args.format != "flax-rules":
        raise CliError(f"unknown --format {args.format!r}; known: flax-rules")
    _writable(args.out, "--out")
    data = flax_rules(load_plan(args.plan))
    text = flax_rules_python(data) if args.python else dumps(data)
    if args.out:
        _write(args.out, lambda: Path(args.out).write_text(text), "--out")
        console.print(f"{len(data['params'])} parameter specs and {len(data['rules'])} logical rules written to "
                      f"{args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with _progress("verify") as say:
        if args.target.endswith(".json"):
            from autoshard.plans.plan import load_plan


            plan = load_plan(args.target)
            if "target" not in plan.origin:
                raise CliError(f"{args.target} does not record the step it was made from (no origin target); run "
                               "`autoshard verify TARGET` instead")
            say(f"loading {plan.origin['target']}")
            step, step_args, _name = load_workload(plan.origin["target"], plan.origin.get("config", "small"),
                                                   abstract=True)
        else:
            planned, step, step_args = _plan_target(args, say)
            plan = planned.plan
        from autoshard.compiler.verify import verify_compiled
        from autoshard.runtime.spmd import make_jax_mesh

        mesh = make_jax_mesh(tuple(plan.mesh_shape), plan.axis_names)
        say("compiling")
        start = time.perf_counter()
        compiled = plan.apply(step, mesh).lower(*step_args).compile()
        compile_s = time.perf_counter() - start
        report = verify_compiled(plan, compiled)
    from autoshard.report import fidelity_lines, fidelity_table

    _print(fidelity_table(report, f"plan '{plan.name}' predicted vs compiled",
                          f"mesh {'x'.join(map(str, plan.mesh_shape))} of {plan.cluster.name}, XLA:CPU on simulated "
                          f"devices, compiled in {compile_s:.1f}s"))
    flagged = [line.what for line in fidelity_lines(report) if line.flagged]
    if flagged:
        console.print(f"[bold red]{len(flagged)} figure(s) off by more than their tolerance[/bold red]: "
                      f"{', '.join(flagged)}")
        return 1
    return 0


# ----------------------------------------------------------------------------- parser


def _planning_flags(p: argparse.ArgumentParser, *, mesh_help: str = "logical mesh shape, e.g. 2x4") -> None:
    p.add_argument("--config", default="small", help="workload config (default: small)")
    p.add_argument("--mesh", help=mesh_help)
    p.add_argument("--cluster", default=None, help="preset name or .json/.toml ClusterSpec file")
    p.add_argument("--memory-budget-gib", type=_positive, default=None,
                   help="per-device budget (default: device memory)")
    p.add_argument("--time-limit", type=_positive, default=None, help="ILP time limit in seconds per solve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoshard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("trace", help="trace a workload's train step and print the graph summary")
    p.add_argument("target")
    p.add_argument("--config", default="small")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("plan", help="plan a workload on a mesh and cluster")
    p.add_argument("target", help="MODULE:FUNCTION, a module or a .py file with workload()")
    _planning_flags(p, mesh_help="logical mesh shape, e.g. 2x4 (default: searched)")
    p.add_argument("--devices", type=_count, default=None, help="device count when --mesh is not given")
    p.add_argument("--out", help="write the plan file here")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("explain", help="a plan's specs, ledger and, for --op N, why that op's strategy")
    p.add_argument("plan", help="plan file")
    p.add_argument("--op", type=int, default=None, help="op index: its strategy against the alternatives")
    p.add_argument("--html", help="write an HTML report (tables and pictures)")
    p.add_argument("--png", help="write the pictures (memory per device, pipeline schedule) as PNG")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("compare", help="autoshard vs DP, FSDP, ZeRO-2, HSDP, Megatron TP and DP x TP")
    p.add_argument("target")
    _planning_flags(p)
    p.add_argument("--baselines", help="comma list (default: all): dp,fsdp,zero2,hsdp,megatron-tp,dp-tp")
    p.add_argument("--out", help="write autoshard's plan, with the comparison, here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("validate", help="static checks of a plan file; non-zero exit on failure")
    p.add_argument("plan", help="plan file")
    p.add_argument("--cluster", default=None, help="the cluster it will run on (preset or file)")
    p.add_argument("--mesh", help="the mesh shape it will run on: must be the plan's (default: the plan's)")
    p.add_argument("--memory-budget-gib", type=_positive, default=None,
                   help="per-device budget (default: the cluster's)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("export", help="a plan's parameter layouts as Flax rules / PartitionSpecs")
    p.add_argument("plan", help="plan file")
    p.add_argument("--format", default="flax-rules", help="flax-rules (see autoshard.plans.export)")
    p.add_argument("--python", action="store_true", help="write an importable Python module instead of JSON")
    p.add_argument("--out", help="file to write (default: stdout)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="compile a plan on simulated devices: predicted vs compiled")
    p.add_argument("target", help="plan file (made by `plan` or `compare`) or a TARGET to plan first")
    _planning_flags(p)
    p.set_defaults(func=cmd_verify)

    from autoshard.runtime.launch import add_launch_parser

    add_launch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from autoshard.errors import PlanningError
    from autoshard.meshes.cluster import ClusterSpecError

    try:
        _ensure_devices(_devices_needed(args))
        return int(args.func(args) or 0)
    except (CliError, PlanningError, ClusterSpecError) as err:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {escape(str(err))}", highlight=False)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
