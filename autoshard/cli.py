"""The ``autoshard`` command line (argparse + rich).

    autoshard trace    TARGET [--config small]                       graph summary of a workload's train step
    autoshard plan     TARGET --mesh 2x4 --cluster 1x8-a100 [--out plan.json]
    autoshard explain  plan.json [--op N] [--html report.html | --png report.png]
    autoshard compare  TARGET --mesh 2x4 --cluster 1x8-a100 [--out plan.json]
    autoshard validate plan.json --cluster 2x8-a100 [--mesh 2x8] [--memory-budget-gib 40]
    autoshard export   plan.json --format flax-rules [--python] [--out rules.json]
    autoshard verify   plan.json | TARGET [--mesh 2x4]
    autoshard advise   TARGET --cluster 2x8-a100 --out DIR           Accelerate / DeepSpeed / FSDP2 files
    autoshard check-config FILE [--world-size N]                     static check of such a file
    autoshard export   plan.json --format launch --out DIR           plan + run.sh for a cluster or here

A TARGET is a Python file or module exposing ``workload(config, abstract=...)``
(as the bundled examples do), or ``MODULE:FUNCTION`` where the function takes
no arguments and returns an object with ``step`` and ``args``. Plans record
their target, so ``verify plan.json`` rebuilds the step. Exit status: 0 when
all is well, 1 when ``validate``, ``verify`` or ``check-config`` finds a problem, 2 on an error.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from autoshard.targets import load_workload

console = Console() if sys.stdout.isatty() else Console(width=150)  # pipes and logs get wide tables


def _parse_mesh(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        shape = tuple(int(s) for s in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise SystemExit(f"error: --mesh takes sizes like 2x4, got {text!r}") from None
    if any(s < 1 for s in shape):
        raise SystemExit(f"error: --mesh sizes must be positive, got {text!r}")
    return shape


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


def _prod(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _budget(args: argparse.Namespace) -> float | None:
    gib = getattr(args, "memory_budget_gib", None)
    return gib * 2**30 if gib else None


def _options(args: argparse.Namespace) -> Any:
    from autoshard.passes.intra_op import IntraOpOptions

    return IntraOpOptions(time_limit_s=args.time_limit) if getattr(args, "time_limit", None) else None


@contextlib.contextmanager
def _progress(what: str) -> Iterator[Callable[[str], None]]:
    """A spinner with elapsed time; the yielded function updates its text."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(what, total=None)
        yield lambda text: progress.update(task, description=f"{what}: {text}")


def _print(*renderables: Any) -> None:
    for r in renderables:
        console.print(r)


# ----------------------------------------------------------------------------- commands


def cmd_trace(args: argparse.Namespace) -> int:
    from autoshard.ir.trace import trace

    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    start = time.perf_counter()
    graph = trace(step, *step_args)
    seconds = time.perf_counter() - start
    console.print(f"[bold]{name}[/bold] traced in {seconds:.2f}s")
    console.print(graph.summary(), markup=False, highlight=False)
    return 0


def _plan_target(args: argparse.Namespace, say: Callable[[str], None]) -> Any:
    """Trace and plan a TARGET; returns the PlannedStep with the plan's origin recorded."""
    from dataclasses import replace

    from autoshard.compiler.driver import plan_graph
    from autoshard.ir.trace import trace

    say("loading")
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    say("tracing")
    start = time.perf_counter()
    graph = trace(step, *step_args)
    timings = {"trace": time.perf_counter() - start}
    say(f"solving ({len(graph.ops)} ops)")
    planned = plan_graph(graph, mesh=_parse_mesh(args.mesh), cluster=args.cluster, memory_budget=_budget(args),
                         num_devices=getattr(args, "devices", None), options=_options(args), timings=timings,
                         name=name)
    return replace(planned, plan=replace(planned.plan, origin=_origin(args))), step, step_args


def _origin(args: argparse.Namespace) -> dict[str, str]:
    """How to rebuild the step: a file target is recorded by absolute path, so `verify` works from anywhere."""
    module, _, func = args.target.partition(":")
    if Path(module).exists():
        module = str(Path(module).resolve())
    return {"target": module + (f":{func}" if func else ""), "config": args.config}


