"""Check a plan against what XLA compiled: collectives, memory, FLOPs and HBM bytes, predicted vs compiled.

The plan's ledger predicts per-device bytes for each collective kind, the
per-device peak memory, and the per-device FLOPs and HBM bytes of one step.
``verify`` compiles the planned step, reads the optimized HLO
(``compiler/hlo.py``), ``memory_analysis()`` and ``cost_analysis()`` (loop
bodies times their trip counts), and reports each figure side by side with its
relative error. A figure off by more than its tolerance is flagged: either the
cost model or the emitter is wrong.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from autoshard.compiler.hlo import CompiledSummary, HloCollective, summarize_compiled
from autoshard.ir.spec import Collective
from autoshard.meshes import cost
from autoshard.meshes.cost import collective_s
from autoshard.meshes.logical import LogicalMesh, axis_groups, group_link, make_logical_mesh
from autoshard.plans.plan import Plan

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
COLLECTIVE_TOLERANCE = 0.10
MEMORY_TOLERANCE = 0.15
FLOPS_TOLERANCE = 0.05
HBM_BYTES_TOLERANCE = 0.20
# Peak memory is also ok within this many bytes: XLA:CPU keeps fixed buffers (a few hundred KiB) that are
# noise on a real model but 20% of a tiny one's (gpt tiny: 1.15 predicted vs 1.46 MiB compiled).
MEMORY_IMMATERIAL_BYTES = 2.0**20


@dataclass(frozen=True)
class FidelityRow:
    what: str
    predicted: float
    compiled: float
    tolerance: float
    # differences below this many bytes are immaterial (e.g. 1% of all collective bytes: a few kB that
    # XLA moves as a permute instead of a reduce-scatter in a plan that moves megabytes)
    immaterial_bytes: float = 1024.0
    # False: an estimate shown beside what XLA compiled, not a promise the plan makes (e.g. the collectives of a
    # pipeline stage's backward, which XLA places itself); it is never flagged and does not fail the report
    checked: bool = True

    @property
    def flagged(self) -> bool:
        """Checked and off by more than its tolerance."""
        return self.checked and not self.ok

    @property
    def rel_error(self) -> float:
        if self.compiled == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.compiled) / self.compiled

    @property
    def ok(self) -> bool:
        # Tiny absolute differences (a few scalars) are not model errors.
        return self.rel_error <= self.tolerance or abs(self.predicted - self.compiled) <= self.immaterial_bytes


class FidelityRows:
    """What every fidelity report does with its ``rows`` (SPMD here, per stage in ``verify_pipeline``)."""

    rows: tuple[FidelityRow, ...]

    @property
    def ok(self) -> bool:
        return not any(r.flagged for r in self.rows)

    def row(self, what: str) -> FidelityRow:
        return next(r for r in self.rows if r.what == what)

    def text_lines(self, width: int) -> list[str]:
        lines = [f"{'figure':{width}} {'predicted':>14} {'compiled':>14} {'error':>8}"]
        for r in self.rows:
            flag = ("  (estimate, not checked)" if not r.checked else
                    "" if r.ok else "  <-- off by more than " + f"{r.tolerance:.0%}")
            lines.append(f"{r.what:{width}} {r.predicted:14,.0f} {r.compiled:14,.0f} {r.rel_error:8.1%}{flag}")
        return lines


@dataclass(frozen=True)
class FidelityReport(FidelityRows):
    rows: tuple[FidelityRow, ...]
    summary: CompiledSummary

    def __str__(self) -> str:
        return "\n".join(self.text_lines(28))


def collective_rows(predicted: Mapping[str, float], compiled: Mapping[str, float], prefix: str = "",
                    checked: bool = True) -> list[FidelityRow]:
    """Per collective kind either side moves, predicted vs compiled per-device bytes, and their totals; a kind's
    difference under 1% of all compiled collective bytes (or 1 KiB) is immaterial."""
    total_c = float(sum(compiled.values()))
    immaterial = max(1024.0, 0.01 * total_c)
    rows = []
    for kind in KINDS:
        p, c = float(predicted.get(kind, 0.0)), float(compiled.get(kind, 0.0))
        if p or c:
            rows.append(FidelityRow(f"{prefix}{kind} bytes", p, c, COLLECTIVE_TOLERANCE, immaterial, checked))
    rows.append(FidelityRow(f"{prefix}all collective bytes", float(sum(predicted.values())), total_c,
                            COLLECTIVE_TOLERANCE, checked=checked))
    return rows


def compare(plan: Plan, summary: CompiledSummary) -> FidelityReport:
    rows = collective_rows(plan.ledger.collective_bytes, summary.bytes_by_kind)
    rows.append(FidelityRow("peak memory bytes", plan.ledger.peak_memory_bytes, float(summary.peak_bytes),
                            MEMORY_TOLERANCE, MEMORY_IMMATERIAL_BYTES))
    flops, nbytes = getattr(summary, "flops", None), getattr(summary, "bytes_accessed", None)
    if flops is not None and plan.ledger.flops_per_device:
        rows.append(FidelityRow("flops per device", plan.ledger.flops_per_device, flops, FLOPS_TOLERANCE,
                                immaterial_bytes=0.0))
    if nbytes is not None and plan.ledger.hbm_bytes_per_device:
        rows.append(FidelityRow("hbm bytes per device", plan.ledger.hbm_bytes_per_device, nbytes,
                                HBM_BYTES_TOLERANCE))
    return FidelityReport(tuple(rows), summary)


@dataclass(frozen=True)
class CompiledPrice:
    """A compiled program priced by the cluster the plan was made for, from what XLA compiled alone."""

    compute_s: float  # max(FLOPs at the plan's peaks, bytes accessed / HBM bandwidth)
    collectives_s: float  # every HLO collective (times its loop count) at its replica groups' links
    flops: float
    bytes_accessed: float
    cross_node_collectives: int = 0  # collectives run per step (loop counts applied) whose groups span nodes
    cross_node_bytes: float = 0.0  # their per-device bytes
    # the batch's arrival from the host, as the program's input shardings (the plan's batch specs) split it:
    # no HLO instruction shows it, so it is the ledger's figure (Ledger.input_s)
    input_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.collectives_s + self.input_s


_RING_S = {"all-reduce": cost.ring_all_reduce_s, "all-gather": cost.ring_all_gather_s,
           "reduce-scatter": cost.ring_reduce_scatter_s, "all-to-all": cost.ring_all_to_all_s}


def _mesh_axes_of(mesh: LogicalMesh, groups: tuple[tuple[int, ...], ...]) -> tuple[str, ...] | None:
    """The mesh axes whose device groups are exactly ``groups`` (partition ids: row-major mesh positions);
    None when no set of axes has these groups (a group inside part of an axis, or across axes unevenly)."""
    grid = np.arange(mesh.num_devices).reshape(mesh.shape)
    wanted = {frozenset(g) for g in groups}
    names = [i for i, a in enumerate(mesh.axes) if a.size > 1]
    for mask in range(1, 1 << len(names)):
        dims = [d for k, d in enumerate(names) if mask >> k & 1]
        if {frozenset(int(x) for x in row) for row in axis_groups(grid, dims)} == wanted:
            return tuple(mesh.axes[d].name for d in dims)
    return None


def collective_price_s(mesh: LogicalMesh, c: HloCollective) -> float:
    """Seconds of one run of a compiled collective on ``mesh``'s cluster, from its real replica groups.

    Groups that are the device groups of some mesh axes are priced as the planner prices a collective over
    those axes (``meshes/cost.collective_s``: per axis or one flat ring, at each group's link and node
    crossings); any other groups as one flat ring over their members at the link those members span
    (``meshes/logical.group_link``: intra-node, or the inter-node link with one NIC per member on a node). A
    collective-permute is one message at the slowest link any of its pairs crosses.
    """
    if not c.groups:  # a summary read without groups: the smallest set of axes of the group's size
        axes = _axes_of_size(mesh, c.group_size)
        return collective_s(mesh, Collective(c.kind, axes, float(c.nbytes))) if axes else 0.0
    devices = np.asarray(mesh.device_indices)
    if c.kind == "collective-permute":
        pairs = devices[np.asarray(c.groups)] // mesh.cluster.devices_per_node
        crossing = bool((pairs[:, 0] != pairs[:, 1]).any())
        link = mesh.cluster.inter_node if crossing else mesh.cluster.intra_node
        return cost.point_to_point_s(float(c.nbytes), link)
    if max(len(g) for g in c.groups) <= 1:
        return 0.0
    axes = _mesh_axes_of(mesh, c.groups)
    if axes is not None:
        return collective_s(mesh, Collective(c.kind, axes, float(c.nbytes)))
    link = group_link(mesh.cluster, devices[_padded(c.groups)], [1])
    return _RING_S[c.kind](float(c.nbytes), max(len(g) for g in c.groups), link)


def _padded(groups: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """[groups, members] of equal-length rows (a short group repeats its first member: same nodes)."""
    width = max(len(g) for g in groups)
    return np.asarray([list(g) + [g[0]] * (width - len(g)) for g in groups])


def crosses_nodes(mesh: LogicalMesh, c: HloCollective) -> bool:
    """Whether some group (or permute pair) of ``c`` spans two nodes of ``mesh``'s cluster."""
    if not c.groups:
        return False
    nodes = np.asarray(mesh.device_indices)[_padded(c.groups)] // mesh.cluster.devices_per_node
    return bool((nodes != nodes[:, :1]).any())


