"""What a person reads: rich tables for plans, comparisons, checks and fidelity (pictures: ``figures.py``).

Tables are built from plain plan data (no solving, no compiling here), so
``autoshard explain plan.json`` works on any machine.
"""
from __future__ import annotations

import collections
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table
from rich.text import Text

from autoshard.ir.spec import Spec
from autoshard.plans.breakdown import dotted, layer_key
from autoshard.plans.ledger import Choice, fmt_bytes, fmt_s, solver_summary
from autoshard.plans.legend import LEGEND
from autoshard.plans.plan import Plan, state_note
from autoshard.plans.stage_plan import PipelineStage
from autoshard.plans.why import why_lines

KIND_COLORS = {"param": "#4c72b0", "grad": "#8172b3", "opt_state": "#dd8452", "batch": "#55a868",
               "activation": "#c44e52", "resharded": "#937860"}


# ----------------------------------------------------------------------------- plan tables


def ledger_table(plan: Plan) -> Table:
    led = plan.ledger
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    table = Table(title=f"plan '{plan.name}' on mesh ({mesh}) of {plan.cluster.name}", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    reached = (f" ({led.step_s / led.compute_lower_bound_s:,.1f}x the compute lower bound)"
               if led.compute_lower_bound_s > 0 else "")
    table.add_row("modeled step", fmt_s(led.step_s) + reached)
    table.add_row("  compute", fmt_s(led.compute_s))
    table.add_row("  collectives", fmt_s(led.comm_s))
    table.add_row("  resharding", fmt_s(led.reshard_s))
    table.add_row("  pipeline bubble", fmt_s(led.bubble_s))
    if led.compiled_step_s > 0:
        error = led.prediction_error or 0.0
        table.add_row("compiled step (XLA)", f"{fmt_s(led.compiled_step_s)} (compute {fmt_s(led.compiled_compute_s)} + "
                                             f"collectives {fmt_s(led.compiled_collectives_s)}); the model is "
                                             f"{abs(error):.1%} {'over' if error >= 0 else 'under'} it")
    table.add_row("compute lower bound", fmt_s(led.compute_lower_bound_s))
    fits = "fits" if plan.fits else "[red]OVER BUDGET[/red]"
    table.add_row("peak memory / device", f"{fmt_bytes(led.peak_memory_bytes)} of {fmt_bytes(plan.memory_budget_bytes)}"
                                          f" ({fits})")
    for kind, nbytes in led.memory_by_kind.items():
        table.add_row(f"  {kind}", fmt_bytes(nbytes))
    table.add_row("collectives / device", plan.collectives_summary())
    table.add_row("solver", solver_summary(plan.solver))
    table.add_row("planning", ", ".join(f"{k} {v:.2f}s" for k, v in plan.planning_s.items()))
    if plan.stages:
        table.add_row("pipeline", f"{len(plan.stages)} stages, {plan.num_microbatches} microbatches, {plan.schedule}")
    if plan.alternatives:
        table.add_row("meshes tried", ", ".join(f"{k}: {fmt_s(v)}" for k, v in plan.alternatives.items()))
    if plan.origin:
        table.add_row("made from", ", ".join(f"{k}={v}" for k, v in plan.origin.items()))
    for i, line in enumerate(why_lines(plan)):
        table.add_row("why this plan" if i == 0 else "", line)
    return table


_LAYER = re.compile(r"\[(\d+)\]|_(\d+)(?=['\]])")


def _layer_of(path: str) -> tuple[str, int | None]:
    """(path with the first layer number blanked, that number) for ``[0]['blocks'][3]['q']``-style paths."""
    inner = re.sub(r"^\[\d+\]", "", path)
    match = _LAYER.search(inner)
    if not match:
        return inner, None
    number = int(match.group(1) or match.group(2))
    start, end = match.span(1) if match.group(1) else match.span(2)
    return inner[:start] + "#" + inner[end:], number


def _ranges(numbers: Sequence[int]) -> str:
    numbers = sorted(numbers)
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def _pipeline_stages(plan: Plan) -> list[PipelineStage]:
    """The plan's pipeline stages that carry their own layouts (none for an SPMD plan)."""
    return [st for st in plan.stages if isinstance(st, PipelineStage)]


def _parameter_rows(plan: Plan) -> list[tuple[str, Spec, str, str, dict[str, int]]]:
    """(path, spec, optimizer-state note, stage, mesh sizes) per parameter: for a pipeline, as each stage
    keeps it on its own mesh (the layouts it runs with), else as the SPMD plan stores it."""
    if not _pipeline_stages(plan):
        state, sizes = plan.state_specs(), dict(zip(plan.axis_names, plan.mesh_shape))
        return [(path, spec, state_note(spec, state.get(path, {})), "", sizes)
                for path, spec in plan.param_specs().items()]
    rows = []
    for stage in _pipeline_stages(plan):
        state, sizes = stage.state_slots(), dict(zip(stage.axis_names, stage.mesh_shape))
        rows += [(path, spec, state_note(spec, state.get(path, {})), str(stage.index), sizes)
                 for path, spec in stage.param_specs.items()]
    return rows


def parameter_table(plan: Plan) -> Table:
    """Per-parameter specs and their optimizer state's; repeated layers with the same specs share one row. A
    pipeline's are each stage's, on the stage's mesh."""
    groups: dict[tuple[str, str, tuple[int, ...], str, str], list[tuple[int | None, Spec, dict[str, int]]]] = \
        collections.defaultdict(list)
    for path, spec, note, stage, sizes in _parameter_rows(plan):
        key, layer = _layer_of(path)
        shape = plan.input_shapes[path][0] if path in plan.input_shapes else ()
        groups[(key, stage, shape, str(spec), note)].append((layer, spec, sizes))
    staged = bool(_pipeline_stages(plan))
    table = Table(title="parameters by path" + (" and pipeline stage" if staged else ""),
                  caption="optimizer state: 'alike' when every slot of it (Adam's mu, nu, ...) has the parameter's "
                  "spec, else each slot's spec")
    columns = ("path", "layers") + (("stage",) if staged else ()) + ("shape", "spec", "per device",
                                                                          "optimizer state")
    for col in columns:
        table.add_column(col, overflow="fold")
    for (key, stage, shape, spec_text, note), members in sorted(groups.items()):
        _, spec, sizes = members[0]
        local = str(list(spec.shard_shape(shape, sizes))) if shape else ""
        numbered = [n for n, _, _ in members if n is not None]
        cells = [dotted(key), _ranges(numbered)] + ([stage] if staged else []) + [
            str(list(shape)) if shape else "", spec_text, local, note]
        table.add_row(*cells)
    return table


def stage_cut(plan: Plan) -> str:
    """The chosen stage cut of a pipeline plan in one line: each stage's layers, devices and mesh."""
    parts = []
    for st in _pipeline_stages(plan):
        devices = st.device_indices
        span = (f"{devices[0]}..{devices[-1]}" if devices == tuple(range(devices[0], devices[-1] + 1))
                else ",".join(map(str, devices)))
        parts.append(f"stage {st.index} layers {st.first_layer}-{st.last_layer} on devices {span} (mesh "
                     f"{'x'.join(map(str, st.mesh_shape))})")
    return (f"stage cut: {'; '.join(parts)}; {plan.num_microbatches} microbatches, {plan.schedule}"
            if parts else "")


def legend_table() -> Table:
    """The notation and terms of the reports (``plans/legend.py``)."""
    table = Table(title="legend: the notation and terms of this report", show_header=False)
    table.add_column("term", style="bold", no_wrap=True)
    table.add_column("meaning")
    for term, meaning in LEGEND:
        table.add_row(term, meaning)
    return table


def _state_leaves(plan: Plan) -> list[tuple[str, Spec, str, dict[str, int]]]:
    """(path, spec, "param" | "opt_state", mesh sizes) of every parameter and optimizer-state leaf: for a
    pipeline, as each stage keeps it on its own mesh."""
    if not _pipeline_stages(plan):
        sizes = dict(zip(plan.axis_names, plan.mesh_shape))
        return [(path, spec, plan.input_roles[path], sizes) for path, spec in plan.input_specs.items()
                if plan.input_roles.get(path) in ("param", "opt_state")]
    out = []
    for stage in _pipeline_stages(plan):
        sizes = dict(zip(stage.axis_names, stage.mesh_shape))
        out += [(path, spec, "param", sizes) for path, spec in stage.param_specs.items()]
        out += [(path, spec, "opt_state", sizes) for path, spec in stage.state_specs.items()
                if path not in stage.param_specs]
    return out


def layer_table(plan: Plan) -> Table:
    """Per layer: how many parameters are split, and the bytes per device of its parameters and their state."""
    rows: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])
    for path, spec, role, sizes in _state_leaves(plan):
        if path not in plan.input_shapes:
            continue
        layer = layer_key(path)
        shape, dtype = plan.input_shapes[path]
        nbytes = math.prod(shape) * _itemsize(dtype) / spec.num_shards(sizes)
        row = rows[layer]
        if role == "param":
            row[0] += 1
            row[1] += 0 if spec.is_replicated else 1
            row[2] += nbytes
        else:
            row[3] += nbytes
    table = Table(title="per layer")
    for col in ("layer", "parameters", "split", "params / device", "opt state / device"):
        table.add_column(col, justify="left" if col == "layer" else "right")
    for layer, (count, split, pbytes, obytes) in sorted(rows.items(), key=lambda kv: _natural(kv[0])):
        table.add_row(dotted(layer), str(int(count)), str(int(split)), fmt_bytes(pbytes), fmt_bytes(obytes))
    return table


