"""The commands about the cluster rather than one plan: ``profile`` (time the devices present), ``advise``
(the nearest classic strategy as Accelerate / DeepSpeed / FSDP2 files) and ``check-config``."""
from __future__ import annotations

import argparse
from pathlib import Path

from autoshard.cli_io import (CliError, check_writable, console, intra_op_options, memory_budget, origin,
                              parse_mesh, print_all, progress)
from autoshard.meshes.cluster import LinkLevel
from autoshard.targets import load_workload


def cmd_profile(args: argparse.Namespace) -> int:
    """Time the devices present; write the ClusterSpec they make (``--cluster FILE`` reads it)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from autoshard.runtime.profile import ProfileOptions, profile_devices

    out = Path(args.out) if args.out else None
    check_writable(args.out, "--out")
    if args.repeats < 1:
        raise CliError(f"--repeats must be at least 1, got {args.repeats}")
    options = ProfileOptions(repeats=args.repeats, links=args.links)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("profiling", total=1.0)
        profiled = profile_devices(options, lambda what, done: bar.update(task, completed=done,
                                                                          description=f"profiling: {what}"))
    for line in profiled.lines():
        console.print(line, highlight=False)
    spec = profiled.spec

    def link(level: LinkLevel) -> str:
        if level.unmeasured:
            return "not measured"
        return f"{level.bandwidth_bytes_per_s / 1e9:.3g} GB/s, {level.latency_s * 1e6:.3g} us"

    console.print(f"profiled {spec.num_devices} device(s) in {profiled.seconds:.1f} s: intra-node "
                  f"{link(spec.intra_node)}; inter-node {link(spec.inter_node)}", highlight=False)
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
    mesh = parse_mesh(args.mesh) or ((cluster.num_nodes, cluster.devices_per_node) if cluster.num_nodes > 1 else None)
    step, step_args, name = load_workload(args.target, args.config, abstract=True)
    with progress(f"comparing {name} on {cluster.name}") as say:
        result = compare(step, step_args, mesh, args.cluster, memory_budget=memory_budget(args),
                         options=intra_op_options(args),
                         progress=say, num_devices=cluster.num_devices, check=None)
    advice = advise(result, global_batch=args.global_batch, fsdp_version=args.fsdp_version, source=name)
    plan = replace(result.autoshard.plan, origin=origin(args), baselines=result.summary_dict())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"accelerate_config.yaml": accelerate_yaml(advice.setup), "deepspeed.json": deepspeed_json(advice.setup),
             "fsdp2.py": fsdp2_snippet(advice.setup), "summary.md": advice_markdown(advice, plan)}
    for file_name, text in files.items():
        (out / file_name).write_text(text)
    plan.save(out / "plan.json")
    print_all(advice_table(advice), caveats_table(plan))
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
