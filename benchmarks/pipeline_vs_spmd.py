"""Pipeline vs SPMD vs the classic strategies under one cost model: GPT on two 8-A100 nodes and on one.

For each cluster, plans the same AdamW train step:

- the best pipeline of two or more stages (stage DP over layer ranges x sub-meshes x logical meshes x
  microbatches x recomputation; every stage's time and memory from the intra-op ILP on that stage's
  sub-mesh, ``passes/stage_costs.py``),
- the best SPMD-only plan (the intra-op ILP over every 2-axis logical mesh),
- with ``--classic``: every classic strategy (DP, FSDP/ZeRO-3, ZeRO-2, HSDP, Megatron TP, DP x TP on the
  nodes x GPUs mesh, ``compiler/baselines.py``) and uniform GPipe (equal stages, data parallel inside),

and prints the modeled step times, memory, whether each fits the 80 GiB budget, and the pipeline's speedup
over the best of the others that fits. Shapes only: nothing is allocated. Planning seconds are measured
(wall and CPU) for the pipeline plan with stages searched, the SPMD plan included.

    python benchmarks/pipeline_vs_spmd.py [--config large] [--clusters 2x8-a100] [--classic]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax  # noqa: E402

import autoshard  # noqa: E402
from autoshard.compiler.baselines import UNIFORM_GPIPE, compare as compare_classic, plan_uniform_gpipe  # noqa: E402
from autoshard.compiler.pipeline_context import PipelineRequest  # noqa: E402
from autoshard.compiler.pipeline_driver import plan_pipeline  # noqa: E402
from autoshard.passes.intra_op import IntraOpOptions  # noqa: E402
from examples import gpt  # noqa: E402


def marked_step(work):
    tx = optax.adamw(work.config.learning_rate, weight_decay=work.config.weight_decay)

    def step(params, opt_state, batch):
        loss, grads = autoshard.value_and_grad(work.loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def compare(config: str, cluster: str, time_limit_s: float = 5.0, classic: bool = False,
            batch_size: int | None = None) -> dict[str, object]:
    work = gpt.workload(config, abstract=True, batch_size=batch_size)
    spec = autoshard.PRESETS[cluster]
    options = IntraOpOptions(time_limit_s=time_limit_s)
    start, cpu = time.perf_counter(), time.process_time()
    found = plan_pipeline(marked_step(work), work.args, PipelineRequest(cluster=cluster, num_devices=spec.num_devices,
                                                                        options=options, keep_both=True))
    piped, spmd = found.pipeline, found.spmd
    assert piped is not None  # keep_both: the best pipeline is finished even when SPMD is faster
    seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu
    pipe_s = piped.plan.step_s
    spmd_s = spmd.plan.step_s if spmd is not None else float("inf")
    row: dict[str, object] = {
        "cluster": cluster, "config": config, "pipeline": piped.plan, "spmd": spmd, "pipeline_s": pipe_s,
        "pipeline_fits": piped.plan.fits, "spmd_s": spmd_s, "chosen": "pipeline" if pipe_s < spmd_s else "spmd",
        "planning_s": seconds, "planning_cpu_s": cpu_s, "others": {}}
    others: dict[str, tuple[float, float, bool]] = {}
    if spmd is not None:
        others["SPMD (autoshard)"] = (spmd_s, spmd.plan.ledger.peak_memory_bytes, spmd.plan.fits)
    if classic:
        mesh = (spec.num_nodes, spec.devices_per_node) if spec.num_nodes > 1 else (2, spec.devices_per_node // 2)
        result = compare_classic(work.step, work.args, mesh=mesh, cluster=cluster, options=options)
        for c in result.rows:
            others[c.name if c.name != "autoshard" else f"SPMD {mesh[0]}x{mesh[1]} (hinted)"] = (
                c.step_s, c.peak_bytes, c.fits)
        gpipe = plan_uniform_gpipe(marked_step(work), work.args, cluster=cluster, num_devices=spec.num_devices,
                                   options=options)
        others[UNIFORM_GPIPE] = (gpipe.step_s, gpipe.ledger.peak_memory_bytes, gpipe.fits)
    row["others"] = others
    fitting = [s for s, _, fits in others.values() if fits]
    row["best_other_s"] = min(fitting) if fitting else float("inf")
    row["speedup"] = row["best_other_s"] / pipe_s if pipe_s > 0 and piped.plan.fits else 0.0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="medium", choices=sorted(gpt.CONFIGS))
    parser.add_argument("--batch-size", type=int, default=None, help="override the config's global batch")
    parser.add_argument("--clusters", nargs="+", default=["2x8-a100", "1x8-a100"])
    parser.add_argument("--time-limit", type=float, default=5.0, help="ILP seconds per mesh shape")
    parser.add_argument("--classic", action="store_true", help="also plan every classic strategy and uniform GPipe")
    args = parser.parse_args()
    rows = []
    for cluster in args.clusters:
        row = compare(args.config, cluster, args.time_limit, args.classic, args.batch_size)
        rows.append(row)
        plan = row["pipeline"]
        print(f"== gpt-{args.config} on {cluster} (pipeline planned, stages searched, in {row['planning_s']:.1f} s "
              f"wall, {row['planning_cpu_s']:.1f} s CPU; modeled times)")
        print(f"  best pipeline:  {len(plan.stages)} stages, {plan.pipeline}".replace("pipeline          ", ""))
        print(f"    peak {plan.ledger.peak_memory_bytes / 2**30:.1f} GiB per device, "
              f"{'fits' if plan.fits else 'over the budget'}")
        for stage in plan.stages:
            print(f"    {stage}")
        for name, (step_s, peak, fits) in row["others"].items():
            print(f"  {name:28} {step_s * 1e3:10.2f} ms  {peak / 2**30:6.1f} GiB  {'fits' if fits else 'over budget'}")
        print(f"  pipeline speedup over the best other plan that fits: {row['speedup']:.2f}x")
    print()
    print(f"{'cluster':12} {'SPMD ms':>10} {'pipeline ms':>12} {'stages':>7} {'B':>4} {'speedup':>8}  chosen")
    for row in rows:
        plan = row["pipeline"]
        print(f"{row['cluster']:12} {row['spmd_s'] * 1e3:10.2f} {row['pipeline_s'] * 1e3:12.2f} "
              f"{len(plan.stages):7d} {plan.num_microbatches:4d} {row['speedup']:7.2f}x  {row['chosen']}")


if __name__ == "__main__":
    main()
