"""Launch bundles: a plan that leaves this machine (``autoshard export PLAN --format launch --out DIR``).

A bundle is a folder with the plan, ``run.sh`` and a README::

    plan.json   the plan (its origin names the step: target and config)
    run.sh      ./run.sh [--steps N] [--check-numerics] [--out DIR]      under SLURM, on TPU VMs, or alone
                ./run.sh --slurm [...]                                    from an sbatch script: srun, one task a node
                ./run.sh --local-processes N [...]                        N processes here, simulated CPU devices
    README.md   the same, for people

``run.sh`` runs ``python -m autoshard.bundle DIR`` in every process, which:

1. joins the job (``initialize_from_env``: the ``autoshard launch`` variables,
   jax's own, or the scheduler jax detects: SLURM, Open MPI, a TPU slice);
2. rebuilds the step from the plan's origin and checks it against the plan's
   signature (argument paths, shapes, dtypes, operation count) before
   anything runs, refusing with ``PlanMismatchError`` on a difference;
3. builds the plan's mesh from the physical device order
   (``jax.experimental.mesh_utils``; with several processes each process is
   a granule and the leading axes cross processes);
4. creates the state and every step's batch directly in the plan's layouts
   (the target's ``init(seed)``, jitted with the plan's shardings as
   ``out_shardings``: each process materializes only its own shards);
5. runs the steps; process 0 prints the losses and, with ``--out``, writes
   ``losses.json``; with ``--check-numerics`` it also runs the same steps
   on one of its devices, compares the losses and records the result in the
   plan it writes (``Plan.checks["numerics"]``), exiting 1 on a mismatch.

The step is ``step(*state, batch) -> (*state, loss)`` (the examples' shape:
the batch is the last argument). Step ``i`` feeds the batch of seed ``seed + i`` (the target's own synthetic
data), so a run exercises the plan end to end; feeding real data is the
training script's job (docs/MULTIHOST.md: ``local_indices`` /
``global_batch``). Pipeline plans are refused (there is no multi-process
pipeline runtime).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from autoshard.errors import PlanningError

console = Console(highlight=False, soft_wrap=True)  # one line per message: the launcher prefixes lines per process

RUN_SH = """#!/usr/bin/env bash
# Run autoshard plan '{name}' (mesh {mesh} = {devices} devices, planned for {cluster}); see README.md.
#   ./run.sh [--steps N] [--check-numerics] [--out DIR]   one process per host: under srun, on TPU VM workers, alone
#   ./run.sh --slurm [...]                                from an sbatch script: srun with one task per node
#   ./run.sh --local-processes N [...]                    N processes on this machine, {devices} simulated CPU devices
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
PYTHON="${{PYTHON:-python3}}"
DEVICES={devices}
case "${{1:-}}" in
  --local-processes)
    N="${{2:?--local-processes needs a process count}}"; shift 2
    if (( N < 1 || DEVICES % N )); then
      echo "run.sh: $N processes do not split the plan's $DEVICES devices evenly" >&2; exit 2
    fi
    exec "$PYTHON" -m autoshard.cli launch --processes "$N" --devices-per-process $((DEVICES / N)) -- \\
      "$PYTHON" -m autoshard.bundle "$HERE" "$@" ;;
  --slurm)
    shift
    exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 "$0" "$@" ;;
esac
exec "$PYTHON" -m autoshard.bundle "$HERE" "$@"
"""

README = """# Launch bundle: autoshard plan '{name}'

Mesh {mesh_axes} ({devices} devices), planned for `{cluster}`; the step is `{target}` (config `{config}`).