def cmd_plan(args: argparse.Namespace) -> int:
    from autoshard.report import ledger_table, parameter_table

    with _progress("planning") as say:
        planned, _step, _args = _plan_target(args, say)
    _print(ledger_table(planned.plan), parameter_table(planned.plan))
    if args.out:
        planned.plan.save(args.out)
        console.print(f"plan written to {args.out}")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.figures import write_png
    from autoshard.html_report import write_html
    from autoshard.report import explain_renderables

    plan = load_plan(args.plan)
    renderables = explain_renderables(plan, args.op)
    _print(*renderables)
    if args.html:
        write_html(plan, args.html, renderables)
        console.print(f"report written to {args.html}")
    if args.png:
        write_png(plan, args.png)
        console.print(f"picture written to {args.png}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from autoshard.compiler.baselines import ALL_BASELINES, Baseline, compare
    from autoshard.report import comparison_table

    kinds = ALL_BASELINES
    if args.baselines:
        try:
            kinds = tuple(Baseline(k.strip()) for k in args.baselines.split(","))
        except ValueError:
            raise SystemExit(f"error: --baselines takes a comma list of {', '.join(b.value for b in Baseline)}") \
                from None
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    with _progress(f"comparing {name}") as say:
        result = compare(step, step_args, _parse_mesh(args.mesh), args.cluster,
                         memory_budget=_budget(args), options=_options(args), baselines=kinds, progress=say)
    _print(comparison_table(result))
    console.print(f"compared in {result.seconds:.1f}s")
    if args.out:
        plan = replace(result.autoshard.plan, origin=_origin(args),
                       baselines=result.summary_dict())
        plan.save(args.out)
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

    if args.format == "launch":
        from autoshard.bundle import write_bundle

        if not args.out:
            raise SystemExit("error: --format launch needs --out DIR (the bundle folder)")
        written = write_bundle(load_plan(args.plan), args.out)
        console.print(f"launch bundle written to {args.out}: {', '.join(p.name for p in written)}; run "
                      f"{Path(args.out) / 'run.sh'} --local-processes 2 here, or see its README for a cluster")
        return 0
    if args.format != "flax-rules":
        raise SystemExit(f"error: unknown --format {args.format!r}; known: flax-rules, launch")
    data = flax_rules(load_plan(args.plan))
    text = flax_rules_python(data) if args.python else dumps(data)
    if args.out:
        Path(args.out).write_text(text)
        console.print(f"{len(data['params'])} parameter specs and {len(data['rules'])} logical rules written to "
                      f"{args.out}")
    else:
        sys.stdout.write(text + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.compiler.verify import verify_compiled
    from autoshard.runtime.spmd import make_jax_mesh
    from autoshard.report import fidelity_lines, fidelity_table

    with _progress("verifying") as say:
        if args.target.endswith(".json"):
            plan = load_plan(args.target)
            if "target" not in plan.origin:
                raise SystemExit(f"error: {args.target} does not record the step it was made from (no origin "
                                 "target); run `autoshard verify TARGET` instead")
            say("loading the step")
            step, step_args, _name = load_workload(plan.origin["target"], plan.origin.get("config", "small"),
                                                   abstract=True)
        else:
            planned, step, step_args = _plan_target(args, say)
            plan = planned.plan
        mesh = make_jax_mesh(tuple(plan.mesh_shape), plan.axis_names)
        say("compiling")
        start = time.perf_counter()
        compiled = plan.apply(step, mesh).lower(*step_args).compile()
        compile_s = time.perf_counter() - start
        report = verify_compiled(plan, compiled)
    _print(fidelity_table(report, f"plan '{plan.name}' predicted vs compiled",
                          f"mesh {'x'.join(map(str, plan.mesh_shape))} of {plan.cluster.name}, XLA:CPU on simulated "
                          f"devices, compiled in {compile_s:.1f}s"))
    flagged = [line.what for line in fidelity_lines(report) if line.flagged]
    if flagged:
        console.print(f"[bold red]{len(flagged)} figure(s) off by more than their tolerance[/bold red]: "
                      f"{', '.join(flagged)}")
        return 1
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Time the devices present; write the ClusterSpec they make (``--cluster FILE`` reads it)."""
    from rich.progress import BarColumn

    from autoshard.runtime.profile import ProfileOptions, profile_devices

    out = Path(args.out) if args.out else None
    if out is not None and not (out.parent if str(out.parent) else Path(".")).exists():
        console.print(f"[bold red]error:[/bold red] cannot write {out}: the folder {out.parent} does not exist")
        return 2
    options = ProfileOptions(repeats=args.repeats)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("profiling", total=1.0)
        profiled = profile_devices(options, lambda what, done: bar.update(task, completed=done,
                                                                          description=f"profiling: {what}"))
    for line in profiled.lines():
        console.print(line, highlight=False)
    spec = profiled.spec
    console.print(f"profiled {spec.num_devices} device(s) in {profiled.seconds:.1f} s: intra-node "
                  f"{spec.intra_node.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {spec.intra_node.latency_s * 1e6:.3g} us; "
                  f"inter-node {spec.inter_node.bandwidth_bytes_per_s / 1e9:.3g} GB/s", highlight=False)
    if out is not None:
        spec.save(out)
        console.print(f"wrote {out} (use it with --cluster {out})", highlight=False)
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from autoshard.compiler.advise import advise
    from autoshard.compiler.baselines import compare
    from autoshard.meshes.cluster import get_cluster
    from autoshard.plans.torch_configs import accelerate_yaml, deepspeed_json, fsdp2_snippet
    from autoshard.report import advice_markdown, advice_table, caveats_table

    cluster = get_cluster(args.cluster)
    mesh = _parse_mesh(args.mesh) or ((cluster.num_nodes, cluster.devices_per_node) if cluster.num_nodes > 1 else None)
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    with _progress(f"comparing {name} on {cluster.name}") as say:
        result = compare(step, step_args, mesh, args.cluster, memory_budget=_budget(args), options=_options(args),
                         progress=say, num_devices=cluster.num_devices)
    advice = advise(result, global_batch=args.global_batch, fsdp_version=args.fsdp_version, source=name)
    plan = replace(result.autoshard.plan, origin=_origin(args), baselines=result.summary_dict())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"accelerate_config.yaml": accelerate_yaml(advice.setup), "deepspeed.json": deepspeed_json(advice.setup),
             "fsdp2.py": fsdp2_snippet(advice.setup), "summary.md": advice_markdown(advice, plan)}
    for file_name, text in files.items():
        (out / file_name).write_text(text)
    plan.save(out / "plan.json")
    _print(advice_table(advice), caveats_table(plan))
    console.print(f"wrote {', '.join(files)} and plan.json to {out}")
    return _report_configs([out / "accelerate_config.yaml", out / "deepspeed.json"], world_size=None,
                           devices_per_node=advice.setup.processes_per_machine)


def _report_configs(paths: list[Path], *, world_size: int | None, devices_per_node: int | None) -> int:
    """Check config files, one line per finding; 1 when any has an error."""
    from autoshard.plans.check_config import check_config

    errors = 0
    for path in paths:
        for report in check_config(path, world_size=world_size, devices_per_node=devices_per_node):
            lines = [f"{report.path}: {finding}" for finding in report.findings]
            for line in lines or [f"{report.path}: ok ({report.kind} config)"]:
                console.print(line, markup=False, highlight=False, soft_wrap=True)
            errors += len(report.errors)
    if errors:
        console.print(f"[bold red]{errors} error(s)[/bold red]")
        return 1
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    return _report_configs([Path(f) for f in args.files], world_size=args.world_size,
                           devices_per_node=args.devices_per_node)


# ----------------------------------------------------------------------------- parser


def _planning_flags(p: argparse.ArgumentParser, *, mesh_help: str = "logical mesh shape, e.g. 2x4") -> None:
    p.add_argument("--config", default="small", help="workload config (default: small)")
    p.add_argument("--mesh", help=mesh_help)
    p.add_argument("--cluster", default=None, help="preset name or .json/.toml ClusterSpec file")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="per-device budget (default: device memory)")
    p.add_argument("--time-limit", type=float, default=None, help="ILP time limit in seconds per solve")


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
    p.add_argument("--devices", type=int, default=None, help="device count when --mesh is not given")
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
    p.add_argument("--mesh", help="the mesh shape it will run on (default: the plan's)")
    p.add_argument("--memory-budget-gib", type=float, default=None, help="per-device budget (default: the cluster's)")
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
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("profile", help="time the devices present and write the ClusterSpec they make")
    p.add_argument("--out", help="write the ClusterSpec here (JSON; --cluster FILE reads it)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (the median is kept)")
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
    _ensure_devices(_devices_needed(args))
    from autoshard.errors import PlanningError
    from autoshard.meshes.cluster import ClusterSpecError

    if args.command == "advise" and not args.cluster:
        raise SystemExit("error: advise needs --cluster (a preset such as 2x8-a100, or a ClusterSpec file)")
    try:
        return int(args.func(args) or 0)
    except (PlanningError, ClusterSpecError) as err:
        console.print(f"[bold red]error:[/bold red] {err}", highlight=False)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
