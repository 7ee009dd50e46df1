"""Whether a traced train step clips its gradients by global norm, and at what norm.

Global-norm clipping (``optax.clip_by_global_norm(c)``, or the same written by
hand) compares one scalar with a constant ``c``: the square root of a sum with
one reduction per gradient leaf, ``sqrt(sum_i sum(g_i ** 2)) < c``. The pattern
is found structurally: a scalar comparison against a scalar constant whose
other side is (through scalar casts and reshapes) a ``sqrt`` of an ``add``
chain of at least as many ``reduce_sum``s as the step has parameter leaves.
A norm over fewer leaves (a per-layer norm, a loss) is not global clipping.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from autoshard.ir.graph import Op, OpGraph, Role, ValueId
from autoshard.ir.primitives import Values, facts, primitives

# a norm's value through casts, copies, reshapes and abs (|norm| is the norm)
PASS_THROUGH = primitives(lambda f: f.values in (Values.CAST, Values.COPY, Values.REARRANGED)) | {"abs"}


def global_norm_clip(graph: OpGraph) -> float | None:
    """The clipping norm ``c`` of the step's global-norm clipping, or None when it does not clip."""
    producer = graph.producers()
    num_params = len(graph.inputs_with_role(Role.PARAM))
    if num_params == 0:
        return None
    for op in graph.ops:
        if facts(op.primitive).order is None or len(op.inputs) != 2:
            continue
        constant = [v for v in op.inputs if v in graph.constants and np.ndim(graph.constants[v]) == 0]
        computed = [v for v in op.inputs if v not in graph.constants and graph.values[v].rank == 0]
        if len(constant) != 1 or len(computed) != 1:
            continue
        root = computed[0]
        while root in producer and producer[root].primitive in PASS_THROUGH:
            root = producer[root].inputs[0]
        norm = producer.get(root)
        if norm is None or norm.primitive != "sqrt":
            continue
        if _reductions_summed(producer, norm.inputs[0]) >= num_params:
            return float(np.asarray(graph.constants[constant[0]]))
    return None


def _reductions_summed(producer: Mapping[ValueId, Op], value: ValueId) -> int:
    """How many ``reduce_sum`` results an ``add`` chain ending in ``value`` sums."""
    count, stack = 0, [value]
    while stack:
        v = stack.pop()
        op = producer.get(v)
        if op is None:
            continue
        if op.primitive == "reduce_sum":
            count += 1
        elif op.primitive == "add":
            stack.extend(op.inputs)
        elif op.primitive in PASS_THROUGH:
            stack.append(op.inputs[0])
    return count
