"""Strategy type, the rule table keyed by jax primitive name, and the factor generator.

A rule lists the ways one op can run on a logical mesh. Most rules are one
line built from ``factor_strategies``: describe the op's loop dimensions
("factors") and where each sits in the inputs and outputs, and the generator
enumerates every assignment of mesh axes to factors that divides the sizes.

A factor that appears in the outputs is *parallel*: splitting it splits the
work and the output. A factor absent from every output is *reduced*: splitting
it leaves partial results that the strategy itself reduces (an all-reduce over
the split axes, or a reduce-scatter when the output is then split over those
axes too). As XLA does, each split reduced factor is all-reduced apart, over
its own axes: two reduced dims split over x and y are two all-reduces of the
whole result, not one over both. A factor marked ``replicate_only`` is never
split (sort along an axis, cumsum's axis, a gather's indexed dimension...).

Every strategy must be *locally computable*: each device runs the primitive
on its own input shards (with shape-carrying params such as reshape's
``new_sizes`` rewritten by ``localize_params``) and then applies exactly the
strategy's ``collectives``; the result must equal the shard of the global
result that the output spec names. tests/sim/test_strategy_rules.py checks
this for every rule by simulating shards with ``jax.shard_map``.
"""
from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import numpy as np

from autoshard.ir.graph import Op, Value
from autoshard.ir.primitives import CONTRACTIONS
from autoshard.ir.spec import Collective, MeshAxes, Spec
from autoshard.meshes import cost
from autoshard.meshes.logical import LogicalMesh

log = logging.getLogger(__name__)

Reduction: TypeAlias = Literal["sum", "max", "min", "prod", "and", "or", "xor"]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: required input specs, produced output specs and what it costs.

    ``collectives`` are the communications this choice needs by itself (the
    reduction of a split contracting dimension, say); resharding between ops
    is priced on the graph's edges, not here.
    """

    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    compute_s: float
    comm_s: float = 0.0
    collectives: tuple[Collective, ...] = ()
    note: str = ""
    reduction: Reduction | None = None  # how the partial results ``collectives`` combine are reduced
    flops: float = 0.0  # per device: the op's FLOPs over the parallelism this choice splits it by
    # > 0: its reductions wait for the end of the scan of this length (``passes/deferral.py``)
    deferred_over: int = 0
    apart_hbm_bytes: float = 0.0  # per run: HBM bytes moved outside the op's fusion (a deferred twin's stack)

    @property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s

    def __str__(self) -> str:
        ins = " x ".join(map(str, self.in_specs))
        outs = ", ".join(map(str, self.out_specs))
        axes = sorted({a for s in self.in_specs + self.out_specs for a in s.used_axes})
        text = f"{ins} -> {outs}"
        if axes:
            text += " @ {" + ",".join(axes) + "}"
        if self.collectives:
            text += " + " + " ".join(map(str, self.collectives))
        if self.deferred_over:
            text += f" (reduced once after the {self.deferred_over}-iteration loop)"
        return text


Rule: TypeAlias = Callable[[Op, Sequence[Value], Sequence[Value], LogicalMesh], list[Strategy]]
RULES: dict[str, Rule] = {}


def _register_into(table: dict[str, Any], what: str, primitives: tuple[str, ...]) -> Callable[[Any], Any]:
    def wrap(fn: Any) -> Any:
        for name in primitives:
            if name in table:
                raise ValueError(f"a {what} for {name!r} is registered twice")
            table[name] = fn
        return fn

    return wrap


def register(*primitives: str) -> Callable[[Rule], Rule]:
    """Decorator: ``@register("exp", "log")`` puts a rule in the table for those primitives."""
    return _register_into(RULES, "strategy rule", primitives)


# Primitives without a rule on purpose, with the reason (passes/strategies/replicated.py): planned replicated,
# and the one warning for each says why. A primitive in neither table warns as unknown.
REPLICATED: dict[str, str] = {}


def declare_replicated(reason: str, *primitives: str) -> None:
    """Plan ``primitives`` replicated because of ``reason`` (a clause the warning quotes)."""
    for name in primitives:
        if name in RULES or name in REPLICATED:
            raise ValueError(f"{name!r} is declared replicated but already has a rule or a declaration")
        REPLICATED[name] = reason


class UnsupportedPrimitiveWarning(UserWarning):
    """A primitive has no strategy rule; it is planned replicated."""


_warned: set[str] = set()


def strategies_for(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """Every valid strategy of ``op`` on ``mesh``; replicated (with one warning) when no rule exists.

    Strategies whose specs do not divide the shapes are dropped; the replicated
    strategy is always present, so the list is never empty.
    """
    rule = RULES.get(op.primitive)
    if rule is None:
        if op.primitive not in _warned:
            _warned.add(op.primitive)
            why = REPLICATED.get(op.primitive)
            because = f" ({why})" if why else ""
            warnings.warn(
                f"autoshard has no strategy rule for primitive {op.primitive!r}{because}; it is planned "
                f"replicated (correct, maybe slower). Register one with autoshard.passes.strategies.register.",
                UnsupportedPrimitiveWarning, stacklevel=2,
            )
        found: list[Strategy] = []
    else:
        found = rule(op, ins, outs, mesh)
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    valid = [
        s for s in found
        if all(spec.divides(v.shape, sizes) for spec, v in zip(s.in_specs, ins))
        and all(spec.divides(v.shape, sizes) for spec, v in zip(s.out_specs, outs))
    ]
    replicated = replicated_strategy(op, ins, outs, mesh)
    if not any(_same_specs(s, replicated) for s in valid):
        valid.append(replicated)
    return _dedupe(valid)


def _same_specs(a: Strategy, b: Strategy) -> bool:
    return a.in_specs == b.in_specs and a.out_specs == b.out_specs


def _dedupe(strategies: list[Strategy]) -> list[Strategy]:
    seen: dict[tuple, Strategy] = {}
    for s in strategies:
        key = (s.in_specs, s.out_specs)
        if key not in seen or s.cost_s < seen[key].cost_s:
            seen[key] = s
    return list(seen.values())


def op_dtype(op: Op, ins: Sequence[Value], outs: Sequence[Value]) -> str:
    """The peak an op runs at (a key of ``ClusterSpec.peak_flops_per_s``): a contraction runs at its
    operands' dtype (bf16 dots at the bf16 peak, even with an f32 result), a float32 one at
    ``"tfloat32"`` unless it asks for ``precision=HIGHEST`` (the cluster falls back to float32 when it
    has no TF32 rate); any other op at its result's dtype."""
    if op.primitive in CONTRACTIONS and ins:
        dtype = ins[0].dtype
        if dtype == "float32" and not _highest_precision(op):
            return "tfloat32"
        return dtype
    return outs[0].dtype if outs else "float32"