def _axes_of_size(mesh: LogicalMesh, group_size: int) -> tuple[str, ...]:
    """The smallest set of mesh axes whose sizes multiply to ``group_size`` (inner axes first on ties)."""
    names = [a.name for a in mesh.axes if a.size > 1]
    best: tuple[str, ...] = ()
    for mask in range(1, 1 << len(names)):
        chosen = tuple(n for i, n in enumerate(names) if mask >> i & 1)
        if mesh.size_of(chosen) == group_size and (not best or len(chosen) <= len(best)):
            best = chosen
    return best


def seconds_per_flop(plan: Plan) -> float:
    """Seconds per FLOP at the peaks the plan's ops run at (``Ledger.flops_by_dtype``: bf16 dots of a
    fp32-master step at the bf16 peak; a plan without that split, at the parameters' dtype, TF32 for
    float32), averaged over the plan's mix of FLOPs."""
    cluster = plan.cluster
    split = {d: f for d, f in plan.ledger.flops_by_dtype.items() if f > 0}
    if split:
        return sum(f / cluster.peak_flops(d) for d, f in split.items()) / sum(split.values())
    dtypes = [dtype for p, (_shape, dtype) in plan.input_shapes.items() if plan.input_roles.get(p) == "param"]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    return 1.0 / cluster.peak_flops("tfloat32" if dtype == "float32" else dtype)


