"""Plan a fuzz program on a mesh, run it, and compare it with the same step on one device.

``check(program, mesh_name)`` returns an :class:`Outcome`: ``ok``, ``refused`` (a ``PlanningError``
that names what autoshard does not plan: allowed, and counted), ``crash`` (any other exception) or
``mismatch`` (the sharded step's numbers differ from one device's). Tolerances: loss, SGD parameters
and Adam's moments at 1e-4 of the leaf's scale (a reordered fp32 sum, not a wrong plan, is the only
allowed difference); AdamW parameters within 3x the learning rate, since Adam divides rounding noise
by its own magnitude where a gradient is zero in theory.

The planner prices on one of three clusters: ``cpu-8`` (latency-bound: tiny programs stay mostly
replicated), ``COMPUTE_BOUND`` (slow compute, fast free links: the ILP shards everything it can) or
``LATENT`` (the same with a link latency: fewer collectives pay), so the runtime meets sharded plans of
every kind.
"""
from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

import autoshard
from autoshard.errors import PlanningError
from autoshard.meshes.cluster import PRESETS, ClusterSpec, LinkLevel
from autoshard.passes.intra_op import IntraOpOptions
from compiled_examples import FAST_COMPILE  # only the numbers of each step are compared

from fuzz_programs import LEARNING_RATE, Program, build

MESHES: Mapping[str, tuple[int, ...]] = {"2x4": (2, 4), "8": (8,), "1x8": (1, 8), "6": (2, 3)}
COMPUTE_BOUND = ClusterSpec(
    name="fuzz-compute-bound", num_nodes=1, devices_per_node=8,
    intra_node=LinkLevel("free", 1e15, 0.0), inter_node=LinkLevel("free", 1e15, 0.0),
    peak_flops_per_s={"float32": 1e6}, memory_bandwidth_bytes_per_s=1e9, memory_per_device_bytes=2 * 2**30,
)
# slow compute and links with a latency: sharding pays and so does paying a collective's latency fewer times
# (a scanned stack's gradients reduced after its loop, passes/deferral.py)
LATENT = dataclasses.replace(COMPUTE_BOUND, name="fuzz-compute-bound-latency", intra_node=LinkLevel("latent", 1e15, 1e-5),
                             inter_node=LinkLevel("latent", 1e15, 1e-5))
CLUSTERS: Mapping[str, ClusterSpec] = {"cpu-8": PRESETS["cpu-8"], "compute-bound": COMPUTE_BOUND,
                                       "compute-bound-latency": LATENT}
RTOL = 1e-4


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok" | "refused" | "crash" | "mismatch"
    program: Program
    mesh: str
    cluster: str
    detail: str = ""
    sharded: bool = False  # the plan split at least one input

    def __str__(self) -> str:
        return f"{self.status} on {self.mesh} ({self.cluster}): {self.program.describe()}" + (
            f"\n  {self.detail}" if self.detail else "")


def _mesh(shape: tuple[int, ...]) -> jax.sharding.Mesh:
    devices = np.asarray(jax.devices()[: int(np.prod(shape))], dtype=object).reshape(shape)
    names = ("x", "y")[: len(shape)]
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _copy(tree):
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def reference(program: Program):
    """The step on one device: (params, opt_state, loss) after one step, as numpy."""
    step, params, opt_state, batch = build(program)
    with jax.default_device(jax.devices()[0]):
        out = jax.jit(step, compiler_options=FAST_COMPILE)(*_copy((params, opt_state)), batch)
    return jax.tree.map(np.asarray, out)


def _worst(got, want) -> tuple[float, str]:
    """Largest error relative to each leaf's scale, and where.

    A leaf's scale is floored at 1% of the largest leaf of its group (the leaves that differ only in the
    last key: Adam's ``mu`` of every parameter, say): a leaf whose gradient is zero in theory holds only
    rounding noise, which the sharded step computes in another order.
    """
    leaves = [(path, np.asarray(g, np.float64), np.asarray(w, np.float64))
              for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want))]
    group_scale: dict[str, float] = {}
    for path, _g, w in leaves:
        group = jax.tree_util.keystr(path[:-1])
        group_scale[group] = max(group_scale.get(group, 0.0), float(np.max(np.abs(w), initial=0.0)))
    worst, where = 0.0, ""
    for path, g, w in leaves:
        name = jax.tree_util.keystr(path)
        if g.shape != w.shape:
            return float("inf"), f"{name}: shape {g.shape} vs {w.shape}"
        if not np.array_equal(np.isfinite(g), np.isfinite(w)):
            return float("inf"), f"{name}: non-finite values differ"
        floor = 1e-2 * group_scale[jax.tree_util.keystr(path[:-1])]
        scale = max(float(np.max(np.abs(w), initial=0.0)), floor, 1e-30)
        err = float(np.max(np.abs(np.where(np.isfinite(w), g - w, 0.0)), initial=0.0)) / scale
        if err > worst:
            worst, where = err, name
    return worst, where


def compare(program: Program, got, want) -> str:
    """'' when the sharded step matches one device, else what differs."""
    (g_params, g_opt, g_loss), (w_params, w_opt, w_loss) = got, want
    problems = []
    if _worst(g_loss, w_loss)[0] > RTOL:
        problems.append(f"loss {float(g_loss):.7g} vs one device {float(w_loss):.7g}")
    err, where = _worst(g_opt, w_opt)
    if err > RTOL:
        problems.append(f"optimizer state {where}: rel err {err:.2e}")
    if program.optimizer == "sgd":
        err, where = _worst(g_params, w_params)
        if err > RTOL:
            problems.append(f"parameter {where}: rel err {err:.2e}")
    else:
        bound = 3 * LEARNING_RATE["adamw"]
        for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(g_params), jax.tree.leaves(w_params)):
            diff = float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64)), initial=0.0))
            if not diff <= bound:
                problems.append(f"parameter {jax.tree_util.keystr(path)}: differs by {diff:.2e} > {bound:.0e}")
                break
    return "; ".join(problems)


def check(program: Program, mesh_name: str, cluster_name: str, *, time_limit_s: float = 0.2,
          want=None) -> Outcome:
    """Plan ``program`` on the mesh, run one step, compare with one device (module docstring)."""
    shape = MESHES[mesh_name]
    try:
        step, params, opt_state, batch = build(program)
        mesh = _mesh(shape)
        plan = autoshard.plan(step, params, opt_state, batch, mesh=mesh, cluster=CLUSTERS[cluster_name],
                              num_stages=1, options=IntraOpOptions(time_limit_s=time_limit_s))
    except PlanningError as err:
        return Outcome("refused", program, mesh_name, cluster_name, f"{type(err).__name__}: {err}")
    except Exception as err:  # noqa: BLE001 - the corpus reports every crash
        return Outcome("crash", program, mesh_name, cluster_name, _trace(err))
    sharded = any(not s.is_replicated for s in plan.input_specs.values())
    try:
        got = autoshard.apply(plan, step, mesh, compiler_options=FAST_COMPILE)(*_copy((params, opt_state)), batch)
        got = jax.tree.map(np.asarray, got)
    except Exception as err:  # noqa: BLE001
        return Outcome("crash", program, mesh_name, cluster_name, _trace(err), sharded)
    want = want if want is not None else reference(program)
    problem = compare(program, got, want)
    return Outcome("mismatch" if problem else "ok", program, mesh_name, cluster_name, problem, sharded)


def _trace(err: BaseException) -> str:
    lines = traceback.format_exception(type(err), err, err.__traceback__)
    return "".join(lines[-6:]).strip()
