"""Plan and train an example on simulated CPU devices: the README's main job.

    python -m examples.train --model gpt --steps 3 [--devices 8] [--mesh 2x4] [--cluster 1x8-a100]

Prints the plan, then the loss of each sharded step next to the same step on
one device, so a wrong plan shows at once.
"""
from __future__ import annotations

import argparse
import os
import sys

if not __package__:  # run as a file (python examples/train.py): make the repository's `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=["mlp", "gpt", "gpt_scan", "moe", "moe_topk", "convnet"])
    parser.add_argument("--config", default="small")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mesh", default=None, help="e.g. 2x4; default: searched")
    parser.add_argument("--cluster", default=None, help="preset or ClusterSpec file; default: the devices present")
    args = parser.parse_args(argv)
    # XLA reads the flag when the CPU backend starts (first device query), not at `import jax`.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import importlib

    from rich.console import Console

    from autoshard.progress import progress_lines  # light: rich only, so the first line shows at once

    console = Console()
    with progress_lines(console, f"{args.model}-{args.config}") as say:
        say(f"starting jax on {args.devices} simulated devices")
        import jax

        import autoshard

        if len(jax.devices()) < args.devices:
            raise SystemExit(f"only {len(jax.devices())} devices: the jax backend started before XLA_FLAGS was set")
        say("building the model and its first batch")
        work = importlib.import_module(f"examples.{args.model}").workload(args.config)
        mesh = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else None
        step = autoshard.autoshard(work.step, mesh=mesh, cluster=args.cluster, progress=say)
        reference = jax.jit(work.step)
        params, opt_state, batch = work.args
        ref_state = jax.tree.map(lambda x: x.copy(), (params, opt_state))
        params, opt_state, loss = step(params, opt_state, batch)  # says: tracing, each solve, compiling
        say("compiling the same step on one device (the reference)")
        *ref_state, ref_loss = reference(*ref_state, batch)
    console.print(str(step.plan), markup=False, highlight=False, soft_wrap=True)
    for i in range(args.steps):
        if i:
            *ref_state, ref_loss = reference(*ref_state, batch)
            params, opt_state, loss = step(params, opt_state, batch)
        console.print(f"step {i}: loss {float(loss):.6f}   (one device: {float(ref_loss):.6f})", soft_wrap=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