def price_summary(summary: CompiledSummary, mesh: LogicalMesh, per_flop_s: float,
                  input_s: float = 0.0) -> CompiledPrice:
    """One compiled program on ``mesh`` (its cluster and the devices it runs on): its FLOPs at
    ``per_flop_s``, its bytes accessed at HBM bandwidth, each collective at its replica groups' links and
    node crossings (``collective_price_s``)."""
    flops, nbytes = float(summary.flops or 0.0), float(summary.bytes_accessed or 0.0)
    compute = max(flops * per_flop_s, nbytes / mesh.cluster.memory_bandwidth_bytes_per_s)
    seconds = crossing_bytes = 0.0
    crossing = 0
    for c in summary.collectives:
        seconds += c.count * collective_price_s(mesh, c)
        if crosses_nodes(mesh, c):
            crossing += c.count
            crossing_bytes += float(c.nbytes * c.count)
    return CompiledPrice(compute, seconds, flops, nbytes, crossing, crossing_bytes, input_s)


def compiled_price(plan: Plan, summary: CompiledSummary) -> CompiledPrice:
    """What the compiled program of an SPMD ``plan`` costs on ``plan.cluster`` (``price_summary`` at the
    plan's peaks, ``seconds_per_flop``), with the batch's arrival the ledger prices."""
    mesh = make_logical_mesh(plan.cluster, tuple(plan.mesh_shape), tuple(plan.axis_names))
    return price_summary(summary, mesh, seconds_per_flop(plan), plan.ledger.input_s)


def verify_compiled(plan: Plan, compiled: Any) -> FidelityReport:
    """Compare ``plan`` with an XLA executable of it (``step.lower(*args).compile()``)."""
    return compare(plan, summarize_compiled(compiled))
