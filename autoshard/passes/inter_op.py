"""Inter-op planner: price every (layer range, sub-mesh, B) and hand the arrays to the stage DP.

Sub-meshes (Alpa's shapes, plus every width inside a node): ``(1, d)`` for
d = 1..devices_per_node and ``(m, devices_per_node)`` for m = 2..num_nodes.
Stages are placed on devices in stage order, first fit (:func:`place_stages`).

Cost model (the ``"dp"`` model: what ``runtime/pipeline.py`` runs — data
parallel inside a stage, forward residuals kept for the backward, or the
forward recomputed with ``recompute=True``). For layers
i..j with forward + backward time W(share) on a device that computes
``share`` of the batch (the sum of per-op rooflines max(flops / peak,
bytes / HBM bandwidth) over the layers' traced forward and backward graphs,
the intra-op planner's compute model; weights read and weight gradients
written do not shrink with the share), forward time R, parameter bytes P and
activation bytes A (at the full batch), on a sub-mesh of n devices with B microbatches of size
m = batch / B (n' = n when n divides m, else 1: the runtime then replicates
the microbatch)::

    compute  = W(1 / (B n')) [+ R / (B n') with recompute]
    sync     = all-reduce of each parameter's gradient over the sub-mesh     once per step
    apply    = per-op rooflines of the optimizer's update of those leaves   once per step
    t        = compute + (sync + apply) / B                     per microbatch

Spreading the once-per-step terms over the B microbatches is exact for one
stage (B t = B compute + sync + apply) and conservative for several (the DP
sums t over the stages and charges the bottleneck B - 1 more times).

Memory per device: ``P (2 + r)`` (parameters, gradient accumulators,
optimizer state, replicated) plus, per microbatch in flight,
``(A_in + A) / (B n')``: the stage's input and the forward's outputs (the
residuals a backward reads; with recompute, conservatively, the working set
of one recompute counted once per microbatch).

Transfers after layer j, from sub-mesh k1 to k2, per microbatch: the
activation forward and its gradient back, each :func:`cross_mesh_send_s` of
the bytes crossing the cut; the link is inter-node when either sub-mesh spans
nodes or the two do not fit in one node together.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.meshes.cluster import ClusterSpec
from autoshard.meshes.cost import all_reduce_s, point_to_point_s, ring_all_gather_s
from autoshard.meshes.logical import make_logical_mesh
from autoshard.passes.layers import Layer
from autoshard.passes.stages import StagePlan, StageProblem, SubmeshShape, microbatch_choices
from autoshard.runtime.schedules import PipelineSchedule


@dataclass(frozen=True)
class InterOpOptions:
    schedule: PipelineSchedule = "1f1b"
    num_stages: int | None = None  # force S (None: searched)
    num_microbatches: int | None = None  # force B (None: searched over the divisors of the batch)
    max_microbatches: int = 64  # largest B searched
    memory_budget_bytes: float = math.inf  # per device
    submeshes: tuple[SubmeshShape, ...] | None = None  # None: submesh_candidates(cluster)
    recompute: bool = False  # the backward recomputes the forward (PipelineStep(recompute=True)); default: keeps residuals
    min_stages: int = 1  # 2: exclude the one-stage plan (compared with the SPMD planner instead)


def submesh_candidates(cluster: ClusterSpec, num_devices: int) -> tuple[SubmeshShape, ...]:
    per_node = min(cluster.devices_per_node, num_devices)
    shapes = [(1, d) for d in range(1, per_node + 1)]
    shapes += [(m, cluster.devices_per_node) for m in range(2, num_devices // cluster.devices_per_node + 1)]
    return tuple(shapes)


def cross_mesh_send_s(cluster: ClusterSpec, nbytes: float, src_devices: int, dst_devices: int, *,
                      cross_node: bool, dst_replicated: bool) -> float:
    """Move an activation of ``nbytes`` from one sub-mesh to another (one direction).

    Split destination: every device pair moves its share in parallel, bytes / min(n_src, n_dst) per link.
    Replicated destination: the cheaper of every destination device receiving the whole tensor over the
    crossing link, and sending it once, split over the destination devices, then all-gathering inside the
    destination mesh (over its fast intra-node link when the destination is one node).
    """
    if nbytes <= 0:
        return 0.0
    link = cluster.inter_node if cross_node else cluster.intra_node
    once = point_to_point_s(nbytes / max(1, min(src_devices, dst_devices)), link)
    if not dst_replicated or dst_devices == 1:
        return once
    direct = point_to_point_s(nbytes, link)
    gather_link = cluster.intra_node if dst_devices <= cluster.devices_per_node else cluster.inter_node
    return min(direct, once + ring_all_gather_s(nbytes, dst_devices, gather_link))


@dataclass(frozen=True)
class LayerWork:
    """Per op of one layer's forward + backward graph: FLOPs and fused HBM bytes as w + a * share, and
    the peak FLOP/s of the op's compute dtype.

    ``share`` is the fraction of the full batch one device computes (1 / (B n')); the fixed
    parts (weights read, weight gradients written) do not shrink with it. Obtained by tracing the
    layer at two batch sizes (see ``compiler/pipeline_driver.py``).
    """

    flops_fixed: np.ndarray
    flops_scaled: np.ndarray
    bytes_fixed: np.ndarray
    bytes_scaled: np.ndarray
    peak_flops: np.ndarray

    def time_s(self, share: float, cluster: ClusterSpec) -> float:
        """Sum of per-op rooflines, the intra-op pass's compute model, at this batch share."""
        flops = (self.flops_fixed + self.flops_scaled * share) / self.peak_flops
        hbm = (self.bytes_fixed + self.bytes_scaled * share) / cluster.memory_bandwidth_bytes_per_s
        return float(np.maximum(flops, hbm).sum())


@dataclass(frozen=True)
class PricedProblem:
    """The DP's arrays plus the breakdowns the Plan reports."""

    problem: StageProblem
    compute_s: np.ndarray  # [L, L, K, nB] per microbatch
    sync_s: np.ndarray  # [L, L, K] once per step: gradient all-reduce + optimizer apply
    param_bytes: np.ndarray  # [L, L] P, total
    opt_ratio: float


def price_stages(layers: Sequence[Layer], param_leaf_bytes: Sequence[float], input_bytes: float,
                 cluster: ClusterSpec, num_devices: int, global_batch: int, opt_ratio: float,
                 options: InterOpOptions, work: Sequence[LayerWork] | None = None,
                 leaf_apply_s: Sequence[float] | None = None) -> PricedProblem:
    """Fill a StageProblem with the ``"dp"`` cost model (module docstring).

    ``work`` (per layer, its traced forward + backward): compute is the sum of its per-op rooflines
    at the device's batch share; without it, 3x the forward's rooflines with every byte shrinking.
    ``leaf_apply_s`` (per loss-argument leaf): the optimizer's per-op rooflines for that parameter;
    without it, (3 + 2 r) P / HBM bandwidth. Gradients are all-reduced leaf by leaf, as the intra-op
    pass prices a data-parallel step.
    """
    num_layers = len(layers)
    subs = options.submeshes or submesh_candidates(cluster, num_devices)
    bs = microbatch_choices(global_batch, options.max_microbatches)
    if options.num_microbatches is not None and options.num_microbatches not in bs:
        bs = tuple(sorted({*bs, options.num_microbatches}))
    flops = np.array([layer.forward_s(cluster) for layer in layers])
    acts = np.array([layer.act_bytes for layer in layers])
    cum_f, cum_a = np.concatenate([[0], np.cumsum(flops)]), np.concatenate([[0], np.cumsum(acts)])
    in_bytes = [input_bytes] + [layer.out_bytes for layer in layers[:-1]]
    params = np.zeros((num_layers, num_layers))
    leaf_sets: dict[tuple[int, int], np.ndarray] = {}
    leaf_bytes = np.asarray(param_leaf_bytes, dtype=float)
    apply_s = (np.asarray(leaf_apply_s, dtype=float) if leaf_apply_s is not None
               else (3 + 2 * opt_ratio) * leaf_bytes / cluster.memory_bandwidth_bytes_per_s)
    for i in range(num_layers):
        leaves: set[int] = set()
        for j in range(i, num_layers):
            leaves.update(layers[j].param_leaves)
            leaf_sets[i, j] = np.array(sorted(leaves), dtype=int)
            params[i, j] = float(leaf_bytes[leaf_sets[i, j]].sum())
    shape4 = (num_layers, num_layers, len(subs), len(bs))
    comp = np.full(shape4, np.inf)
    act = np.zeros(shape4)
    sync = np.full(shape4[:3], np.inf)
    mult = 4.0 if options.recompute else 3.0
    layer_time: dict[int, np.ndarray] = {}  # B n' -> per-layer forward + backward seconds
    if work is not None:
        shares = {b * (n * p if (global_batch // b) % (n * p) == 0 else 1) for b in bs for n, p in subs}
        layer_time = {d: np.array([w.time_s(1.0 / d, cluster) for w in work]) for d in shares}
    for k, (nodes, per) in enumerate(subs):
        n = nodes * per
        mesh = make_logical_mesh(cluster, (n,), device_indices=tuple(range(n))) if nodes == 1 else \
            make_logical_mesh(cluster, (nodes, per), device_indices=tuple(range(n)))
        leaf_sync = np.array([all_reduce_s(mesh, mesh.axis_names, x) if x > 0 else 0.0 for x in leaf_bytes])
        leaf_sync += apply_s
        for i in range(num_layers):
            for j in range(i, num_layers):
                sync[i, j, k] = float(leaf_sync[leaf_sets[i, j]].sum())
                f, a = cum_f[j + 1] - cum_f[i], cum_a[j + 1] - cum_a[i]
                for b, big_b in enumerate(bs):
                    split = n if (global_batch // big_b) % n == 0 else 1
                    if work is None:
                        comp[i, j, k, b] = mult * f / (big_b * split)
                    else:
                        comp[i, j, k, b] = float(layer_time[big_b * split][i:j + 1].sum()) + (
                            f / (big_b * split) if options.recompute else 0.0)
                    act[i, j, k, b] = (in_bytes[i] + a) / (big_b * split)
    time = comp + sync[..., None] / np.array(bs, dtype=float)
    pbytes = np.broadcast_to((params * (2 + opt_ratio))[:, :, None], shape4[:3]).copy()
    transfer = np.zeros((max(num_layers - 1, 0), len(subs), len(subs), len(bs)))
    for j in range(num_layers - 1):
        for k1, (n1, p1) in enumerate(subs):
            for k2, (n2, p2) in enumerate(subs):
                cross = n1 > 1 or n2 > 1 or p1 + p2 > cluster.devices_per_node
                for b, big_b in enumerate(bs):
                    size2 = n2 * p2
                    replicated = (global_batch // big_b) % size2 != 0
                    transfer[j, k1, k2, b] = 2 * cross_mesh_send_s(
                        cluster, layers[j].out_bytes / big_b, n1 * p1, size2, cross_node=cross,
                        dst_replicated=replicated)
    if options.min_stages > 1:
        full = [k for k, (nodes, per) in enumerate(subs) if nodes * per == num_devices]
        time[0, num_layers - 1, full] = np.inf
    problem = StageProblem(
        num_layers=num_layers, submeshes=tuple(subs), num_devices=num_devices, global_batch=global_batch,
        microbatch_options=bs, stage_time_s=time, stage_param_bytes=pbytes, stage_act_bytes=act,
        transfer_s=transfer, memory_budget_bytes=options.memory_budget_bytes, schedule=options.schedule,
        num_stages=options.num_stages, num_microbatches=options.num_microbatches)
    return PricedProblem(problem, comp, sync, params, opt_ratio)


def place_stages(plan: StagePlan, cluster: ClusterSpec, num_devices: int) -> list[tuple[int, ...]]:
    """Device indices per stage: first fit in stage order; a (1, d) stage stays inside one node."""
    per_node = min(cluster.devices_per_node, num_devices)
    num_nodes = max(1, num_devices // per_node)
    free = [list(range(node * per_node, (node + 1) * per_node)) for node in range(num_nodes)]
    placed: list[tuple[int, ...]] = []
    for stage in plan.stages:
        nodes, per = stage.submesh
        if nodes == 1:
            node = next((i for i, f in enumerate(free) if len(f) >= per), None)
            if node is None:
                raise ValueError(f"cannot place stage {stage} on one node: free devices {free}")
            placed.append(tuple(free[node][:per]))
            free[node] = free[node][per:]
        else:
            whole = [i for i, f in enumerate(free) if len(f) == per_node][:nodes]
            if len(whole) < nodes:
                raise ValueError(f"cannot place stage {stage}: needs {nodes} free nodes, free devices {free}")
            placed.append(tuple(d for i in whole for d in free[i]))
            for i in whole:
                free[i] = []
    return placed
