"""Stage costs from the intra-op pass: Alpa's two levels under one cost model.

For every stage candidate the stage DP (``passes/stages.py``) needs a time per
microbatch, a memory per device and the transfer at its boundaries. Here they
come from the intra-op ILP (``passes/intra_op.py``) on each layer's train
graph (one microbatch's forward + backward, the gradient accumulated;
``ir/train_graph.py``) on the stage's logical mesh, so a stage may be
data parallel, FSDP/ZeRO, tensor parallel or DP x TP inside: whatever the ILP
finds cheapest under the #9 model (rooflines of the fused traffic,
alpha-beta collectives over the links the sub-mesh spans).

A *variant* is (sub-mesh shape, logical mesh shape, mode, recompute): the
StageProblem's K axis indexes variants, so the DP searches the logical shape,
the state layout and recomputation per stage beside the layer range and
sub-mesh. Modes: ``"fast"`` (the ILP's own choice within the budget) and
``"lean"`` (parameters and gradient accumulators pinned to the fully sharded
FSDP layout, what a stage of many layers needs when memory binds).

Each distinct layer (equal ``Layer.structure``: repeated and tied layers) is
solved once per (logical mesh, mode) at two microbatch sizes, the full batch
(B = 1) and batch / r (B = r); for 1 < B < r each quantity is linear in the
microbatch size between the two (per op the work is a fixed part, the weights,
plus a part proportional to the microbatch); B above r is not searched. A
forced B is solved at exactly that microbatch. Planning is therefore
independent of depth but for the DP itself.

Per layer l on a variant, with the ILP's plan (storage specs, value specs):

    t_l        = the plan's step seconds (compute + collectives + resharding) per microbatch
    f_l        = the seconds of its forward ops (the forward executable's, ``split_phases``)
    state_l    = parameters + gradient accumulator per device, in their storage layouts
    opt_l      = r_opt x accumulator bytes (the optimizer state kept in the accumulator's layout)
    u_l        = once per step: the optimizer's per-op rooflines on the accumulator's shard, plus
                 resharding each updated parameter from the accumulator's layout to its own
    act_l      = residuals per microbatch, as the runtime keeps them between its forward and backward
                 executables (``ir/train_graph.split_phases``): the forward's values the backward
                 reads, and the layer input
    held_l     = the plan's peak with the residuals held to its end (the backward an executable apart,
                 whose arguments they are) - state_l - act_l
    pend_l     = the partial sums of the ops feeding only the accumulated gradients (XLA reduces a
                 stage's gradients in one combined collective after its whole backward)
    fact_l, fextra_l = the residuals and the rest of the peak when forward and backward run as one
                 program (the forward's values read by any later op, as the buffers they live in;
                 a value a fusion recomputes where it is read holds the buffers it is made from)

and a stage i..j (recompute: the backward re-runs the stage forward from its input; the last stage fuses
its forward into its backward, so it keeps what a recomputing stage keeps)::

    time       = sum t_l [+ sum f_l]  +  sum u_l / B
    param      = sum (state_l + opt_l)
    act        = sum act_l            [recompute, last stage: the stage input only]
    work       = max(max_l (held_l + sum_{m > l} pend_m),  2 x sum pend_l)
                 [recompute, last stage: max_l (fextra_l + sum_{m <= l} fact_m + sum_{m > l} pend_m)
                  - the stage input, and at least 2 x sum pend_l]

(the backward runs layer j first: while layer l runs its own, the layers after it have left their partial
sums pending, and in one program the layers before it still hold their residuals; at the end the combined
reduction holds its operands and results at once).

Collectives are split between the forward and backward executables by the same cut; a value resharded
alike in both halves is counted in each (each executable runs its own reshard), and once where both halves
run as one program (the last stage, a recomputing backward: ``LayerCost.fused_collectives``).

Transfers after layer j from variant k1 to k2: the activation forward and its
gradient back, each ``cross_mesh_send_s`` over the link the two sub-meshes
cross; a destination whose first layer takes its input replicated receives one
split copy and all-gathers it inside its own mesh when that is cheaper.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from autoshard.errors import InfeasibleMemoryError
from autoshard.ir.train_graph import LayerTrainGraph
from autoshard.meshes.cluster import ClusterSpec
from autoshard.meshes.logical import LogicalMesh, factorizations, make_logical_mesh
from autoshard.passes.classic import Baseline, baseline_pins, batch_spec
from autoshard.passes.intra_op import IntraOpOptions, plan_intra_op
from autoshard.passes.layer_cost import LayerCost, layer_cost
from autoshard.passes.layer_solves import LayerSolves, SolveKey, SolveSettings
from autoshard.passes.inter_op import cross_mesh_send_s
from autoshard.passes.stage_problem import StagePlan, StageProblem, SubmeshShape, microbatch_choices
from autoshard.plans.schedules import PipelineSchedule

log = logging.getLogger(__name__)

MODES = ("fast", "lean", "dp")  # "dp": parameters and accumulators replicated, the batch split (a baseline)


@dataclass(frozen=True)
class StageVariant:
    """How a stage runs on its devices: K axis of the StageProblem."""

    submesh: SubmeshShape
    mesh_shape: tuple[int, ...]  # logical mesh of the sub-mesh
    mode: str  # one of MODES
    recompute: bool

    def __str__(self) -> str:
        return (f"{self.submesh[0]}x{self.submesh[1]} as {'x'.join(map(str, self.mesh_shape))} {self.mode}"
                f"{' recompute' if self.recompute else ''}")


@dataclass(frozen=True)
class StageCostOptions:
    schedule: PipelineSchedule = "1f1b"
    num_stages: int | None = None
    num_microbatches: int | None = None
    max_microbatches: int = 64
    memory_budget_bytes: float = math.inf
    min_stages: int = 1
    recompute: tuple[bool, ...] = (False, True)  # searched per stage
    modes: tuple[str, ...] = ("fast", "lean")
    time_limit_s: float = 0.2  # solver seconds per layer solve
    submeshes: tuple[SubmeshShape, ...] | None = None  # None: stage_submeshes(cluster)


@dataclass(frozen=True, eq=False)
class PricedStages:
    problem: StageProblem
    variants: tuple[StageVariant, ...]
    compute_s: np.ndarray  # [L, L, K, nB] per microbatch, without the once-per-step part
    update_s: np.ndarray  # [L, L, K] once per step
    state_bytes: np.ndarray  # [L, L, K] params + accumulators per device
    grad_bytes: np.ndarray  # [L, L, K] the accumulators' part
    opt_bytes: np.ndarray  # [L, L, K]
    costs: dict[tuple[str, int, int], tuple[LayerCost, LayerCost]]  # (layer key, mesh, mode) -> (B=1, B=r)
    ratio: int  # r
    layer_keys: tuple[str, ...]
    meshes: tuple[LogicalMesh, ...]  # the logical meshes solved on
    mesh_of: tuple[int, ...]  # per variant: its index in meshes
    num_solves: int  # the layer solves this pricing made (those it read from an earlier one not counted)
    groups: tuple[tuple[int, ...], ...]  # per layer: its graph's input counts (LayerTrainGraph.groups)
    settings: SolveSettings  # what its layer solves read besides their keys (a later solve must match)

    def layer_cost(self, layer: int, k: int) -> LayerCost:
        """The plan of ``layer`` on variant k at B = r (its specs are those the runtime applies)."""
        return self.costs[self.layer_keys[layer], self.mesh_of[k], MODES.index(self.variants[k].mode)][1]


def stage_submeshes(cluster: ClusterSpec, num_devices: int) -> tuple[SubmeshShape, ...]:
    """Alpa's sub-mesh shapes: (1, 2^i) inside a node and (m, devices_per_node) for whole nodes."""
    per_node = min(cluster.devices_per_node, num_devices)
    shapes = []
    width = 1
    while width <= per_node:
        if per_node % width == 0:
            shapes.append((1, width))
        width *= 2
    if per_node not in [w for _, w in shapes]:
        shapes.append((1, per_node))
    shapes += [(m, per_node) for m in range(2, num_devices // per_node + 1)]
    return tuple(shapes)


def logical_shapes(submesh: SubmeshShape) -> list[tuple[int, ...]]:
    """Logical meshes of a sub-mesh: (nodes, per node) across nodes; inside a node every 2-axis
    factorization with both axes > 1 (the 1-axis mesh when there is none: its plans are a subset)."""
    nodes, per = submesh
    if nodes > 1:
        return [(nodes, per)]
    two = [s for s in factorizations(per, 2) if len(s) == 2 and min(s) > 1]
    return two or [(per,)]


def lerp_microbatch(big: float, small: float, ratio: int, num_microbatches: int) -> float:
    """Linear in the microbatch size between B = 1 (``big``) and B = r (``small``), clipped at 0."""
    if ratio == 1:
        return big
    x = (1.0 / num_microbatches - 1.0 / ratio) / (1.0 - 1.0 / ratio)
    return max(0.0, small + (big - small) * x)


def solve_layer(train: LayerTrainGraph, mesh: LogicalMesh, mode: str, update: Sequence[float], opt_ratio: float,
                options: StageCostOptions) -> LayerCost:
    """One layer class's train graph planned by the intra-op pass on ``mesh`` in ``mode`` (``lean`` and ``dp``
    pin the classic storage layouts), read as a LayerCost; a layer over the budget is priced anyway (the DP
    rejects what does not fit)."""
    budget = options.memory_budget_bytes if math.isfinite(options.memory_budget_bytes) else None
    opts = IntraOpOptions(time_limit_s=options.time_limit_s, memory_budget_bytes=budget, classic_starts=False)
    if mode in ("lean", "dp"):
        pins = baseline_pins(train.graph, mesh, Baseline.FSDP if mode == "lean" else Baseline.DP)
        keep = sum(train.groups[:3])  # accumulators, parameters, and (for DP) the batch
        pinned = {i: s for i, s in pins.items() if i < keep - (mode == "lean") * train.groups[2]}
        if mode == "dp":  # data parallel: the activations entering and their cotangents split on the batch too
            sizes = dict(zip(mesh.axis_names, mesh.shape))
            axes = tuple(a for a in mesh.axis_names if sizes[a] > 1)
            for i in range(keep, len(train.graph.inputs)):
                pinned[i] = batch_spec(train.graph.values[train.graph.inputs[i]].shape, axes, sizes)
        opts = replace(opts, pinned_inputs=pinned)
    try:
        result = plan_intra_op(train.graph, mesh, opts, exact_smallest_budget=False)
    except InfeasibleMemoryError:  # one layer over the budget: price it anyway, the DP rejects what does not fit
        result = plan_intra_op(train.graph, mesh, replace(opts, memory_budget_bytes=1e30),
                               exact_smallest_budget=False)
    return layer_cost(train, result, update, opt_ratio)


def solve_layers(layer_graphs: Sequence[tuple[LayerTrainGraph, LayerTrainGraph]],
                 leaf_update_s: Sequence[Sequence[float]], mesh_keys: Sequence[tuple[SubmeshShape, tuple[int, ...]]],
                 meshes: Sequence[LogicalMesh], microbatches: tuple[int, int], options: StageCostOptions,
                 settings: SolveSettings, solves: LayerSolves[LayerCost], progress: Callable[[str], None] | None = None
                 ) -> dict[tuple[str, int, int], tuple[LayerCost, LayerCost]]:
    """Every distinct layer on every mesh at B = 1 and B = r (``microbatches``: the examples per microbatch of
    the two graphs, equal when they are one graph), each solve read from ``solves`` or made there
    (``passes/layer_solves.py``).

    ``"lean"`` is solved on a mesh of more than one device only when the whole model's state in the fast
    plans (parameters, accumulators, optimizer state) would not fit the budget there: otherwise every
    stage's state fits without it."""
    costs: dict[tuple[str, int, int], tuple[LayerCost, LayerCost]] = {}
    opt_ratio = settings.opt_ratio

    def run(mode: str) -> None:
        for (big, small), update in zip(layer_graphs, leaf_update_s):
            for m, mesh in enumerate(meshes):
                key = (big.key, m, MODES.index(mode))
                if key in costs or (mode == "lean" and m not in lean_meshes):
                    continue
                sub, shape = mesh_keys[m]
                pair = []
                for train, size in ((big, microbatches[0]), (small, microbatches[1])):
                    solve_key = SolveKey(big.key, sub, shape, size, mode)
                    if not solves.has(settings, solve_key):
                        # one line per class is detail (the command line shows it with --verbose)
                        log.info("pricing layer class %s on %s (%s, microbatch of %d)", big.key[:8],
                                 "x".join(map(str, mesh.shape)), mode, size)
                    pair.append(solves.cost(settings, solve_key,
                                            lambda t=train: solve_layer(t, mesh, mode, update, opt_ratio, options)))
                costs[key] = (pair[0], pair[1])

    lean_meshes: set[int] = set()
    if progress is not None:
        progress(f"pricing {len(layer_graphs)} layer class(es) on {len(meshes)} logical mesh(es)")
    if "fast" in options.modes:
        run("fast")
    if "dp" in options.modes:
        run("dp")
    if "lean" in options.modes:
        for m, mesh in enumerate(meshes):
            state = sum(costs[big.key, m, 0][1].state_bytes + costs[big.key, m, 0][1].opt_bytes
                        for big, _ in layer_graphs) if "fast" in options.modes else math.inf
            if mesh.num_devices > 1 and state > options.memory_budget_bytes:
                lean_meshes.add(m)
        run("lean")
    return costs


@dataclass(frozen=True)
class StageArrays:
    """Per stage (first layer, last layer, variant[, B]): what ``price_stage_variants`` reads off its layers'
    costs."""

    compute_s: np.ndarray  # [L, L, K, nB]
    update_s: np.ndarray  # [L, L, K]
    state_bytes: np.ndarray  # [L, L, K]
    grad_bytes: np.ndarray  # [L, L, K]
    opt_bytes: np.ndarray  # [L, L, K]
    act_bytes: np.ndarray  # [L, L, K, nB] per microbatch in flight
    work_bytes: np.ndarray  # [L, L, K, nB] at its peak, once
    in_replicated: np.ndarray  # [L, K] the layer takes its input replicated


def stage_arrays(costs: Mapping[tuple[str, int, int], tuple[LayerCost, LayerCost]], keys: Sequence[str],
                 variants: Sequence[StageVariant], mesh_of: Sequence[int], bs: Sequence[int],
                 ratio: int) -> StageArrays:
    """Each stage's figures from its layers' costs, interpolated in the microbatch between B = 1 and B = r."""
    num_layers, num_k, num_b = len(keys), len(variants), len(bs)
    # per layer, variant, B: t, f, act, in; per layer, variant: state, opt, update
    t = np.zeros((num_layers, num_k, num_b))
    f, act, inb = np.zeros_like(t), np.zeros_like(t), np.zeros_like(t)
    fact, fextra = np.zeros_like(t), np.zeros_like(t)  # run as one program (the last stage, recompute)
    hextra, pend = np.zeros_like(t), np.zeros_like(t)  # the backward an executable apart (LayerCost)
    state, grad, opt, upd = (np.zeros((num_layers, num_k)) for _ in range(4))
    in_rep = np.zeros((num_layers, num_k), dtype=bool)
    for layer in range(num_layers):
        for k, var in enumerate(variants):
            big, small = costs[keys[layer], mesh_of[k], MODES.index(var.mode)]
            state[layer, k], opt[layer, k], upd[layer, k] = small.state_bytes, small.opt_bytes, small.update_s
            grad[layer, k] = small.grad_bytes
            in_rep[layer, k] = small.in_replicated
            for b, big_b in enumerate(bs):
                t[layer, k, b] = lerp_microbatch(big.time_s, small.time_s, ratio, big_b)
                f[layer, k, b] = lerp_microbatch(big.forward_s, small.forward_s, ratio, big_b)
                act[layer, k, b] = lerp_microbatch(big.act_bytes, small.act_bytes, ratio, big_b)
                inb[layer, k, b] = lerp_microbatch(big.in_bytes, small.in_bytes, ratio, big_b)
                fact[layer, k, b] = lerp_microbatch(big.fused_act_bytes, small.fused_act_bytes, ratio, big_b)
                fextra[layer, k, b] = lerp_microbatch(big.fused_extra_bytes, small.fused_extra_bytes, ratio, big_b)
                hextra[layer, k, b] = lerp_microbatch(big.held_extra_bytes, small.held_extra_bytes, ratio, big_b)
                pend[layer, k, b] = lerp_microbatch(big.pending_bytes, small.pending_bytes, ratio, big_b)
    cum = {name: np.concatenate([np.zeros((1,) + a.shape[1:]), np.cumsum(a, axis=0)])
           for name, a in (("t", t), ("f", f), ("act", act), ("state", state), ("grad", grad), ("opt", opt), ("upd", upd), ("fact", fact), ("pend", pend))}
    shape4 = (num_layers, num_layers, num_k, num_b)
    comp, acts, work = np.full(shape4, np.inf), np.zeros(shape4), np.zeros(shape4)
    sbytes, gbytes, obytes, usec = (np.zeros(shape4[:3]) for _ in range(4))
    recompute = np.array([v.recompute for v in variants])
    for i in range(num_layers):
        run_held, run_fused = np.zeros((num_k, num_b)), np.zeros((num_k, num_b))
        for j in range(i, num_layers):
            # the backward runs layer j first: the partial sums it leaves pend while layers i..j-1 run theirs
            run_held = np.maximum(run_held + pend[j], hextra[j])
            seg = {name: a[j + 1] - a[i] for name, a in cum.items()}
            # run as one program: while layer l runs its backward, layers i..l-1 still hold their residuals
            run_fused = np.maximum(run_fused + pend[j], fextra[j] + seg["fact"])
            sbytes[i, j], obytes[i, j], usec[i, j] = seg["state"], seg["opt"], seg["upd"]
            gbytes[i, j] = seg["grad"]
            comp[i, j] = seg["t"] + np.where(recompute[:, None], seg["f"], 0.0)
            # one program (recomputing, or the last stage fusing its forward into its backward): only the input
            # is held per microbatch in flight; its residuals live inside the one program (run_fused)
            fused = recompute[:, None] | (j == num_layers - 1)
            acts[i, j] = np.where(fused, inb[i], seg["act"])
            # ... and at the stage's end XLA reduces them all in one combined collective, whose operands and results
            # live at once (in either form)
            combined = 2 * seg["pend"]
            work[i, j] = np.maximum(np.where(fused, run_fused - inb[i], run_held), combined)
    return StageArrays(comp, usec, sbytes, gbytes, obytes, acts, work, in_rep)


def price_stage_variants(layer_graphs: Sequence[tuple[LayerTrainGraph, LayerTrainGraph]],
                         leaf_update_s: Sequence[Sequence[float]], out_bytes: Sequence[float], ratio: int,
                         cluster: ClusterSpec, num_devices: int, global_batch: int, opt_ratio: float,
                         options: StageCostOptions, progress: Callable[[str], None] | None = None,
                         solves: LayerSolves[LayerCost] | None = None) -> PricedStages:
    """Fill a StageProblem whose K axis is the stage variants (module docstring).

    ``layer_graphs``: per layer, its class's train graph at B = 1 and at B = ``ratio``;
    ``leaf_update_s``: per layer, the optimizer's seconds per parameter input of its graph (replicated);
    ``out_bytes``: per layer, the activation bytes crossing the cut after it at the full batch;
    ``solves``: the layer solves already made (``passes/layer_solves.py``; None: a cache of its own), which
    this pricing reads and adds to: every stage count and cut is priced from one solve per key.
    """
    num_layers = len(layer_graphs)
    subs = options.submeshes or stage_submeshes(cluster, num_devices)
    fewest = max(options.min_stages, options.num_stages or 1)
    largest = num_devices - (fewest - 1) * min(a * b for a, b in subs)  # a bigger stage leaves too few devices
    subs = tuple(sub for sub in subs if sub[0] * sub[1] <= largest)
    mesh_keys = [(sub, shape) for sub in subs for shape in logical_shapes(sub)]
    meshes = tuple(make_logical_mesh(cluster, shape, device_indices=tuple(range(sub[0] * sub[1])))
                   for sub, shape in mesh_keys)
    settings = SolveSettings(cluster, options.time_limit_s, options.memory_budget_bytes, opt_ratio)
    solves = LayerSolves() if solves is None else solves
    made = solves.solves
    forced = all(big is small for big, small in layer_graphs)  # B fixed, or no smaller microbatch traced
    small_mb = global_batch // max(ratio, 1)
    costs = solve_layers(layer_graphs, leaf_update_s, mesh_keys, meshes,
                         (small_mb if forced else global_batch, small_mb), options, settings, solves,
                         progress)
    variants, mesh_of = [], []
    for m, (sub, shape) in enumerate(mesh_keys):
        for mode in options.modes:
            if (layer_graphs[0][0].key, m, MODES.index(mode)) not in costs:
                continue
            for rec in options.recompute:
                variants.append(StageVariant(sub, shape, mode, rec))
                mesh_of.append(m)
    # B up to r only: between B = 1 and B = r the costs interpolate two solves; beyond r they would extrapolate
    # (a microbatch smaller than any solved, whose batch split the plans at r may not allow)
    bs = microbatch_choices(global_batch, min(options.max_microbatches, max(ratio, 1)))
    if options.num_microbatches is not None and options.num_microbatches not in bs:
        bs = tuple(sorted({*bs, options.num_microbatches}))
    keys = tuple(big.key for big, _ in layer_graphs)
    arrays = stage_arrays(costs, keys, tuple(variants), tuple(mesh_of), bs, ratio)
    comp, usec, acts, work, in_rep = arrays.compute_s, arrays.update_s, arrays.act_bytes, arrays.work_bytes, arrays.in_replicated
    sbytes, gbytes, obytes = arrays.state_bytes, arrays.grad_bytes, arrays.opt_bytes
    num_k, num_b = len(variants), len(bs)
    time = comp + usec[..., None] / np.array(bs, dtype=float)
    if options.min_stages > 1:
        time[0, num_layers - 1, [k for k, v in enumerate(variants) if v.submesh[0] * v.submesh[1] == num_devices]] = \
            np.inf
    transfer = np.zeros((max(num_layers - 1, 0), num_k, num_k, num_b))
    cross_node = np.zeros((max(num_layers - 1, 0), num_k, num_b))
    for j in range(num_layers - 1):
        for k1, v1 in enumerate(variants):
            n1 = v1.submesh[0] * v1.submesh[1]
            for k2, v2 in enumerate(variants):
                n2 = v2.submesh[0] * v2.submesh[1]
                cross = v1.submesh[0] > 1 or v2.submesh[0] > 1 or v1.submesh[1] + v2.submesh[1] > cluster.devices_per_node
                for b, big_b in enumerate(bs):
                    transfer[j, k1, k2, b] = 2 * cross_mesh_send_s(
                        cluster, out_bytes[j] / big_b, n1, n2, cross_node=cross, dst_replicated=bool(in_rep[j + 1, k2]))
        for k, v in enumerate(variants):  # to an equal sub-mesh on another node (an interleaved group's next)
            n = v.submesh[0] * v.submesh[1]
            for b, big_b in enumerate(bs):
                cross_node[j, k, b] = 2 * cross_mesh_send_s(cluster, out_bytes[j] / big_b, n, n, cross_node=True,
                                                            dst_replicated=bool(in_rep[j + 1, k]))
    problem = StageProblem(
        num_layers=num_layers, submeshes=tuple(v.submesh for v in variants), num_devices=num_devices,
        global_batch=global_batch, microbatch_options=bs, stage_time_s=time, stage_param_bytes=sbytes + obytes,
        stage_act_bytes=acts, transfer_s=transfer, memory_budget_bytes=options.memory_budget_bytes,
        schedule=options.schedule, num_stages=options.num_stages, num_microbatches=options.num_microbatches,
        stage_work_bytes=work, transfer_cross_node_s=cross_node,
        devices_per_node=min(cluster.devices_per_node, num_devices))
    return PricedStages(problem, tuple(variants), comp, usec, sbytes, gbytes, obytes, costs, ratio, keys, meshes,
                        tuple(mesh_of), solves.solves - made, tuple(big.groups for big, _ in layer_graphs), settings)


def at_chosen_microbatch(priced: PricedStages, plan: StagePlan, graphs: Sequence[LayerTrainGraph] | None,
                         leaf_update_s: Sequence[Sequence[float]], global_batch: int, options: StageCostOptions,
                         solves: LayerSolves[LayerCost]) -> PricedStages:
    """``priced`` with the chosen stages' layers planned at the chosen microbatch count B, which the runtime
    runs: the DP's figures interpolate each layer between its solves at B = 1 and B = r, but a stage pins one
    plan, so the layers of the chosen stages are solved at batch / B (``graphs``: each layer's class graph
    traced there; B = 1 reads the full-batch solves, B = r those made already), one solve per (class, mesh,
    mode) through ``solves``. Their costs become that plan at both ends, so every figure read from them (the
    plan's specs, collectives, memory) is the one at B; the DP's own arrays are kept as they were."""
    b = plan.num_microbatches
    if b == priced.ratio:
        return priced
    costs = dict(priced.costs)
    for choice in plan.stages:
        k = choice.submesh_index
        variant, m = priced.variants[k], priced.mesh_of[k]
        mesh = priced.meshes[m]
        for layer in range(choice.first_layer, choice.last_layer + 1):
            key = (priced.layer_keys[layer], m, MODES.index(variant.mode))
            if b == 1:
                costs[key] = (priced.costs[key][0], priced.costs[key][0])
                continue
            if graphs is None:  # the step traces to other equations at batch / B: the interpolation stays
                continue
            train = graphs[layer]
            solve_key = SolveKey(train.key, variant.submesh, variant.mesh_shape, global_batch // b, variant.mode)
            at_b = solves.cost(priced.settings, solve_key, lambda t=train, mesh=mesh, u=leaf_update_s[layer]: solve_layer(
                t, mesh, variant.mode, u, priced.settings.opt_ratio, options))
            costs[key] = (at_b, at_b)
    # the plan's memory is the chosen stages' at B (the DP chose on the interpolated figures, kept for its times)
    arrays = stage_arrays(costs, priced.layer_keys, priced.variants, priced.mesh_of, priced.problem.microbatch_options,
                           priced.ratio)
    problem = replace(priced.problem, stage_act_bytes=arrays.act_bytes, stage_work_bytes=arrays.work_bytes,
                      stage_param_bytes=arrays.state_bytes + arrays.opt_bytes)
    return replace(priced, costs=costs, problem=problem, state_bytes=arrays.state_bytes, grad_bytes=arrays.grad_bytes,
                   opt_bytes=arrays.opt_bytes)
