"""Rule 5 of the memory model (passes/buffer_rules.combine_all_reduces): gradient reductions combined into
groups in program order, each group one instruction that waits for all its members. Groups of two keys that
each wait for the other would be a cycle: the model's schedule has none (a random program of the fuzz corpus
met one: two reductions over x and two over y, each over-y one reading an over-x result and the reverse)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from autoshard.ir.spec import Collective
from autoshard.ir.trace import trace
from autoshard.passes.buffer_rules import combine_all_reduces


def _crossed(x, w1, w2, w3, w4):
    a1 = x @ w1  # reduced over x
    b2 = x @ w2  # reduced over y
    b1 = jnp.tanh(a1) @ w3  # over y, reads a1
    a2 = jnp.tanh(b2) @ w4  # over x, reads b2
    return a1, b2, b1, a2


def _groups_depend(graph, groups) -> dict[int, set[int]]:
    """Per group, the groups whose combined result some member's operands need."""
    producer = {v: t for t, op in enumerate(graph.ops) for v in op.outputs}
    group_of = {t: g for g, members in enumerate(groups) for t in members}
    needs: dict[int, set[int]] = {}

    def upstream(t: int, seen: set[int]) -> set[int]:
        found = set()
        for v in graph.ops[t].inputs:
            p = producer.get(v)
            if p is None or p in seen:
                continue
            seen.add(p)
            found |= {group_of[p]} if p in group_of else upstream(p, seen)
        return found

    for g, members in enumerate(groups):
        needs[g] = set().union(*(upstream(t, set()) for t in members))
    return needs


def test_combined_groups_never_wait_for_each_other():
    shape = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    graph = trace(_crossed, *([shape] * 5))
    dots = [t for t, op in enumerate(graph.ops) if op.primitive == "dot_general"]
    assert len(dots) == 4
    a1, b2, b1, a2 = dots
    axes = {a1: ("x",), a2: ("x",), b1: ("y",), b2: ("y",)}
    collectives = {t: (Collective("all-reduce", axes[t], 256.0),) for t in dots}
    groups = combine_all_reduces(graph, sorted(dots), collectives, {t: "sum" for t in dots})
    assert sorted(t for g in groups for t in g) == sorted(dots)
    needs = _groups_depend(graph, groups)
    order, done = [], set()
    while len(order) < len(groups):  # a topological order of the groups exists: no cycle
        ready = [g for g in range(len(groups)) if g not in done and needs[g] <= done]
        assert ready, f"combined groups wait for each other: {groups}, needs {needs}"
        order.append(ready[0])
        done.add(ready[0])
    # b1 reads a1: a1's group closes, and a2 (reading b2) starts a group of its own
    assert [a1] in groups and [a2] in groups and sorted([b2, b1]) in [sorted(g) for g in groups]


def test_a_reduction_over_two_split_dims_holds_one_partial_sum():
    """``einsum("bsd,bsf->df")`` with b split over x and s over y: two all-reduces of the whole [d, f] result
    (XLA reduces each split dim apart; tests/sim/test_strategy_rules.py checks that against the HLO), but the
    second reduces what the first wrote: one partial-sum buffer, as with one all-reduce over both axes."""
    import jax
    import jax.numpy as jnp

    from autoshard.ir.spec import Collective, Spec, partial_sums
    from autoshard.ir.trace import trace
    from autoshard.passes.memory_model import simulate

    a, b = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32), jax.ShapeDtypeStruct((8, 16, 64), jnp.float32)
    graph = trace(lambda x, y: jnp.einsum("bsd,bsf->df", x, y), a, b)
    (t, op), = [(t, op) for t, op in enumerate(graph.ops) if op.primitive == "dot_general"]
    result = 32 * 64 * 4.0
    twice = (Collective("all-reduce", ("x",), result), Collective("all-reduce", ("y",), result))
    assert partial_sums(twice) == twice[:1]
    assert partial_sums((Collective("reduce-scatter", ("x", "y"), result),)) == (
        Collective("reduce-scatter", ("x", "y"), result),)
    split = Spec((("x",), ("y",), ()))
    specs = {op.inputs[0]: split, op.inputs[1]: split, op.outputs[0]: Spec(((), ()))}
    sim = simulate(graph, specs, {"x": 2, "y": 4}, op_collectives={t: twice}, op_reductions={t: "sum"})
    assert [s.nbytes for s in sim.spans if s.kind == "partial sum"] == [result]
