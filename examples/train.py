"""Plan and train an example on simulated CPU devices: the README's main job.

    python -m examples.train --model gpt --steps 3 [--devices 8] [--mesh 2x4] [--cluster 1x8-a100]

Prints the plan, then the loss of each sharded step next to the same step on
one device, so a wrong plan shows at once.
"""
from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=["mlp", "gpt", "moe", "convnet"])
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

    import jax
    from rich.console import Console

    import autoshard

    console = Console()
    if len(jax.devices()) < args.devices:
        raise SystemExit(f"only {len(jax.devices())} devices: the jax backend started before XLA_FLAGS was set")
    module = importlib.import_module(f"examples.{args.model}")
    work = module.workload(args.config)
    mesh = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else None
    step = autoshard.autoshard(work.step, mesh=mesh, cluster=args.cluster)
    reference = jax.jit(work.step)

    params, opt_state, batch = work.args
    ref_state = jax.tree.map(lambda x: x.copy(), (params, opt_state))
    for i in range(args.steps):
        ref_params, ref_opt, ref_loss = reference(*ref_state, batch)
        ref_state = (ref_params, ref_opt)
        params, opt_state, loss = step(params, opt_state, batch)
        if i == 0:
            console.print(str(step.plan), markup=False, highlight=False)
        console.print(f"step {i}: loss {float(loss):.6f}   (one device: {float(ref_loss):.6f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
