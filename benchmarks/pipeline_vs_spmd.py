"""Pipeline vs SPMD under the cost model: GPT on two 8-A100 nodes (25 Gbit/s between them) and on one.

For each cluster, plans the same AdamW train step two ways and prints the modeled step times:
the best SPMD-only plan (intra-op ILP over every 2-axis logical mesh) and the best pipeline of two
or more stages (stage DP over layer ranges x sub-meshes x microbatches), and which one autoshard
picks. Shapes only: nothing is allocated.

    python benchmarks/pipeline_vs_spmd.py [--config medium] [--clusters 2x8-a100 1x8-a100]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optax  # noqa: E402

import autoshard  # noqa: E402
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


def compare(config: str, cluster: str, time_limit_s: float = 5.0) -> dict[str, object]:
    work = gpt.workload(config, abstract=True)
    spec = autoshard.PRESETS[cluster]
    start = time.perf_counter()
    piped, spmd = plan_pipeline(marked_step(work), work.args, cluster=cluster, num_devices=spec.num_devices,
                                options=IntraOpOptions(time_limit_s=time_limit_s), keep_both=True)
    seconds = time.perf_counter() - start
    pipe_s = piped.plan.step_s
    spmd_s = spmd.plan.step_s if spmd is not None else float("inf")
    return {"cluster": cluster, "config": config, "pipeline": piped.plan, "spmd": spmd,
            "pipeline_s": pipe_s, "spmd_s": spmd_s, "chosen": "pipeline" if pipe_s < spmd_s else "spmd",
            "planning_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="medium", choices=sorted(gpt.CONFIGS))
    parser.add_argument("--clusters", nargs="+", default=["2x8-a100", "1x8-a100"])
    parser.add_argument("--time-limit", type=float, default=5.0, help="ILP seconds per mesh shape")
    args = parser.parse_args()
    rows = []
    for cluster in args.clusters:
        row = compare(args.config, cluster, args.time_limit)
        rows.append(row)
        plan = row["pipeline"]
        spmd = row["spmd"]
        print(f"== gpt-{args.config} on {cluster} (planned in {row['planning_s']:.1f}s)")
        if spmd is not None:
            print(f"  best SPMD-only: mesh {'x'.join(map(str, spmd.plan.mesh_shape))}, "
                  f"{spmd.plan.step_s * 1e3:.2f} ms (compute {spmd.plan.ledger.compute_s * 1e3:.2f}, collectives "
                  f"{spmd.plan.ledger.comm_s * 1e3:.2f}, resharding {spmd.plan.ledger.reshard_s * 1e3:.2f})")
        print(f"  best pipeline:  {len(plan.stages)} stages, {plan.pipeline}".replace("pipeline          ", ""))
        for stage in plan.stages:
            print(f"    {stage}")
        print(f"  chosen: {row['chosen']}")
    print()
    print(f"{'cluster':12} {'SPMD ms':>10} {'pipeline ms':>12} {'stages':>7} {'B':>4}  chosen")
    for row in rows:
        plan = row["pipeline"]
        print(f"{row['cluster']:12} {row['spmd_s'] * 1e3:10.2f} {row['pipeline_s'] * 1e3:12.2f} "
              f"{len(plan.stages):7d} {plan.num_microbatches:4d}  {row['chosen']}")


if __name__ == "__main__":
    main()