def _natural(text: str) -> list[Any]:
    """Sort key that orders embedded numbers by value: blocks.2 before blocks.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _itemsize(dtype: str) -> int:
    import numpy as np

    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 4


def op_table(plan: Plan, op: int) -> Table | Text:
    """The strategy op ``op`` got and its alternatives, each priced as its share of the objective (``Choice``)."""
    if not 0 <= op < plan.num_ops:
        return Text(f"op {op} is out of range: the plan has ops 0..{plan.num_ops - 1}", style="red")
    ex = plan.explanations.get(op)
    if ex is None:
        specs = plan.op_out_specs.get(op, ())
        return Text(f"op {op} has no recorded alternatives: it had a single strategy, or it is an elementwise or "
                    f"view op that follows its producer without communicating. Its output layout: "
                    f"{', '.join(map(str, specs)) or '?'}. Ops with recorded choices: "
                    f"{_ranges(sorted(plan.explanations))[:200]}")
    table = Table(title=f"op {op}: {ex.primitive} {ex.shapes}" + (f"  ({ex.source})" if ex.source else "")
                  + f"; {ex.num_strategies} strategies, cheapest {len(ex.alternatives)} others shown"
                  + (f"\n{ex.loop}" if ex.loop else ""),
                  caption="the op's share of the modeled step, the rest of the plan fixed: its compute and "
                          "collectives and the resharding charged to it; an alternative adds the change it makes to "
                          "its consumers' resharding (negative: it spares them one), so 'vs chosen' is the change of "
                          "the step. A cheaper alternative loses because the op is tied to others (repeated layer, "
                          "elementwise chain) or to stay within memory.")
    for col in ("", "strategy", "compute", "collectives", "resharding", "total", "vs chosen"):
        table.add_column(col, justify="left" if col in ("", "strategy") else "right")

    def row(mark: str, c: Choice, style: str = "") -> None:
        delta = c.total_s - ex.chosen.total_s
        table.add_row(mark, c.strategy, fmt_s(c.compute_s), fmt_s(c.comm_s), fmt_s(c.reshard_s), fmt_s(c.total_s),
                      "" if mark else ("+" if delta >= 0 else "-") + fmt_s(abs(delta)), style=style)

    row("chosen", ex.chosen, "bold green")
    for c in ex.alternatives:
        row("", c)
    return table


def caveats_table(plan: Plan) -> Table:
    """What the plan does not know (``plans/caveats.py``), one section a row."""
    caveats = plan.caveats
    caption = (f"safer choice: {caveats.safer_choice}, the classic plan" if caveats.safer_choice else "")
    table = Table(title=f"what plan '{plan.name}' does not know", show_header=False, show_lines=True, caption=caption)
    table.add_column("", style="bold", no_wrap=True)
    table.add_column("")
    for title, items in caveats.sections():
        table.add_row(title, "\n".join(items))
    return table


def explain_renderables(plan: Plan, op: int | None = None) -> list[Any]:
    items: list[Any] = [ledger_table(plan), caveats_table(plan), parameter_table(plan), layer_table(plan)]
    if plan.baselines:
        items.append(baseline_summary_table(plan))
    if plan.arbitration:
        items.append(arbitration_table(plan))
    if op is not None:
        items.append(op_table(plan, op))
    items.append(legend_table())
    return items


# ----------------------------------------------------------------------------- comparisons


def _comparison_rows(rows: Sequence[Mapping[str, Any]], title: str, note: str) -> Table:
    table = Table(title=title, caption=note)
    compiled = any(r.get("compiled_step_s") for r in rows)
    cols = ("strategy", "modeled step", *(("compiled step (XLA)", "compiled speedup") if compiled else ()),
            "peak memory / device", "fits", "batch ceiling", "autoshard speedup")
    for col in cols:
        table.add_column(col, justify="left" if col == "strategy" else "right")
    mine = next((r.get("compiled_step_s") for r in rows if r["name"] == "autoshard"), None)
    for r in rows:
        ceiling, theirs = r["batch_ceiling"], r.get("compiled_step_s")
        priced = ((fmt_s(theirs) if theirs else "—",
                   f"{theirs / mine:.2f}x" if theirs and mine and r["name"] != "autoshard" else "")
                  if compiled else ())
        table.add_row(
            r["name"], fmt_s(r["step_s"]), *priced, fmt_bytes(r["peak_memory_bytes"]),
            "yes" if r["fits"] else "[red]no[/red]",
            "unbounded" if ceiling is None else f"{ceiling:,}",
            "" if r["name"] == "autoshard" else f"{r['speedup']:.2f}x",
            style="bold" if r["name"] == "autoshard" else "",
        )
    return table


def arbitration_table(plan: Plan) -> Table:
    """The plans compiled to choose this one (``check="compiled"``): modeled against compiled step."""
    table = Table(title="compiled arbitration: the fastest compiled program that fits is returned",
                  caption=plan.checks.get("compiled arbitration", ""))
    for col in ("candidate", "modeled step", "compiled step (XLA)", "model error", "fits", "returned"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for name, r in plan.arbitration.items():
        compiled = r.get("compiled_s")
        error = f"{(r['modeled_s'] - compiled) / compiled:+.1%}" if compiled else "—"
        table.add_row(name, fmt_s(r["modeled_s"]), fmt_s(compiled) if compiled else "did not compile", error,
                      "yes" if r.get("fits", 1.0) else "[red]no[/red]", "yes" if r.get("chosen") else "",
                      style="bold" if r.get("chosen") else "")
    return table


def comparison_table(comparison: Any) -> Table:  # comparison: autoshard.compiler.baselines.Comparison
    rows = [{"name": name, **figures} for name, figures in comparison.summary_dict().items()]
    plan = comparison.autoshard.plan
    mesh = "x".join(map(str, plan.mesh_shape))
    best, fallback = comparison.best_baseline, comparison.fallback
    note = [f"global batch {comparison.batch_size}; budget {fmt_bytes(comparison.memory_budget_bytes)}/device; "
            f"Megatron kernels: {comparison.megatron}"]
    if best is not None:
        note.append(f"best classic: {best.name} ({comparison.speedup(best):.2f}x slower than autoshard)")
    note.append(f"fallback (best classic that fits): {fallback.name}" if fallback else "no classic plan fits")
    return _comparison_rows(rows, f"autoshard vs classic strategies on mesh {mesh} of {plan.cluster.name}",
                            "\n".join(note))


def baseline_summary_table(plan: Plan) -> Table:
    """The comparison a plan file records (``autoshard compare --out``)."""
    rows = [{"name": name, **figures} for name, figures in plan.baselines.items()]
    fallback = plan.best_baseline(fitting=True)
    note = (f"best classic: {plan.best_baseline()}; fallback (best classic that fits): "
            f"{fallback or 'no classic plan fits'}")
    return _comparison_rows(rows, "compared with", note)


def margin_text(speedup: float) -> str:
    """autoshard's modeled margin over a classic plan: "1.52x faster" or "1.16x slower"."""
    return f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"


