"""What each pipeline stage executable runs against what its stage plan predicted: the best pipeline of a
GPT cell (stages searched, kept even where the SPMD plan is faster), every stage executable compiled on
simulated devices and checked by ``compiler/verify_pipeline.py`` (per executable: the collective bytes by
kind, and each stage's peak memory).

    python -m benchmarks.pipeline_fidelity [--cells gpt:tiny:2x8-a100 ...] [--time-limit 10]
        [--out benchmarks/PIPELINE_FIDELITY.md]

A cell is ``model:config:cluster`` or ``model:config@batch:cluster`` (the config at another global batch, as
``benchmarks/run.py`` runs gpt-xl at 8): the two-node GPT and MoE cells of ``benchmarks/run.py``, at the configs
that compile here. Targets (issue
"Scanned stacks ... pipeline fidelity", item 4): collectives within 10%, peak memory within 15%, on every
figure checked. Figures a stage cannot check (an estimate: its backward on the jax.vjp path) are counted
apart. Exit status 1 when a checked figure is off.
"""
from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.devices import DEVICE_FLAG, simulate_devices

simulate_devices(16)

import jax  # noqa: E402
import optax  # noqa: E402

import autoshard  # noqa: E402
from autoshard.compiler.pipeline_context import PipelineRequest  # noqa: E402
from autoshard.compiler.pipeline_driver import plan_pipeline  # noqa: E402
from autoshard.compiler.verify_pipeline import compiled_pipeline_price, verify_pipeline  # noqa: E402
from autoshard.plans.ledger import fmt_s  # noqa: E402
from autoshard.passes.intra_op import IntraOpOptions  # noqa: E402
from autoshard.runtime.pipeline_lower import lower_pipeline  # noqa: E402
from benchmarks.machine import cells_main  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_CELLS = ("gpt:tiny:2x8-a100", "gpt:small:2x8-a100", "gpt:medium:2x8-a100", "moe:small:2x8-a100",
                 "moe_topk:small:2x8-a100")


@dataclass(frozen=True)
class StageFidelity:
    cell: str
    pipeline: str  # the stage plan, as the plan prints it
    plan_s: float  # planning wall seconds (stages searched, the SPMD plan beside)
    checked: int  # figures compared
    within: int  # of them, within tolerance
    unchecked: int  # estimates shown but not checked
    worst: str  # the checked figure furthest off, with its error
    report: str  # the whole table
    compiled_step_s: float = float("nan")  # the step priced from the compiled executables (verify_pipeline)
    modeled_step_s: float = float("nan")  # the plan's

    @property
    def ok(self) -> bool:
        return self.within == self.checked


def _marked_step(work: object) -> object:
    config = work.config  # type: ignore[attr-defined]
    tx = optax.adamw(config.learning_rate, weight_decay=config.weight_decay)

    def step(params, opt_state, batch):  # type: ignore[no-untyped-def]
        loss, grads = autoshard.value_and_grad(work.loss_fn)(params, batch)  # type: ignore[attr-defined]
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def measure(cell: str, time_limit_s: float) -> StageFidelity:
    model, config, cluster = cell.split(":")
    config, _, batch = config.partition("@")
    spec = autoshard.PRESETS[cluster]
    if spec.num_devices > len(jax.devices()):
        raise SystemExit(f"{cell} needs {spec.num_devices} devices; this process has {len(jax.devices())} "
                         f"(set XLA_FLAGS={DEVICE_FLAG}={spec.num_devices})")
    work = importlib.import_module(f"examples.{model}").workload(config, abstract=True,
                                                                  batch_size=int(batch) if batch else None)
    start = time.perf_counter()
    found = plan_pipeline(_marked_step(work), work.args, PipelineRequest(
        cluster=cluster, num_devices=spec.num_devices, options=IntraOpOptions(time_limit_s=time_limit_s),
        keep_both=True))
    plan_s = time.perf_counter() - start
    piped = found.pipeline
    if piped is None:
        raise RuntimeError(f"{cell}: no pipeline of two or more stages fits")
    runtime = piped.runtime(jax.devices()[:spec.num_devices])
    compiled = lower_pipeline(runtime).compile()
    report = verify_pipeline(piped.plan, compiled)
    price = compiled_pipeline_price(piped.plan, compiled)
    checked = [r for r in report.rows if r.checked]
    # off first, then the largest error among differences that are not immaterial (a few scalars)
    worst = max(checked, key=lambda r: (not r.ok, r.rel_error if abs(r.predicted - r.compiled) > r.immaterial_bytes
                                        else 0.0), default=None)
    worst_text = "-" if worst is None else f"{worst.what} {worst.rel_error:.1%}" + ("" if worst.ok else " (off)")
    return StageFidelity(cell, str(piped.stage_plan), plan_s, len(checked), sum(r.ok for r in checked),
                         len(report.rows) - len(checked), worst_text, f"{report}\n{price}", price.step_s,
                         price.modeled_step_s)


def markdown(rows: Sequence[StageFidelity], load: str, time_limit_s: float) -> str:
    lines = ["# Pipeline stage executables: predicted against compiled", "",
             "Command: `python -m benchmarks.pipeline_fidelity`. Per cell, the best pipeline of two or more "
             "stages (stages searched, kept even where SPMD is faster), every stage executable compiled on "
             f"simulated devices and checked by `compiler/verify_pipeline.py`. Solver limit {time_limit_s:g} s "
             f"(the layer solves use the pipeline's own shorter limit). Machine load while measuring: {load}.",
             "Tolerances: collectives 10% (or an immaterial absolute difference), peak memory 15%. The step "
             "is also priced from the compiled executables (`verify_pipeline.compiled_pipeline_price`: each one's "
             "FLOPs, bytes and HLO collectives on the cell's cluster, composed by the schedule; not checked).", "",
             "| cell | stages | plan s | checked figures within tolerance | unchecked | worst checked figure | "
             "step compiled / modeled |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        stages = r.pipeline.replace("|", "\\|")  # the stage plan separates its stages with bars
        lines.append(f"| {r.cell} | {stages} | {r.plan_s:.0f} | {r.within}/{r.checked} | {r.unchecked} | "
                     f"{r.worst} | {fmt_s(r.compiled_step_s)} / {fmt_s(r.modeled_step_s)} |")
    for r in rows:
        lines += ["", f"## {r.cell}", "", "```", r.report, "```"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    return cells_main(
        argv, description=__doc__.splitlines()[0], default_cells=DEFAULT_CELLS, cell_help="model:config:cluster",
        default_time_limit=10.0, measure=measure,
        say=lambda row: (f"{row.cell}: {row.within}/{row.checked} checked figures within tolerance; worst "
                         f"{row.worst} (planned in {row.plan_s:.0f} s)"),
        markdown=markdown)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