def _highest_precision(op: Op) -> bool:
    precision = op.params.get("precision")
    names = [str(p) for p in (precision if isinstance(precision, (tuple, list)) else (precision,)) if p is not None]
    if not names:
        import jax  # the global default applies when the op names none

        names = [str(jax.config.jax_default_matmul_precision or "")]
    return any("HIGHEST" in n.upper() or n.lower() in ("highest", "float32", "fp32") for n in names)


def op_compute_s(op: Op, mesh: LogicalMesh, parallelism: int, dtype: str) -> float:
    """Roofline time of one device doing 1/parallelism of the op, every operand and result through HBM.

    A standalone estimate (strategy tests, explanations of a lone op); the intra-op pass prices
    strategies with the traffic XLA's fusions leave (``passes/hbm_traffic.py``)."""
    parallelism = max(1, parallelism)
    return cost.roofline_s(mesh.cluster, op.flops / parallelism, op.bytes_accessed / parallelism, dtype)


def replicated_strategy(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> Strategy:
    return Strategy(
        in_specs=tuple(Spec.replicated(v.rank) for v in ins),
        out_specs=tuple(Spec.replicated(v.rank) for v in outs),
        compute_s=op_compute_s(op, mesh, 1, op_dtype(op, ins, outs)),
        note="replicated", flops=op.flops,
    )


# ---- the factor generator --------------------------------------------------


@dataclass(frozen=True)
class Factor:
    """One loop dimension of an op: its size and the dim it occupies in each input/output (None: absent)."""

    size: int
    in_dims: tuple[int | None, ...]
    out_dims: tuple[int | None, ...]
    replicate_only: bool = False

    @property
    def reduced(self) -> bool:
        return all(d is None for d in self.out_dims)


def elementwise_factors(ins: Sequence[Value], out: Value) -> list[Factor]:
    """One factor per output dim, shared by every input that has that dim at full size.

    Rank-0 inputs (scalar literals) have none; since jax 0.10 lax also broadcasts
    size-1 dims implicitly (``add f32[1,4] f32[3,4]``, one_hot's ``eq i32[3,1]
    i32[1,5]``), so a size-1 input dim under a larger output dim stays unsplit.
    """
    return [
        Factor(size, tuple(d if v.rank == out.rank and v.shape[d] == size else None for v in ins), (d,))
        for d, size in enumerate(out.shape)
    ]


def factor_strategies(
    op: Op,
    ins: Sequence[Value],
    outs: Sequence[Value],
    mesh: LogicalMesh,
    factors: Sequence[Factor],
    *,
    reduction: Reduction | None = "sum",
    allow_reduce_scatter: bool = True,
    note: str = "",
) -> list[Strategy]:
    """Enumerate every mapping of mesh axes onto factors (each axis used at most once).

    ``reduction`` names how partial results of a split reduced factor combine
    ("sum", "max", "min", ...; None forbids splitting reduced factors). ``note``
    is appended to the note of every strategy that splits a reduced factor.
    """
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    axes = [a for a in mesh.axis_names if sizes[a] > 1]
    choices = [i for i, f in enumerate(factors) if not f.replicate_only and f.size > 1
               and (reduction is not None or not f.reduced)]
    dtype = op_dtype(op, ins, outs)
    strategies: list[Strategy] = []
    for assignment in itertools.product([None, *choices], repeat=len(axes)):
        per_factor: dict[int, list[str]] = {}
        for axis, fi in zip(axes, assignment):
            if fi is not None:
                per_factor.setdefault(fi, []).append(axis)
        if any(factors[fi].size % int(np.prod([sizes[a] for a in ax])) for fi, ax in per_factor.items()):
            continue
        in_dims: list[list[MeshAxes]] = [[() for _ in range(v.rank)] for v in ins]
        out_dims: list[list[MeshAxes]] = [[() for _ in range(v.rank)] for v in outs]
        reduced_groups: list[tuple[str, ...]] = []  # per split reduced factor, its axes (mesh order)
        parallelism = 1
        for fi, ax in per_factor.items():
            f = factors[fi]
            parallelism *= int(np.prod([sizes[a] for a in ax]))
            for k, d in enumerate(f.in_dims):
                if d is not None:
                    in_dims[k][d] = tuple(ax)
            for k, d in enumerate(f.out_dims):
                if d is not None:
                    out_dims[k][d] = tuple(ax)
            if f.reduced:
                reduced_groups.append(tuple(a for a in mesh.axis_names if a in ax))
        in_specs = tuple(Spec(tuple(d)) for d in in_dims)
        base_out = [Spec(tuple(d)) for d in out_dims]
        compute = op_compute_s(op, mesh, parallelism, dtype)
        flops = op.flops / parallelism
        if not reduced_groups:
            strategies.append(Strategy(in_specs, tuple(base_out), compute, flops=flops))
            continue
        reduced = tuple(a for a in mesh.axis_names if any(a in group for group in reduced_groups))
        out_bytes = [v.nbytes / s.num_shards(sizes) for v, s in zip(outs, base_out)]
        # XLA's partitioner reduces each split reduced factor apart: partial sums over two contracting dims
        # split over x and y are an all-reduce of the whole result over y, then another over x (measured: a
        # GPT's weight gradient with batch over the nodes and sequence inside them sends all its bytes across
        # nodes, not the eighth a hierarchical all-reduce over both would); one dim split over both axes is one
        in_mesh_order = sorted(reduced_groups, key=lambda g: mesh.axis_names.index(g[0]))
        reduce_comm = [Collective("all-reduce", group, b) for group in in_mesh_order for b in out_bytes]
        strategies.append(Strategy(
            in_specs, tuple(base_out), compute,
            comm_s=sum(cost.collective_s(mesh, c) for c in reduce_comm),
            collectives=tuple(reduce_comm), note=_join(f"all-reduce({reduction})", note), reduction=reduction,
            flops=flops,
        ))
        if not allow_reduce_scatter or len(outs) != 1:
            continue
        out = outs[0]
        for d in range(out.rank):
            scattered = Spec(tuple(
                tuple(base_out[0].dims[k]) + (reduced if k == d else ()) for k in range(out.rank)))
            if not scattered.divides(out.shape, sizes):
                continue
            strategies.append(Strategy(
                in_specs, (scattered,), compute,
                comm_s=cost.reduce_scatter_s(mesh, reduced, out_bytes[0]),
                collectives=(Collective("reduce-scatter", reduced, out_bytes[0]),),
                note=_join(f"reduce-scatter({reduction}) onto dim {d}", note), reduction=reduction,
                flops=flops,
            ))
    return strategies


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


# ---- running a strategy on shards ------------------------------------------

Shape: TypeAlias = tuple[int, ...]
Localizer: TypeAlias = Callable[[Op, Sequence[Shape], Sequence[Shape]], dict[str, Any]]
LOCALIZERS: dict[str, Localizer] = {}
_SHARDING_PARAMS = ("sharding", "out_sharding")


def register_localizer(*primitives: str) -> Callable[[Localizer], Localizer]:
    """Decorator: ``@register_localizer("reshape")`` rewrites shape-carrying params for one shard."""
    return _register_into(LOCALIZERS, "localizer", primitives)


def localize_params(op: Op, local_in_shapes: Sequence[Shape], local_out_shapes: Sequence[Shape]) -> dict[str, Any]:
    """The bind params one device uses on its shards.

    Shape-carrying params are rewritten to the local shapes (reshape's
    ``new_sizes``, broadcast_in_dim's ``shape``, gather's ``slice_sizes``...)
    and global ``sharding``/``out_sharding`` annotations are dropped.
    ``local_out_shapes`` are the shapes before the strategy's collectives (a
    reduce-scatter's operand, not its result).
    """
    params = dict(op.params)
    for name in _SHARDING_PARAMS:
        if name in params:
            params[name] = None
    localizer = LOCALIZERS.get(op.primitive)
    if localizer is not None:
        params.update(localizer(op, tuple(map(tuple, local_in_shapes)), tuple(map(tuple, local_out_shapes))))
    return params
