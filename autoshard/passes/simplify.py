"""Shrink the intra-op problem: followers and repeated layers share one ILP variable.

Every graph node (an input leaf or an op) gets a *class* (one ILP variable)
and a map from the class's strategy index to the node's own strategy index.

1. Followers (Alpa's "follow" ops): an op with one non-constant input whose
   output has as many elements as its input (elementwise, convert, reshape,
   transpose), and that is that value's only reader, joins its producer's class; for each
   producer strategy it takes its own strategy that consumes that spec
   without resharding (preferring one that splits no further). An op whose
   output layout is a choice of its own (``own_layout`` in ``ir/primitives.py``:
   contractions, indexing, sorts, loops, a scan's carry) never follows.
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

import collections
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from autoshard.ir.graph import Op, OpGraph, Role, ValueId
from autoshard.ir.primitives import facts
from autoshard.passes.strategies.base import Strategy


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
    reached, last_period = 0, 0
    for period, anchor in _square_anchors(seq, max(1, min_period)):
        if period != last_period:
            reached, last_period = 0, period
        if anchor < reached:
            continue
        start, stop = _run_bounds(seq, anchor, period)
        reached = stop
        length = stop - start
        if length < period:
            continue
        repeats = (length + period) // period
        candidates.append(((repeats - 1) * period, period, start, repeats))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    # Copies 2..k of a chosen repeat are taken; its first copy stays open for nested repeats
    # (the mu and nu halves of Adam's state repeat each other, and each repeats per layer inside).
    taken = np.zeros(n, dtype=bool)
    chosen: list[tuple[int, int, int]] = []
    for _saved, period, start, repeats in candidates:
        stop = start + period * repeats
        if taken[start:stop].any():
            continue
        taken[start + period:stop] = True
        chosen.append((start, period, repeats))
    return sorted(chosen)


def _square_anchors(seq: np.ndarray, min_period: int) -> list[tuple[int, int]]:
    """(period, i) with i a multiple of period and seq[i] == seq[i + period], sorted.

    A run of seq[i] == seq[i + period] at least ``period`` long (two or more copies) holds a multiple of
    ``period``, so these anchors find every such run with n / period tests per period (n log n over all
    periods), made as a few numpy compares: by period up to sqrt(n), by multiple above.
    """
    n = len(seq)
    split = max(int(np.sqrt(n)), 1)
    periods: list[np.ndarray] = []
    anchors: list[np.ndarray] = []
    for period in range(min_period, min(split, n // 2) + 1):
        at = np.arange(0, n - period, period)
        hit = at[seq[at] == seq[at + period]]
        periods.append(np.full(len(hit), period))
        anchors.append(hit)
    lowest = max(min_period, split + 1)
    for k in range(0, n):  # anchor k * period for the periods above ``split``
        if k * lowest >= n - lowest:
            break
        period = np.arange(lowest, (n - 1) // (k + 1) + 1)  # k * period < n - period
        period = period[period <= n // 2]
        at = k * period
        hit = seq[at] == seq[at + period]
        periods.append(period[hit])
        anchors.append(at[hit])
    if not periods:
        return []
    p, a = np.concatenate(periods), np.concatenate(anchors)
    order = np.lexsort((a, p))
    return list(zip(p[order].tolist(), a[order].tolist()))


def _run_bounds(seq: np.ndarray, i: int, period: int) -> tuple[int, int]:
    """The maximal [start, stop) around ``i`` where seq[j] == seq[j + period], by galloping numpy compares."""
    n = len(seq)
    stop, step = i, 16
    while stop < n - period:
        hi = min(stop + step, n - period)
        miss = np.flatnonzero(seq[stop:hi] != seq[stop + period:hi + period])
        if miss.size:
            stop += int(miss[0])
            break
        stop, step = hi, step * 2
    start, step = i, 16
    while start > 0:
        lo = max(start - step, 0)
        miss = np.flatnonzero(seq[lo:start] != seq[lo + period:start + period])
        if miss.size:
            start = lo + int(miss[-1]) + 1
            break
        start, step = lo, step * 2
    return start, stop


def repeat_aliases(tokens: Sequence[int]) -> np.ndarray:
    """For each position, the earliest position it repeats (itself when it repeats nothing)."""
    alias = np.arange(len(tokens))
    for start, period, repeats in find_tandem_repeats(tokens):
        for r in range(1, repeats):
            alias[start + r * period: start + (r + 1) * period] = np.arange(start, start + period)
    for i in range(len(alias)):  # aliases point backwards: resolve chains in one forward sweep
        alias[i] = alias[alias[i]]
    return alias


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


def _is_follower_candidate(graph: OpGraph, op: Op, where: dict[int, tuple[int, int]],
                           readers: Mapping[ValueId, int]) -> int | None:
    """The input position an op would follow, or None.

    Only the sole reader of a value follows it: where several ops read a value, one copy of it in
    another layout can serve them all (XLA makes each layout of a value once), which a follower, bound
    to the value's own layout, would rule out (a batch read by a dot and by its transpose for the
    gradient, say: both read it gathered, once).

    One live input: follow it when the output has as many elements. A broadcast
    that grows its input is never a follower: following would copy the input's
    split to the result, and a broadcast scalar would force a batch-sized result
    (and everything that follows it) replicated. Several live inputs (elementwise ops such as an Adam update):
    follow the most recently produced operand of the output's size, as Alpa
    follows an elementwise op's largest operand; the others reshard to it.
    """
    row = facts(op.primitive)
    if row.own_layout or len(op.outputs) != 1:
        return None
    live = [i for i, v in enumerate(op.inputs) if graph.values[v].role != Role.CONSTANT]
    out = graph.values[op.outputs[0]]
    if len(live) == 1:
        if out.size != graph.values[op.inputs[live[0]]].size:
            return None  # a broadcast that grows its input: how to split the new elements is a choice of its own
        return live[0] if readers[op.inputs[live[0]]] == 1 else None
    if not row.fusible or not live:
        return None
    same = [i for i in live if graph.values[op.inputs[i]].shape == out.shape]
    if not same:
        return None
    pos = max(same, key=lambda i: where.get(op.inputs[i], (-1, 0))[0])
    return pos if readers[op.inputs[pos]] == 1 else None


def build_classes(graph: OpGraph, strategies: Sequence[list[Strategy]], *, tie_layers: bool = True,
                  merge_followers: bool = True) -> NodeClasses:
    """Assign every node a class and a strategy map (see the module docstring)."""
    num_inputs = len(graph.inputs)
    num_nodes = num_inputs + len(graph.ops)
    where = graph.producer_nodes()
    # root[i] = node whose class i joins; maps compose along follower chains.
    root = np.arange(num_nodes)
    maps: list[np.ndarray] = [np.arange(len(s)) for s in strategies]
    follow_cache: dict[tuple, np.ndarray | None] = {}
    followers = 0
    if merge_followers:
        readers: collections.Counter[ValueId] = collections.Counter()
        for op in graph.ops:
            readers.update(set(op.inputs))
        readers.update(v for v, i in zip(graph.outputs, graph.carried or ()) if i is not None)  # written back
        for j, op in enumerate(graph.ops):
            node = num_inputs + j
            pos = _is_follower_candidate(graph, op, where, readers)
            if pos is None:
                continue
            p_node, out_pos = where[op.inputs[pos]]
            r = root[p_node]
            key = (id(strategies[p_node]), maps[p_node].tobytes(), out_pos, id(strategies[node]), pos)
            if key not in follow_cache:
                follow_cache[key] = _follow_map(strategies[p_node], maps[p_node], out_pos, strategies[node], pos)
            mapping = follow_cache[key]
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
        for k, first in enumerate(repeat_aliases(tokens)):
            a, b = num_inputs + root_ops[first], num_inputs + root_ops[k]
            if a != b and len(strategies[a]) == len(strategies[b]):
                alias[b] = a
                tied += 1
        for node in range(num_nodes):
            r = root[node]
            if alias[r] != r:
                root[node] = alias[r]  # maps index the root's strategy list; tied roots have identical lists
        tied += _tie_inputs(graph, root, strategies)
        root = root[root]  # followers of a tied input follow its representative
    class_of_root: dict[int, int] = {}
    node_class = np.empty(num_nodes, dtype=np.int64)
    for node in range(num_nodes):
        node_class[node] = class_of_root.setdefault(int(root[node]), len(class_of_root))
    class_root = tuple(sorted(class_of_root, key=class_of_root.get))
    class_size = tuple(len(strategies[r]) for r in class_root)
    return NodeClasses(node_class, tuple(maps), class_size, class_root, followers, tied)


_DIGITS = re.compile(r"\d+")
_ARGUMENT = re.compile(r"^\[\d+\]")  # a flat input's path starts with the index of the step's argument


def layer_free_path(path: str | None) -> str:
    """A pytree path with layer numbers blanked: ``[0]['blocks'][3]['q']`` and ``[0]['blocks'][5]['q']``,
    or ``['layers_3']`` and ``['layers_5']``, become the same key. The leading argument index stays:
    ``[1]`` and ``[2]`` (two arguments of one shape: features and targets, say) are not layers."""
    path = path or ""
    argument = _ARGUMENT.match(path)
    head = argument.group(0) if argument else ""
    return head + _DIGITS.sub("#", path[len(head):])


def _tie_inputs(graph: OpGraph, root: np.ndarray, strategies: Sequence[list[Strategy]]) -> int:
    """Tie input leaves of repeated layers: same shape, dtype, role and path up to layer numbers.

    ``blocks[3].attn.q.kernel`` ties to ``blocks[0].attn.q.kernel`` (and its Adam moments to
    its moments), never to ``attn.out.kernel``, which may want another layout.
    """
    first: dict[tuple, int] = {}
    tied = 0
    for i, vid in enumerate(graph.inputs):
        value = graph.values[vid]
        key = (value.shape, value.dtype, value.role, layer_free_path(value.path))
        a = first.setdefault(key, i)
        if a != i and root[i] == i and len(strategies[a]) == len(strategies[i]):
            root[i] = root[a]
            tied += 1
    return tied
