"""Planning time with pipeline stages searched: what ``autoshard.plan(step, ..., num_stages=None)`` costs.

GPT-large (24 layers) and GPT-XL at batch 8 (32 layers) on two 8-A100 nodes (``2x8-a100``, 16 devices), each
an AdamW step whose gradients come from ``autoshard.value_and_grad``, planned by the pipeline driver with the
planner's defaults (its 10 s solver limit, no compiled arbitration), as ``autoshard.plan`` and
``@autoshard`` plan it: every distinct layer solved on every candidate sub-mesh, the stage DP, then the SPMD
plan on every logical mesh of the 16 devices, cut off once its bound proves it slower than the stages.
Shapes only: nothing is allocated or compiled. Wall and CPU seconds (this process, all threads) and the
machine's 1-minute load before and after.

    python -m benchmarks.stage_search_time [--cases large xl@8]
"""
from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from autoshard.compiler.pipeline_context import PipelineRequest
from autoshard.compiler.pipeline_driver import plan_pipeline
from autoshard.errors import PlanningError
from autoshard.passes.intra_op import IntraOpOptions
from autoshard.plans.ledger import fmt_s
from benchmarks.pipeline_vs_spmd import marked_step
from examples import gpt
from examples.common import Workload

CLUSTER = "2x8-a100"
NUM_DEVICES = 16
# (case, planning-seconds limit): the planning-time issue's targets
CASES: tuple[tuple[str, float], ...] = (("large", 30.0), ("xl@8", 90.0))


@dataclass(frozen=True)
class StageSearchPoint:
    case: str  # a gpt config, "@batch" when the batch is not the config's
    cluster: str
    layers: int
    wall_s: float
    cpu_s: float
    load: tuple[float, float]  # 1-minute load average before and after
    answer: str  # what the search returned
    passes: Mapping[str, float] = field(default_factory=dict)  # wall seconds: trace, pricing, stage-dp, spmd
    error: str | None = None


def _workload(case: str) -> Workload:
    config, _, batch = case.partition("@")
    return gpt.workload(config, abstract=True, batch_size=int(batch) if batch else None)


def measure(case: str, cluster: str = CLUSTER, num_devices: int = NUM_DEVICES,
            options: IntraOpOptions | None = None) -> StageSearchPoint:
    """Plan ``case`` with stages searched and time it."""
    work = _workload(case)
    load_before = os.getloadavg()[0]
    start, cpu = time.perf_counter(), time.process_time()
    try:
        found = plan_pipeline(marked_step(work), work.args,
                              PipelineRequest(cluster=cluster, num_devices=num_devices, options=options))
    except PlanningError as err:
        return StageSearchPoint(case, cluster, work.config.num_layers, time.perf_counter() - start,
                                time.process_time() - cpu, (load_before, os.getloadavg()[0]), "—",
                                error=f"{type(err).__name__}: {err}")
    wall, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    plan = found.chosen.plan
    if plan.pipeline is not None:
        answer = f"pipeline, {len(plan.stages)} stages, {fmt_s(plan.step_s)}"
    else:
        answer = f"SPMD {'x'.join(map(str, plan.mesh_shape))}, {fmt_s(plan.step_s)}"
    passes = {k: float(v) for k, v in plan.planning_s.items()}
    return StageSearchPoint(case, cluster, work.config.num_layers, wall, cpu_s, (load_before, os.getloadavg()[0]),
                            answer, passes)


def run(cases: Sequence[str] = tuple(c for c, _ in CASES),
        progress: Callable[[str], None] | None = None) -> list[StageSearchPoint]:
    say = progress or (lambda _msg: None)
    points = []
    for case in cases:
        say(f"{case} on {CLUSTER}: planning with stages searched")
        points.append(measure(case, options=IntraOpOptions()))
    return points


def markdown(points: Sequence[StageSearchPoint]) -> str:
    head = ("| case | layers | cluster | wall s | CPU s | load | by pass (wall s) | answer |\n"
            "|---|---:|---|---:|---:|---|---|---|")
    rows = []
    for p in points:
        passes = ", ".join(f"{k} {v:.1f}" for k, v in p.passes.items()) if p.passes else (p.error or "—")
        load = "—" if any(math.isnan(x) for x in p.load) else f"{p.load[0]:.1f} → {p.load[1]:.1f}"
        rows.append(f"| gpt-{p.case} | {p.layers} | {p.cluster} | {p.wall_s:.1f} | {p.cpu_s:.1f} | {load} | "
                    f"{passes} | {p.answer if not p.error else p.error} |")
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=[c for c, _ in CASES])
    args = parser.parse_args()
    print(markdown(run(args.cases, progress=print)))


if __name__ == "__main__":
    main()