| where | command |
|---|---|
| here, N processes on simulated CPU devices | `./run.sh --local-processes 2 --steps 3` |
| SLURM, inside an allocation | `srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 ./run.sh` |
| SLURM, from an sbatch script | `./run.sh --slurm` |
| Cloud TPU VMs | `gcloud compute tpus tpu-vm ssh NAME --worker=all --command "cd $PWD && ./run.sh"` |
| Kubernetes (indexed Job) | set `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; run `./run.sh` |
| one host with all {devices} accelerators | `./run.sh` |

Options: `--steps N` (default 3), `--check-numerics` (process 0 repeats the steps on one device and compares the
losses; it records the result in the plan it writes), `--out DIR` (losses.json, plan.json), `--seed S`,
`--target T` / `--config C` (where the step's module lives on this machine, when its recorded path does not exist
here). `PYTHON=...` picks the interpreter (autoshard and the target's imports must be installed for it).

Every process joins the job through `jax.distributed` (the launcher's, jax's or the scheduler's variables),
rebuilds the step and checks it against the plan's signature before running, builds the mesh from the physical
device order (`jax.experimental.mesh_utils`; each process a granule, the leading axes across processes) and
creates the state and each step's batch in the plan's layouts, so a process holds only its shards. The batches
are the target's own (seed + step); train on real data by feeding `local_indices` / `global_batch` as autoshard's
docs/MULTIHOST.md shows.

What the plan does not know:

{caveats}
"""


def write_bundle(plan: Any, out: str | Path) -> list[Path]:
    """Write ``plan`` as a launch bundle in ``out``; the paths written."""
    from autoshard.compiler.multiprocess import check_runs_multiprocess

    if plan.stages:
        from autoshard.runtime.distributed import MultiProcessError

        raise MultiProcessError(
            f"plan '{plan.name}' is a pipeline plan ({len(plan.stages)} stages): launch bundles hold SPMD plans, and "
            "pipeline plans do not run across processes from a bundle yet; run one with plan_multiprocess(..., "
            "num_stages=N) and apply_plan in your script (autoshard's docs/MULTIHOST.md), or plan with num_stages=1")
    check_runs_multiprocess(plan)
    if "target" not in plan.origin:
        raise PlanningError(f"plan '{plan.name}' does not record the step it was made from (no origin target): "
                            "make it with `autoshard plan TARGET ... --out plan.json` (or compare/advise)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    devices = math.prod(plan.mesh_shape)
    fields = dict(name=plan.name, mesh="x".join(map(str, plan.mesh_shape)), devices=devices,
                  cluster=plan.cluster.name, target=plan.origin["target"], config=plan.origin.get("config", "small"),
                  nodes=plan.cluster.num_nodes,
                  mesh_axes=" x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape)),
                  caveats="\n".join(f"- **{title}**: " + "; ".join(items) for title, items in plan.caveats.sections()))
    plan.save(out / "plan.json")
    run = out / "run.sh"
    run.write_text(RUN_SH.format(**fields))
    run.chmod(run.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    (out / "README.md").write_text(README.format(**fields))
    return [out / "plan.json", run, out / "README.md"]


# ----------------------------------------------------------------------------- the runner (every process)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m autoshard.bundle", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("bundle", help="the bundle folder (with plan.json)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="step i feeds the batch of seed + i")
    parser.add_argument("--check-numerics", action="store_true", help="compare the losses with one device")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative loss tolerance of --check-numerics")
    parser.add_argument("--out", default=None, help="process 0 writes losses.json and plan.json here")
    parser.add_argument("--target", default=None, help="the step's module here (default: the plan's origin)")
    parser.add_argument("--config", default=None, help="the step's config (default: the plan's origin)")
    return parser.parse_args(argv)


def _abstract(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _arguments(loaded: Any, plan: Any, mesh: Any, seed: int) -> tuple[Any, Any]:
    """(state built in the plan's layouts, batch_at(step) -> that step's batch in its layouts)."""
    import jax
    import numpy as np

    from autoshard.distributed import input_shardings

    shardings = input_shardings(plan, _abstract(loaded.args), mesh)
    state_sh, batch_sh = shardings[:-1], shardings[-1]
    if loaded.init is not None:
        init = loaded.init
        state = jax.jit(lambda: tuple(init(seed)[:-1]), out_shardings=tuple(state_sh))()
        batch_fn = jax.jit(lambda s: init(s)[-1], out_shardings=batch_sh)
        return state, lambda i: batch_fn(seed + i)
    leaves = jax.tree.leaves(loaded.args)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        raise PlanningError("the target gives only abstract arguments and no init(seed): a bundle needs real "
                            "arrays; give the target an init(seed) (see examples/common.py)")

    def place(x: Any, sharding: Any) -> Any:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    placed = jax.tree.map(place, tuple(loaded.args), tuple(shardings))
    return placed[:-1], lambda _i: placed[-1]


def _reference_losses(loaded: Any, steps: int, seed: int) -> list[float]:
    """The same steps on one local device (``--check-numerics``)."""
    import jax

    device = jax.local_devices()[0]
    init = loaded.init
    batch_fn = jax.jit(lambda s: init(s)[-1]) if init is not None else None

    def batch_at(i: int) -> Any:
        return batch_fn(seed + i) if batch_fn is not None else jax.device_put(loaded.args[-1], device)

    with jax.default_device(device):
        state = (list(jax.jit(lambda: tuple(init(seed)[:-1]))()) if init is not None
                 else list(jax.device_put(loaded.args[:-1], device)))
        step = jax.jit(loaded.step)
        losses = []
        for i in range(steps):
            *state, loss = step(*state, batch_at(i))
            losses.append(float(loss))
    return losses


def run(args: argparse.Namespace) -> int:
    from autoshard.plans.plan import load_plan
    from autoshard.runtime.distributed import detect

    plan_path = Path(args.bundle) / "plan.json"
    plan = load_plan(plan_path)
    if detect().source == "single" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # alone: on CPU, as many simulated devices as the plan needs (read when the backend starts; no-op on GPUs)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={math.prod(plan.mesh_shape)}").strip()
    from autoshard.distributed import (apply_plan, check_runs_multiprocess, initialize_from_env, physical_mesh,
                                       plan_digest)

    env = initialize_from_env()
    import jax

    from autoshard.targets import load_target

    lead = jax.process_index() == 0

    def say(text: str) -> None:
        if lead:
            console.print(text, markup=False)

    check_runs_multiprocess(plan)
    target = args.target or plan.origin.get("target")
    config = args.config or plan.origin.get("config", "small")
    if not target:
        raise PlanningError(f"{plan_path} records no origin target; pass --target")
    loaded = load_target(target, config, abstract=True)
    mesh = physical_mesh(plan.mesh_shape, plan.axis_names)
    say(f"{jax.process_count()} process(es) x {jax.local_device_count()} devices ({env.source}); mesh "
        f"{dict(mesh.shape)}; step {loaded.name} from {target} ({config})")
    applied = apply_plan(plan, loaded.step, mesh, _abstract(loaded.args))  # checks the step against the plan
    console.print(f"process {jax.process_index()} runs plan sha256 {plan_digest(plan)[:16]}", markup=False)
    state, batch_at = _arguments(loaded, plan, mesh, args.seed)
    losses = []
    for i in range(args.steps):
        *state, loss = applied(*state, batch_at(i))
        losses.append(float(loss))
        say(f"step {i}: loss {losses[-1]:.7f}")
    code, result = 0, {"losses": losses, "processes": jax.process_count(),
                       "devices_per_process": jax.local_device_count(), "mesh": list(plan.mesh_shape)}
    if args.check_numerics and lead:
        reference = _reference_losses(load_target(target, config, abstract=True), args.steps, args.seed)
        worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, reference))
        matched = worst <= args.rtol
        verdict = (f"{'matched' if matched else 'DIFFERED from'} one device: {args.steps} steps, worst relative loss "
                   f"difference {worst:.1e} (tolerance {args.rtol:g}), {jax.process_count()} processes x "
                   f"{jax.local_device_count()} devices, {datetime.date.today().isoformat()}")
        say(f"numerics: {verdict}")
        plan = replace(plan, checks={**plan.checks, "numerics": verdict})
        result.update(reference_losses=reference, worst_relative_difference=worst, matched=matched)
        code = 0 if matched else 1
    if lead and args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "losses.json").write_text(json.dumps(result, indent=1))
        plan.save(out / "plan.json")
    return code


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return run(args)
    except PlanningError as err:  # PlanMismatchError and MultiProcessError included
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"error: {err}", markup=False)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