def advice_table(advice: Any) -> Table:  # advice: autoshard.compiler.advise.Advice
    setup = advice.setup
    caption = [f"advice: {advice.chosen} ({setup.strategy}); autoshard's own plan models "
               f"{margin_text(advice.autoshard_speedup)} than it",
               f"{setup.num_machines} machine(s) x {setup.processes_per_machine} GPUs, tensor parallel "
               f"{setup.tensor_parallel}, data parallel {setup.data_parallel}: micro-batch {setup.micro_batch_per_gpu}"
               f" per GPU x accumulation {setup.gradient_accumulation} = global batch {setup.train_batch_size}",
               *advice.notes]
    table = Table(title="classic strategies under the cost model (modeled, at the traced batch "
                        f"{advice.traced_batch})", caption="\n".join(caption))
    for col in ("strategy", "modeled step", "peak memory / device", "fits", "batch ceiling", "where the time goes",
                "verdict"):
        table.add_column(col, justify="right" if col in ("modeled step", "peak memory / device", "batch ceiling")
                         else "left")
    for r in advice.rows:
        c = r.candidate
        table.add_row(c.name, fmt_s(c.step_s), fmt_bytes(c.peak_bytes), "yes" if c.fits else "[red]no[/red]",
                      "unbounded" if c.batch_ceiling is None else f"{c.batch_ceiling:,}", r.bound, r.verdict,
                      style="bold green" if c.name == advice.chosen else "bold" if c.name == "autoshard" else "")
    return table


