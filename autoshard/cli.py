"""The ``autoshard`` command line (argparse + rich).

    autoshard trace    TARGET [--config small]                       graph summary of a workload's train step
    autoshard plan     TARGET --mesh 2x4 --cluster 1x8-a100 [--out plan.json]
    autoshard plan     TARGET --stages 2 [--microbatches 4] [--out pipe.json]   a pipeline (a marked loss)
    autoshard explain  plan.json [--op N] [--html report.html | --png report.png]
    autoshard explain  --legend                                      the notation and terms of the reports
    autoshard compare  TARGET --mesh 2x4 --cluster 1x8-a100 [--check none] [--out plan.json]
    autoshard validate plan.json --cluster 2x8-a100 [--mesh 2x8] [--memory-budget 40GiB]
    autoshard export   plan.json --format flax-rules [--python] [--out rules.json]
    autoshard verify   plan.json | TARGET [--mesh 2x4 | --stages 2]     a pipeline: per stage executable
    autoshard advise   TARGET --cluster 2x8-a100 --out DIR           Accelerate / DeepSpeed / FSDP2 files
    autoshard check-config FILE [--world-size N]                     static check of such a file
    autoshard export   plan.json --format launch --out DIR           plan + run.sh for a cluster or here
    autoshard profile  [--out cluster.json] [--links PRESET]         time these devices: a ClusterSpec

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns a Workload: an object with ``step`` (the train step)
and ``args`` (its arguments, arrays or ``jax.ShapeDtypeStruct``s). Plans record
their target, so ``verify plan.json`` rebuilds the step. Flags are checked
before any work (``autoshard/arguments.py``) and are never abbreviated;
``--memory-budget`` takes a size with a unit (``40GiB``, ``512MiB``). Exit
status: 0 when all is well, 1 when ``validate``, ``verify`` or ``check-config``
finds a problem, 2 on an error.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from autoshard.cli_cluster import cmd_advise, cmd_check_config, cmd_profile
from autoshard.cli_io import (CliError, StrictParser, check_flags, check_writable, console, devices_needed,
                              ensure_devices, intra_op_options, memory_budget, origin, parse_mesh, positive,
                              positive_int, print_all, progress, write_or_fail)
from autoshard.targets import load_workload


# ----------------------------------------------------------------------------- commands


def cmd_trace(args: argparse.Namespace) -> int:
    with progress("trace") as say:
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
    planned = plan_graph(graph, mesh=parse_mesh(args.mesh), cluster=args.cluster, memory_budget=memory_budget(args),
                         num_devices=getattr(args, "devices", None), options=intra_op_options(args), timings=timings,
                         name=name, progress=say)
    return replace(planned, plan=replace(planned.plan, origin=origin(args))), step, step_args


def _plan_pipeline_target(args: argparse.Namespace, say: Callable[[str], None]) -> Any:
    """Plan a TARGET as a pipeline of ``--stages`` stages; returns (plan with its origin, step, abstract args)."""
    from dataclasses import replace

    from autoshard.api import plan as plan_fn

    say(f"loading {args.target}")
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    plan = plan_fn(step, *step_args, cluster=args.cluster, memory_budget=memory_budget(args),
                   num_stages=args.stages, num_microbatches=args.microbatches, options=intra_op_options(args),
                   progress=say)
    return replace(plan, origin=origin(args), name=name), step, step_args


def cmd_plan(args: argparse.Namespace) -> int:
    check_writable(args.out, "--out")
    with progress("plan") as say:
        if args.stages:
            plan, _step, _args = _plan_pipeline_target(args, say)
        else:
            plan = _plan_target(args, say)[0].plan
    from autoshard.report import ledger_table, parameter_table

    print_all(ledger_table(plan), parameter_table(plan))
    if args.stages:
        console.print(escape(str(plan.pipeline)))
        for stage in plan.stages:
            console.print(escape(str(stage)))
    if args.out:
        write_or_fail(args.out, lambda: plan.save(args.out), "--out")
        console.print(f"plan written to {args.out}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.figures import write_png
    from autoshard.html_report import write_html
    from autoshard.report import explain_renderables, legend_table

    if args.legend:
        print_all(legend_table())
        if not args.plan:
            return 0
    if not args.plan:
        raise CliError("explain needs a plan file (or --legend alone for the notation and terms)")
    check_writable(args.html, "--html")
    check_writable(args.png, "--png")
    plan = load_plan(args.plan)
    if args.op is not None and not 0 <= args.op < plan.num_ops:
        raise CliError(f"--op {args.op} is out of range: the plan has ops 0..{plan.num_ops - 1}")
    renderables = explain_renderables(plan, args.op)
    print_all(*renderables)
    if args.html:
        write_or_fail(args.html, lambda: write_html(plan, args.html, renderables), "--html")
        console.print(f"report written to {args.html}")
    if args.png:
        write_or_fail(args.png, lambda: write_png(plan, args.png), "--png")
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
    check_writable(args.out, "--out")
    with progress("compare") as say:
        say(f"loading {args.target}")
        step, step_args, name = load_workload(args.target, args.config, abstract=True)
        from autoshard.compiler.baselines import compare

        result = compare(step, step_args, parse_mesh(args.mesh), args.cluster,
                         memory_budget=memory_budget(args), options=intra_op_options(args), baselines=kinds,
                         progress=lambda line: say(f"{name}: {line}"),
                         check=None if args.check == "none" else args.check)
    from autoshard.report import comparison_table

    print_all(comparison_table(result))
    if result.arbitration is not None:
        from autoshard.report import arbitration_table

        print_all(arbitration_table(result.autoshard.plan))
    console.print(f"compared in {result.seconds:.1f}s")
    if args.out:
        plan = replace(result.autoshard.plan, origin=origin(args),
                       baselines=result.summary_dict())
        write_or_fail(args.out, lambda: plan.save(args.out), "--out")
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
    findings = validate_plan(plan, cluster=cluster, mesh_shape=parse_mesh(args.mesh),
                             memory_budget_bytes=memory_budget(args),
                             file_versions=read_header(args.plan))
    print_all(findings_table(findings))
    failed = [f for f in findings if f.failed]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed[/bold red]: " + "; ".join(f.check for f in failed))
        return 1
    console.print("[green]the plan passes every check[/green]")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from autoshard.plans.export import dumps, flax_rules, flax_rules_python
    from autoshard.plans.plan import load_plan

    if args.format == "launch":
        from autoshard.bundle import write_bundle

        if not args.out:
            raise CliError("--format launch needs --out DIR (the bundle folder)")
        written = write_bundle(load_plan(args.plan), args.out)
        console.print(f"launch bundle written to {args.out}: {', '.join(p.name for p in written)}; run "
                      f"{Path(args.out) / 'run.sh'} --local-processes 2 here, or see its README for a cluster")
        return 0
    if args.format != "flax-rules":
        raise CliError(f"unknown --format {args.format!r}; known: flax-rules, launch")
    check_writable(args.out, "--out")
    data = flax_rules(load_plan(args.plan))
    text = flax_rules_python(data) if args.python else dumps(data)
    if args.out:
        write_or_fail(args.out, lambda: Path(args.out).write_text(text), "--out")
        console.print(f"{len(data['params'])} parameter specs and {len(data['rules'])} logical rules written to "
                      f"{args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with progress("verify") as say:
        if args.target.endswith(".json"):
            from autoshard.plans.plan import load_plan


            plan = load_plan(args.target)
            if "target" not in plan.origin:
                raise CliError(f"{args.target} does not record the step it was made from (no origin target); run "
                               "`autoshard verify TARGET` instead")
            say(f"loading {plan.origin['target']}")
            step, step_args, _name = load_workload(plan.origin["target"], plan.origin.get("config", "small"),
                                                   abstract=True)
        elif getattr(args, "stages", None):
            plan, step, step_args = _plan_pipeline_target(args, say)
        else:
            planned, step, step_args = _plan_target(args, say)
            plan = planned.plan
        say("compiling")
        start = time.perf_counter()
        priced = None
        if plan.stages and plan.pipeline is not None:  # one executable per stage and action
            import jax

            from autoshard.compiler.verify_pipeline import compiled_pipeline_price, verify_pipeline

            from autoshard.runtime.run import run

            compiled = run(plan, step, jax.devices()).lower(*step_args).compile()
            report: Any = verify_pipeline(plan, compiled)
            priced = compiled_pipeline_price(plan, compiled)
        else:
            from autoshard.compiler.verify import verify_compiled
            from autoshard.runtime.run import run
            from autoshard.runtime.spmd import make_jax_mesh

            mesh = make_jax_mesh(tuple(plan.mesh_shape), plan.axis_names)
            report = verify_compiled(plan, run(plan, step, mesh).lower(*step_args).compile())
        compile_s = time.perf_counter() - start
    from autoshard.report import fidelity_lines, fidelity_table

    print_all(fidelity_table(report, f"plan '{plan.name}' predicted vs compiled",
                          f"mesh {'x'.join(map(str, plan.mesh_shape))} of {plan.cluster.name}, XLA:CPU on simulated "
                          f"devices, compiled in {compile_s:.1f}s"))
    if plan.stages:
        from autoshard.report import stage_cut

        console.print(escape(stage_cut(plan)), highlight=False)
    if priced is not None:  # the step priced from the stage executables, against the plan's
        console.print(escape(str(priced)), highlight=False)
    for note in getattr(report, "notes", ()):
        console.print(note)
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
    _budget_flag(p, "per-device budget with a unit, e.g. 40GiB or 512MiB (default: device memory)")
    p.add_argument("--time-limit", type=positive, default=None,
                   help="ILP time limit in seconds per solve (default 10; the solve returns when it is proven)")
    p.add_argument("--while-trip-count", type=positive_int, default=None,
                   help="iterations to price a while loop at when its trip count cannot be derived (default: a guess)")
    p.add_argument("--verbose", action="store_true",
                   help="also print the details of long phases (each layer class priced, each solve)")


def _budget_flag(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument("--memory-budget", default=None, metavar="SIZE", help=text)
    # the flag it replaces, refused with what to type instead (cli_io.check_flags)
    p.add_argument("--memory-budget-gib", default=None, help=argparse.SUPPRESS)


def _pipeline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=positive_int, default=None,
                   help="plan TARGET as a pipeline of this many stages (its loss marked with autoshard.value_and_grad)")
    p.add_argument("--microbatches", type=positive_int, default=None, help="pipeline microbatches (default: searched)")


def build_parser() -> argparse.ArgumentParser:
    parser = StrictParser(prog="autoshard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=StrictParser)
    p = sub.add_parser("trace", help="trace a workload's train step and print the graph summary")
    p.add_argument("target")
    p.add_argument("--config", default="small")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("plan", help="plan a workload on a mesh and cluster")
    p.add_argument("target", help="MODULE:FUNCTION, a module or a .py file with workload()")
    _planning_flags(p, mesh_help="logical mesh shape, e.g. 2x4 (default: searched)")
    p.add_argument("--devices", type=positive_int, default=None, help="device count when --mesh is not given")
    _pipeline_flags(p)
    p.add_argument("--out", help="write the plan file here")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("explain", help="a plan's specs, ledger and, for --op N, why that op's strategy")
    p.add_argument("plan", nargs="?", help="plan file")
    p.add_argument("--legend", action="store_true", help="print the notation and terms of the reports (R, S(x,y), "
                   "partial sum, layout copy, gap, ...)")
    p.add_argument("--op", type=int, default=None, help="op index: its strategy against the alternatives")
    p.add_argument("--html", help="write an HTML report (tables and pictures)")
    p.add_argument("--png", help="write the pictures (memory per device, pipeline schedule) as PNG")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("compare", help="autoshard vs DP, FSDP, ZeRO-2, HSDP, Megatron TP and DP x TP")
    p.add_argument("target")
    _planning_flags(p)
    p.add_argument("--baselines", help="comma list (default: all): dp,fsdp,zero2,hsdp,megatron-tp,dp-tp")
    p.add_argument("--check", choices=("compiled", "none"), default="compiled",
                   help="compiled (default): compile autoshard's plan, its next-best plans and every classic plan and "
                        "keep the fastest compiled program; none: the cost model alone decides")
    p.add_argument("--out", help="write autoshard's plan, with the comparison, here")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("validate", help="static checks of a plan file; non-zero exit on failure")
    p.add_argument("plan", help="plan file")
    p.add_argument("--cluster", default=None, help="the cluster it will run on (preset or file)")
    p.add_argument("--mesh", help="the mesh shape it will run on: must be the plan's (default: the plan's)")
    _budget_flag(p, "per-device budget with a unit, e.g. 40GiB (default: the cluster's)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("export", help="a plan's parameter layouts as Flax rules / PartitionSpecs, or a launch "
                                      "bundle (plan, run.sh, README)")
    p.add_argument("plan", help="plan file")
    p.add_argument("--format", default="flax-rules", choices=("flax-rules", "launch"),
                   help="flax-rules (autoshard.plans.export) or launch (autoshard.bundle)")
    p.add_argument("--python", action="store_true", help="write an importable Python module instead of JSON")
    p.add_argument("--out", help="file to write (default: stdout); the bundle folder for --format launch")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("verify", help="compile a plan on simulated devices: predicted vs compiled")
    p.add_argument("target", help="plan file (made by `plan` or `compare`) or a TARGET to plan first")
    _planning_flags(p)
    _pipeline_flags(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("profile", help="time the devices present and write the ClusterSpec they make")
    p.add_argument("--out", help="write the ClusterSpec here (JSON; --cluster FILE reads it)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is kept)")
    p.add_argument("--links", metavar="PRESET", help="take the links from this preset (e.g. 1x8-h100) instead of "
                   "timing collectives; on one device, without it, the links are written as not measured")
    p.set_defaults(func=cmd_profile)
    p = sub.add_parser("advise", help="the nearest classic strategy that fits, as Accelerate / DeepSpeed / FSDP2 "
                                      "files, with autoshard's margin over it")
    p.add_argument("target")
    _planning_flags(p, mesh_help="logical mesh (default: nodes x GPUs per node; searched on one node)")
    p.set_defaults(cluster=None)
    p.add_argument("--global-batch", type=int, default=None, help="global batch to configure (default: the step's)")
    p.add_argument("--fsdp-version", type=int, choices=(1, 2), default=2, help="Accelerate FSDP version (default 2)")
    p.add_argument("--out", required=True, help="directory for accelerate_config.yaml, deepspeed.json, fsdp2.py, ...")
    p.set_defaults(func=cmd_advise)

    p = sub.add_parser("check-config", help="static check of Accelerate / DeepSpeed config files; exit 1 on an error")
    p.add_argument("files", nargs="+", help="YAML or JSON config files")
    p.add_argument("--world-size", type=int, default=None, help="total processes, for the batch arithmetic")
    p.add_argument("--devices-per-node", type=int, default=None, help="GPUs per machine, for num_processes")
    p.set_defaults(func=cmd_check_config)

    from autoshard.runtime.launch import add_launch_parser

    add_launch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from autoshard.errors import PlanningError
    from autoshard.meshes.cluster import ClusterSpecError

    try:
        if args.command == "advise" and not args.cluster:
            raise CliError("advise needs --cluster (a preset such as 2x8-a100, or a ClusterSpec file)")
        check_flags(args)  # every flag, before any module is loaded or traced
        if getattr(args, "verbose", False):  # the details the library logs (library code never prints)
            import logging

            logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
        ensure_devices(devices_needed(args))
        from autoshard.ir.trips import trip_count_option

        with trip_count_option(getattr(args, "while_trip_count", None)):
            return int(args.func(args) or 0)
    except (CliError, PlanningError, ClusterSpecError) as err:
        from autoshard.errors import InfeasibleMemoryError

        text = err.naming("--memory-budget") if isinstance(err, InfeasibleMemoryError) else str(err)
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {escape(text)}", highlight=False)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
