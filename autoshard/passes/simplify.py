"""Shrink the intra-op problem: followers and repeated layers share one ILP variable.

Every graph node (an input leaf or an op) gets a *class* (one ILP variable)
and a map from the class's strategy index to the node's own strategy index.

1. Followers (Alpa's "follow" ops): an op with one non-constant input whose
   output has as many elements as its input (elementwise, convert, reshape,
   transpose) or is a broadcast of it joins its producer's class; for each
   producer strategy it takes its own strategy that consumes that spec
   without resharding (preferring one that splits no further).
2. Repeated layers: the remaining ops, in program order, are turned into a
   token sequence (primitive, parameters, shapes). Tandem repeats — a block of
   P tokens repeated k times back to back, as a Python loop over identical
   layers produces in the forward pass, the backward pass and the optimizer
   update — are found for every period with one vectorised comparison, taken
   greedily by how many ops they save, and op j of repeat r is tied to op j
   of the first repeat. Tying is always sound (the ILP prices every instance,
   edges included); it only restricts the plan to the same choice per layer.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.compiler.graph import Op, OpGraph, Role
from autoshard.passes.strategies.base import Strategy

FOLLOWER_EXCLUDED = frozenset({
    "dot_general", "conv_general_dilated", "gather", "scatter-add", "scatter_add", "scatter", "dynamic_slice",
    "dynamic_update_slice", "scan", "while", "cond", "sort", "top_k", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "argmax", "argmin", "iota", "rng_bit_generator", "random_bits",
})


@dataclass(frozen=True)
class NodeClasses:
    """Node i (inputs first, then ops) uses ILP variable ``node_class[i]`` via ``strategy_map[i]``."""

    node_class: np.ndarray  # int per node
    strategy_map: tuple[np.ndarray, ...]  # per node: class strategy index -> own strategy index
    class_size: tuple[int, ...]  # strategies per class
    class_root: tuple[int, ...]  # the node whose strategy list defines the class
    num_followers: int
    num_tied: int

    @property
    def num_classes(self) -> int:
        return len(self.class_size)


def _param_key(value: object) -> str:
    text = repr(value)
    if len(text) > 200:
        return hashlib.sha1(text.encode()).hexdigest()
    return text


def op_token(graph: OpGraph, op: Op) -> tuple:
    """Structural signature of an op (no ids): what must match for two ops to share a strategy list."""
    params = tuple(sorted((k, _param_key(v)) for k, v in op.params.items()))
    ins = tuple((graph.values[v].shape, graph.values[v].dtype, graph.values[v].role == Role.CONSTANT)
                for v in op.inputs)
    outs = tuple((graph.values[v].shape, graph.values[v].dtype) for v in op.outputs)
    return (op.primitive, params, ins, outs)


def find_tandem_repeats(tokens: Sequence[int], min_period: int = 1) -> list[tuple[int, int, int]]:
    """Non-overlapping tandem repeats as (start, period, repeats), most ops saved first."""
    seq = np.asarray(tokens, dtype=np.int64)
    n = len(seq)
    candidates: list[tuple[int, int, int, int]] = []
    for period in range(max(1, min_period), n // 2 + 1):
        match = seq[:-period] == seq[period:]
        if not match.any():
            continue
        padded = np.concatenate(([False], match, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        for start, stop in zip(edges[::2], edges[1::2]):
            length = int(stop - start)
            if length < period:
                continue
            repeats = (length + period) // period
            candidates.append(((repeats - 1) * period, period, int(start), repeats))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    taken = np.zeros(n, dtype=bool)
    chosen: list[tuple[int, int, int]] = []
    for _saved, period, start, repeats in candidates:
        stop = start + period * repeats
        if taken[start:stop].any():
            continue
        taken[start:stop] = True
        chosen.append((start, period, repeats))
    return sorted(chosen)


def _producer_index(graph: OpGraph, num_inputs: int) -> dict[int, tuple[int, int]]:
    """value id -> (node index, output position)."""
    where: dict[int, tuple[int, int]] = {}
    for i, vid in enumerate(graph.inputs):
        where.setdefault(vid, (i, 0))
    for j, op in enumerate(graph.ops):
        for k, vid in enumerate(op.outputs):
            where[vid] = (num_inputs + j, k)
    return where


def _follow_map(
    producer_strats: list[Strategy], producer_map: np.ndarray, out_pos: int,
    own: list[Strategy], in_pos: int,
) -> np.ndarray | None:
    mapping = np.empty(len(producer_map), dtype=np.int64)
    for a, p_index in enumerate(producer_map):
        spec = producer_strats[p_index].out_specs[out_pos]
        matches = [i for i, s in enumerate(own) if s.in_specs[in_pos] == spec]
        if not matches:
            return None
        no_extra = [i for i in matches if set(own[i].out_specs[0].used_axes) <= set(spec.used_axes)]
        pool = no_extra or matches
        mapping[a] = min(pool, key=lambda i: own[i].cost_s)
    return mapping


def _is_follower_candidate(graph: OpGraph, op: Op) -> int | None:
    """The input position an op would follow, or None."""
    if op.primitive in FOLLOWER_EXCLUDED or len(op.outputs) != 1:
        return None
    live = [i for i, v in enumerate(op.inputs) if graph.values[v].role != Role.CONSTANT]
    if len(live) != 1:
        return None
    src = graph.values[op.inputs[live[0]]]
    out = graph.values[op.outputs[0]]
    if out.size != src.size and op.primitive != "broadcast_in_dim":
        return None
    return live[0]


def build_classes(graph: OpGraph, strategies: Sequence[list[Strategy]], *, tie_layers: bool = True,
                  merge_followers: bool = True) -> NodeClasses:
    """Assign every node a class and a strategy map (see the module docstring)."""
    num_inputs = len(graph.inputs)
    num_nodes = num_inputs + len(graph.ops)
    where = _producer_index(graph, num_inputs)
    # root[i] = node whose class i joins; maps compose along follower chains.
    root = np.arange(num_nodes)
    maps: list[np.ndarray] = [np.arange(len(s)) for s in strategies]
    followers = 0
    if merge_followers:
        for j, op in enumerate(graph.ops):
            node = num_inputs + j
            pos = _is_follower_candidate(graph, op)
            if pos is None:
                continue
            p_node, out_pos = where[op.inputs[pos]]
            r = root[p_node]
            mapping = _follow_map(strategies[p_node], maps[p_node], out_pos, strategies[node], pos)
            if mapping is None:
                continue
            root[node], maps[node] = r, mapping
            followers += 1
    # Repeated layers among the ops that are their own roots.
    tied = 0
    if tie_layers:
        root_ops = [j for j in range(len(graph.ops)) if root[num_inputs + j] == num_inputs + j]
        token_ids: dict[tuple, int] = {}
        tokens = [token_ids.setdefault(op_token(graph, graph.ops[j]), len(token_ids)) for j in root_ops]
        alias = np.arange(num_nodes)
        for start, period, repeats in find_tandem_repeats(tokens):
            for r in range(1, repeats):
                for k in range(period):
                    a = num_inputs + root_ops[start + k]
                    b = num_inputs + root_ops[start + r * period + k]
                    if len(strategies[a]) == len(strategies[b]):
                        alias[b] = a
                        tied += 1
        for node in range(num_nodes):
            r = root[node]
            if alias[r] != r:
                root[node] = alias[r]  # maps index the root's strategy list; tied roots have identical lists
        tied += _tie_inputs(graph, root, where, num_inputs, strategies)
        root = root[root]  # followers of a tied input follow its representative
    class_of_root: dict[int, int] = {}
    node_class = np.empty(num_nodes, dtype=np.int64)
    for node in range(num_nodes):
        node_class[node] = class_of_root.setdefault(int(root[node]), len(class_of_root))
    class_root = tuple(sorted(class_of_root, key=class_of_root.get))
    class_size = tuple(len(strategies[r]) for r in class_root)
    return NodeClasses(node_class, tuple(maps), class_size, class_root, followers, tied)


def _tie_inputs(graph: OpGraph, root: np.ndarray, where: dict[int, tuple[int, int]], num_inputs: int,
                strategies: Sequence[list[Strategy]]) -> int:
    """Tie input leaves (parameters of repeated layers) whose consumers all sit in the same tied classes."""
    uses: dict[int, list[tuple[int, int]]] = {i: [] for i in range(num_inputs)}
    for j, op in enumerate(graph.ops):
        for pos, vid in enumerate(op.inputs):
            node, _ = where.get(vid, (-1, 0))
            if 0 <= node < num_inputs:
                uses[node].append((int(root[num_inputs + j]), pos))
    first: dict[tuple, int] = {}
    tied = 0
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        if not uses[i] or root[i] != i:
            continue
        key = (value.shape, value.dtype, value.role, tuple(sorted(set(uses[i]))))
        if key in first and len(strategies[first[key]]) == len(strategies[i]):
            root[i] = first[key]
            tied += 1
        else:
            first.setdefault(key, i)
    return tied
