"""Control flow, random numbers, identities and host callbacks.

scan / while / cond are planned replicated for now: their bodies are not
solved, so every operand and result is whole on every device (correct, and
the warning-free default until a later pass solves bodies and offers the
body's strategies here).

Random primitives are replicated only: a shard of ``random_bits`` is not the
local computation on a shard of the key (the counter is a global iota), and
keys are tiny. They are registered so that they do not warn. The same holds
for host callbacks and the other replicated-only ops below.

Identities (optimization_barrier, sharding_constraint, reshard, device_put,
checkpoint ``name``) pass every split through. A user sharding constraint is
not enforced: it names a mesh of its own, and the planner decides the layout.
Their params name global shardings, so one shard's local computation is the
identity itself (``LOCAL_IDENTITY``), not a bind of the primitive.
"""
from __future__ import annotations

from collections.abc import Sequence

from autoshard.ir.graph import Op, Value
from autoshard.meshes.logical import LogicalMesh
from autoshard.passes.strategies.base import Factor, Strategy, factor_strategies, register

CONTROL_FLOW = ("scan", "while", "cond")
RANDOM = (
    "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap", "random_unwrap",
    "random_clone", "random_gamma", "threefry2x32", "threefry4x32", "philox2x32", "philox4x32",
    "iota_2x32_shape", "rng_bit_generator", "rng_uniform",
)
REPLICATED_ONLY = ("pure_callback", "io_callback", "platform_index")
LOCAL_IDENTITY = ("sharding_constraint", "reshard", "device_put", "layout_constraint")
IDENTITY = ("optimization_barrier", "name", *LOCAL_IDENTITY)


@register(*CONTROL_FLOW, *RANDOM, *REPLICATED_ONLY)
def _replicated_rule(op: Op, ins: Sequence[Value], outs: Sequence[Value], mesh: LogicalMesh) -> list[Strategy]:
    return []  # strategies_for adds the replicated strategy


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
