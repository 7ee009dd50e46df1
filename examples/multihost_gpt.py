"""Train the GPT example across processes on one autoshard plan.

    autoshard launch --processes 2 --devices-per-process 4 -- python -m examples.multihost_gpt --steps 3
    python -m autoshard.runtime.launch -n 2 -k 4 -- python -m examples.multihost_gpt --steps 3   (same)

Every process joins the job (``initialize_from_env``), builds a (2, 4) mesh
whose first axis crosses the processes, and receives the plan that process 0
made for a cluster of 2 nodes x 4 devices whose slow link is the process
boundary. Parameters and optimizer state are created directly in the plan's
shardings; each process makes only its own rows of every batch. Process 0
prints the loss of each step and, with ``--out DIR``, writes ``losses.json``,
``params.npz`` (the final parameters, gathered) and ``plan.json``.

Run without the launcher it is an ordinary single-process run on 8 simulated
devices (same plan shape, no process boundary), which helps debugging.
``reference`` runs the same steps on one device, for comparison.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

if not __package__:  # run as a file (python examples/multihost_gpt.py): make the repository's `examples` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEED = 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="small", help="examples.gpt config name")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mesh", default="2x4", help="logical mesh; its first axis crosses the processes")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's for adamw, "
                                                               "0.1 for sgd)")
    parser.add_argument("--cluster", default="cpu-8", help="hardware preset the process-split cluster is built from")
    parser.add_argument("--plan", default=None, help="run this plan file instead of planning")
    parser.add_argument("--plan-time-limit", type=float, default=10.0, help="CP-SAT seconds (planning on process 0)")
    parser.add_argument("--out", default=None, help="directory for losses.json, params.npz, plan.json (process 0)")
    return parser.parse_args(argv)


# ---- the model, optimizer and data: shared with the one-device reference ----------------


def setup(config: str = "small", optimizer: str = "adamw", lr: float | None = None) -> dict[str, Any]:
    """The pieces every run needs: step, state initializer, abstract arguments, config."""
    import jax
    import jax.numpy as jnp
    import optax

    from examples import gpt
    from examples.common import make_train_step

    work = gpt.workload(config, abstract=True)
    cfg = work.config
    if optimizer == "sgd":
        opt = optax.sgd(0.1 if lr is None else lr)
    else:
        opt = optax.adamw(cfg.learning_rate if lr is None else lr, weight_decay=cfg.weight_decay)
    step = make_train_step(work.loss_fn, opt)

    def init_state(seed: int = SEED) -> tuple[Any, Any]:
        params_key, _batch_key = jax.random.split(jax.random.key(seed))  # the keys gpt.workload(seed=...) uses
        params = gpt.init_params(cfg, params_key)
        return params, opt.init(params)

    params, opt_state = jax.eval_shape(init_state)
    batch = {"tokens": jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len + 1), jnp.int32)}
    return {"step": step, "init_state": init_state, "args": (params, opt_state, batch), "config": cfg}


def batch_rows(cfg: Any, step_index: int, rows: slice, seed: int = SEED) -> dict[str, np.ndarray]:
    """Rows ``rows`` of step ``step_index``'s batch: arithmetic sequences modulo the vocab.

    Each row depends only on (seed, step, row), so a process makes its rows without the others, as
    a real loader reads only its shard.
    """
    positions = np.arange(cfg.seq_len + 1)
    out = []
    for row in range(*rows.indices(cfg.batch_size)):
        rng = np.random.default_rng((seed, step_index, row))
        start, stride = int(rng.integers(0, cfg.vocab_size)), int(rng.integers(1, 8))
        out.append((start + stride * positions) % cfg.vocab_size)
    return {"tokens": np.asarray(out, dtype=np.int32).reshape(-1, cfg.seq_len + 1)}


def flat_params(params: Any) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def checksum(params: Any) -> float:
    return float(sum(np.abs(np.asarray(x, dtype=np.float64)).sum() for x in flat_params(params).values()))


def reference(steps: int, config: str = "small", optimizer: str = "adamw", lr: float | None = None
              ) -> tuple[list[float], dict[str, np.ndarray]]:
    """The same steps on one device: (losses, final parameters by pytree path)."""
    import jax

    from examples.common import INIT_COMPILER_OPTIONS

    parts = setup(config, optimizer, lr)
    cfg = parts["config"]
    device = jax.devices()[0]
    with jax.default_device(device):
        params, opt_state = jax.jit(parts["init_state"], compiler_options=INIT_COMPILER_OPTIONS)()
        step = jax.jit(parts["step"])
        losses = []
        for i in range(steps):
            batch = jax.device_put(batch_rows(cfg, i, slice(None)), device)
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
    return losses, flat_params(params)


# ---- the multi-process run ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    shape = tuple(int(s) for s in args.mesh.lower().split("x"))
    if "AUTOSHARD_COORDINATOR" not in os.environ and "JAX_COORDINATOR_ADDRESS" not in os.environ:
        # not under a launcher: one process with every device of the mesh (read when the backend starts)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={math.prod(shape)}").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")

    from autoshard.distributed import initialize_from_env

    env = initialize_from_env()  # before anything touches the jax backend

    import jax

    import autoshard
    from autoshard.passes.intra_op import IntraOpOptions
    from autoshard.distributed import (apply_plan, axes_crossing_processes, global_batch, init_sharded,
                                               input_shardings, local_indices, multiprocess_cluster,
                                               plan_digest, plan_multiprocess, process_mesh, to_host)
    from examples.common import INIT_COMPILER_OPTIONS

    lead = jax.process_index() == 0

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    timings: dict[str, float] = {}
    start = time.perf_counter()
    parts = setup(args.config, args.optimizer, args.lr)
    step, cfg = parts["step"], parts["config"]
    params_abs, opt_abs, batch_abs = parts["args"]
    mesh = process_mesh(shape)
    say(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices ({env.source}); mesh "
        f"{dict(mesh.shape)}; axes crossing processes: {axes_crossing_processes(mesh) or 'none'}")

    t = time.perf_counter()
    if args.plan:
        plan = autoshard.load_plan(args.plan)
    else:
        cluster = multiprocess_cluster(args.cluster)
        plan = plan_multiprocess(step, parts["args"], mesh=mesh, cluster=cluster,
                                 options=IntraOpOptions(time_limit_s=args.plan_time_limit))
    timings["plan"] = time.perf_counter() - t
    say(str(plan).split("  parameters:")[0].rstrip())
    print(f"process {jax.process_index()} runs plan sha256 {plan_digest(plan)[:16]}", flush=True)

    t = time.perf_counter()
    p_sh, o_sh, b_sh = input_shardings(plan, parts["args"], mesh)
    params, opt_state = init_sharded(parts["init_state"], (p_sh, o_sh), compiler_options=INIT_COMPILER_OPTIONS)
    timings["init"] = time.perf_counter() - t

    run = apply_plan(plan, step, mesh, parts["args"])
    rows = local_indices(b_sh["tokens"], batch_abs["tokens"].shape)[0]
    say(f"process 0 feeds batch rows {rows.start}:{rows.stop} of {cfg.batch_size}")
    losses = []
    for i in range(args.steps):
        t = time.perf_counter()
        batch = global_batch(batch_rows(cfg, i, rows), b_sh, batch_abs)
        params, opt_state, loss = run(params, opt_state, batch)
        losses.append(float(loss))
        timings[f"step {i}"] = time.perf_counter() - t
        say(f"step {i}: loss {losses[-1]:.7f}  ({timings[f'step {i}']:.2f}s)")

    final = to_host(params)  # a collective: every process takes part
    total = checksum(final)
    timings["total"] = time.perf_counter() - start
    say(f"final params checksum {total:.6f}")
    say("times: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    if lead and args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps({"losses": losses, "checksum": total, "timings": timings,
                                                     "processes": jax.process_count()}))
        np.savez(out / "params.npz", **flat_params(final))
        plan.save(out / "plan.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
