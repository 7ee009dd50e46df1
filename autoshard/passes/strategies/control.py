"""Control flow, random numbers, identities and host callbacks.

A scan is flattened by the tracer (``ir/trace.py``): its body's ops are planned
like any, between four pseudo-ops with rules here. ``loop_carry`` and
``loop_final`` pass a carry through in any layout (the carry's layout holds in
every iteration: the cost graph prices the body's carry out against it, trip
count times); ``loop_slice`` gives the body a slice of a stacked input and
``loop_stack`` stacks a body output: the slice may be split any way, the
leading layer axis never is, so each iteration reads its slice where it lies.
A ``scan`` op itself (never left by the tracer) is planned replicated.

A ``while`` is flattened the same way (carries through ``loop_carry`` /
``loop_final``, priced at its derived, stated or guessed trip count:
``ir/trips.py``). A ``cond`` / ``switch``: its operands pass through
``loop_carry`` (one layout each, read by every branch) and each result leaves
through a ``cond_merge`` whose inputs are the branches' results, all in the
result's one layout. A ``while`` or ``cond`` the tracer keeps whole (side effects
in its bodies) is planned replicated with an ``UnsupportedPrimitiveWarning``
naming it.

Random primitives are replicated (keys are tiny), but for ``random_bits`` of a
threefry key under ``jax_threefry_partitionable`` (JAX's default): its bits are
a function of each element's global index (a counter iota), so XLA computes a
split result's shard alone, bit for bit the slice of the whole
(``GLOBAL_INDEXED``: the runtime binds it on the whole shape and pins its
result; a shard is not the op on a shard of the key). Replicated, every device
makes every bit: a dropout mask the size of an activation, on CPU in a loop
XLA does not split (a ViT's train step on (2, 4) of 1x8-a100 compiled to 44
ms, 11.6 ms without dropout; 15.8 ms with its masks split).
The others are registered so that they do not warn. The same holds for host
callbacks and the other replicated-only ops below.

Identities (optimization_barrier, sharding_constraint, reshard, device_put,
checkpoint ``name``) pass every split through. A user sharding constraint is
not enforced: it names a mesh of its own, and the planner decides the layout.
Their params name global shardings, so one shard's local computation is the
identity itself (``LOCAL_IDENTITY``), not a bind of the primitive.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import (Factor, Strategy, UnsupportedPrimitiveWarning, factor_strategies,
                                              register)

CONTROL_FLOW = ("scan",)
UNPLANNED_LOOPS = ("while", "cond")
RANDOM = (
    "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap", "random_unwrap",
    "random_clone", "random_gamma", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32",
    "iota_2x32_shape", "rng_bit_generator", "rng_uniform",
)
# ops whose shard of a split result is the slice of the whole result, not the op on its operands' shards
GLOBAL_INDEXED = ("random_bits",)
# empty / empty2: an uninitialized filler (cond's gradient branches pad their residuals with it)
REPLICATED_ONLY = ("pure_callback", "io_callback", "platform_index", "empty", "empty2")
LOCAL_IDENTITY = ("sharding_constraint", "reshard", "device_put", "layout_constraint")
IDENTITY = ("optimization_barrier", "name", "loop_carry", "loop_final", *LOCAL_IDENTITY)


@register(*CONTROL_FLOW, *(r for r in RANDOM if r not in GLOBAL_INDEXED), *REPLICATED_ONLY)
def _replicated_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return []  # strategies_for adds the replicated strategy


def _splits_bits(key: Value) -> bool:
    """Whether ``random_bits`` of ``key`` may split its result: one threefry key, whose bits JAX makes from
    each element's global index (``jax_threefry_partitionable``), so a shard is computed alone."""
    return key.rank == 0 and key.dtype == "key<fry>" and bool(jax.config.jax_threefry_partitionable)


@register(*GLOBAL_INDEXED)
def _random_bits_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """Any split of the bits, the key whole on every device (``GLOBAL_INDEXED``)."""
    if not _splits_bits(ins[0]):
        return []
    factors = [Factor(size, (None,), (d,)) for d, size in enumerate(outs[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors, note="each device makes its slice of the bits")


@register(*IDENTITY)
def _identity_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """Output k is input k. Either every operand splits the same dim together, or each mesh axis
    splits one operand's dim (the factor generator uses an axis once per strategy)."""
    n = len(ins)
    together = [
        Factor(min(v.shape[d] for v in ins), (d,) * n, (d,) * n)
        for d in range(min(v.rank for v in ins))
        if len({v.shape[d] for v in ins}) == 1
    ] if ins else []
    strategies = factor_strategies(op, ins, outs, mesh, together)
    if n > 1:
        one_at_a_time = [
            Factor(size, tuple(d if j == k else None for j in range(n)), tuple(d if j == k else None for j in range(n)))
            for k, v in enumerate(ins) for d, size in enumerate(v.shape)
        ]
        strategies += factor_strategies(op, ins, outs, mesh, one_at_a_time)
    return strategies


@register(*UNPLANNED_LOOPS)
def _unplanned_loop_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    warnings.warn(
        f"autoshard does not plan inside {op.primitive!r} (its bodies have side effects, such as a callback or a "
        f"debug print, which a re-emitted loop would reorder); it is planned replicated: every operand and "
        f"result whole on every device{' at ' + op.source if op.source else ''}. Move the side effect out of the "
        f"{'loop' if op.primitive == 'while' else 'branches'} to have its body planned.",
        UnsupportedPrimitiveWarning, stacklevel=2)
    return []


@register("cond_merge")
def _cond_merge_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """``k`` branch results -> the cond's result, every one in the result's layout (each branch reshards
    into it inside the branch)."""
    factors = [Factor(size, (d,) * len(ins), (d,)) for d, size in enumerate(outs[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors, note="one layout for every branch")


@register("loop_slice")
def _loop_slice_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """``[length, *s] -> s``: every slice dim may split, with the same axes in the stack; dim 0 never."""
    factors = [Factor(size, (d + 1,), (d,)) for d, size in enumerate(outs[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors, note="slice per iteration")


@register("loop_stack")
def _loop_stack_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    """``s -> [length, *s]``, the slice's layout kept under an unsplit leading axis."""
    factors = [Factor(size, (d,), (d + 1,)) for d, size in enumerate(ins[0].shape)]
    return factor_strategies(op, ins, outs, mesh, factors, note="stacked per iteration")
