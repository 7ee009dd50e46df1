"""Liveness of values over program points, and which values XLA materialises.

Point t (0 ≤ t < number of ops) is the execution of op t; its inputs and
outputs are live there. Graph inputs are live throughout (the caller owns
argument buffers; donated state is reused for the updated state, so carried
outputs add nothing). Other outputs live from their definition to the end;
intermediates from their definition to their last use.

XLA fuses chains of elementwise ops, so a value produced by a fusible op and
read only by fusible ops never reaches memory; ``materialized_values`` drops
those from the count.
"""
from __future__ import annotations

from autoshard.compiler.graph import OpGraph, Role, ValueId

FUSIBLE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil",
    "clamp", "convert_element_type", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "digamma", "log", "log1p",
    "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "rem", "round",
    "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor",
    "broadcast_in_dim", "copy", "copy_p", "reduce_precision", "shift_left", "shift_right_logical",
    "shift_right_arithmetic", "population_count", "iota",
})


def liveness_intervals(graph: OpGraph) -> dict[ValueId, tuple[int, int]]:
    """value id -> (first point, last point) inclusive."""
    end = len(graph.ops)
    live: dict[ValueId, tuple[int, int]] = {}
    for vid in graph.inputs:
        live[vid] = (0, end)
    for t, op in enumerate(graph.ops):
        for vid in op.outputs:
            live.setdefault(vid, (t, t))
        for vid in op.inputs:
            if vid in live and graph.values[vid].role != Role.CONSTANT:
                start, stop = live[vid]
                live[vid] = (start, max(stop, t))
    carried = {graph.outputs[k] for k, i in enumerate(graph.carried or ()) if i is not None}
    for vid in graph.outputs:
        if vid in live and vid not in graph.inputs:
            start, _ = live[vid]
            if vid in carried:
                live.pop(vid)  # written into the donated input buffer
            else:
                live[vid] = (start, end)
    return live


def materialized_values(graph: OpGraph) -> set[ValueId]:
    """Values that occupy memory: inputs, outputs, and anything not fused away."""
    fusible_consumer: dict[ValueId, bool] = {}
    for op in graph.ops:
        fusible = op.primitive in FUSIBLE
        for vid in op.inputs:
            fusible_consumer[vid] = fusible_consumer.get(vid, True) and fusible
    keep = set(graph.inputs) | set(graph.outputs)
    for op in graph.ops:
        if op.primitive in FUSIBLE:
            keep.update(v for v in op.outputs if not fusible_consumer.get(v, True))
        else:
            keep.update(op.outputs)
    return keep