def advice_markdown(advice: Any, plan: Plan) -> str:
    """``summary.md`` of ``autoshard advise``: the choice, the table, and what the plan does not know."""
    setup = advice.setup
    lines = [f"# autoshard advise: {advice.chosen}", "",
             f"For {setup.source}: run **{advice.chosen}** on {setup.num_machines} machine(s) x "
             f"{setup.processes_per_machine} GPUs (world {setup.world_size}, tensor parallel {setup.tensor_parallel}, "
             f"data parallel {setup.data_parallel}), micro-batch {setup.micro_batch_per_gpu} per GPU x gradient "
             f"accumulation {setup.gradient_accumulation} = global batch {setup.train_batch_size}. autoshard's own "
             f"plan models **{margin_text(advice.autoshard_speedup)}** than it.", ""]
    lines += [f"- {note}" for note in advice.notes] + ([""] if advice.notes else [])
    lines += ["| strategy | modeled step | peak memory / device | fits | batch ceiling | where the time goes | "
              "verdict |", "|---|---:|---:|---|---:|---|---|"]
    for r in advice.rows:
        c = r.candidate
        ceiling = "unbounded" if c.batch_ceiling is None else f"{c.batch_ceiling:,}"
        lines.append(f"| {c.name} | {fmt_s(c.step_s)} | {fmt_bytes(c.peak_bytes)} | {'yes' if c.fits else 'no'} | "
                     f"{ceiling} | {r.bound} | {r.verdict} |")
    lines += ["", "Files: `accelerate_config.yaml` (accelerate launch --config_file), `deepspeed.json` (deepspeed "
              "--deepspeed_config, or deepspeed.initialize(config=...)), `fsdp2.py` (init_device_mesh + "
              "fully_shard / parallelize_module), `plan.json` (autoshard's plan with this comparison).", "",
              "## What the plan does not know", ""]
    for title, items in plan.caveats.sections():
        lines += [f"- **{title}**: " + "; ".join(items)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- checks


def findings_table(findings: Sequence[Any]) -> Table:  # findings: compiler.validate.Finding
    table = Table(title="validate", show_lines=True)
    for col in ("check", "result", "details", "what to change"):
        table.add_column(col)
    style = {"ok": "green", "warning": "yellow", "error": "bold red"}
    for f in findings:
        table.add_row(f.check, Text(f.severity.value, style=style[f.severity.value]), f.message, f.fix)
    return table


@dataclass(frozen=True)
class FidelityLine:
    what: str
    predicted: float
    compiled: float
    rel_error: float
    flagged: bool
    tolerance: str  # e.g. "15% or 1 MiB": the figure is ok within either


def fidelity_lines(report: Any) -> list[FidelityLine]:
    """Rows of a verify report, flagged when off by more than their tolerance, relative and absolute
    (``compiler/verify.py``: collectives 10%, peak memory 15%, FLOPs 5%, HBM bytes 20%, each or a few
    immaterial bytes)."""
    return [FidelityLine(r.what, r.predicted, r.compiled, r.rel_error, r.flagged,
                         (f"{r.tolerance:.0%}" + (f" or {fmt_bytes(r.immaterial_bytes)}" if r.immaterial_bytes else ""))
                         if getattr(r, "checked", True) else "not checked")
            for r in report.rows]


def _figure(what: str, value: float) -> str:
    return f"{value:.4g} FLOP" if "flops" in what else fmt_bytes(value)


def fidelity_table(report: Any, title: str, note: str = "") -> Table:
    table = Table(title=title, caption=(note + "; " if note else "") + "per device; flagged: off by more than its "
                                        "tolerance, both relative and absolute")
    for col in ("figure", "predicted", "compiled (XLA)", "error", "tolerance", ""):
        table.add_column(col, justify="left" if col in ("figure", "") else "right")
    for line in fidelity_lines(report):
        err = "inf" if math.isinf(line.rel_error) else f"{line.rel_error:.1%}"
        table.add_row(line.what.replace(" bytes", "") if "hbm" not in line.what else line.what,
                      _figure(line.what, line.predicted), _figure(line.what, line.compiled), err,
                      line.tolerance, Text("OFF", style="bold red") if line.flagged else
                      Text("estimate", style="yellow") if line.tolerance == "not checked" else Text("ok", style="green"))
    return table
